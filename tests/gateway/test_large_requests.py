"""Large requests through a real gateway and a real tiny worker, both preparing them off the event
loop (the gateway from limits.offload_min_bytes, set low here; the worker from 8 KiB): the answer
is the one a small request gets, and every refusal is the 400 the inline path gives."""

from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import pytest

from tests.gateway.conftest import API_KEY, MODEL, gateway_config, start_gateway, start_tiny_worker, worker_entry

pytestmark = pytest.mark.slow  # gateway and worker processes

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
PADDING = "x" * 100_000  # an ignored field that makes the body large (the worker passes `user` on unread)


@pytest.fixture(scope="module")
def urls(gateway_model_dir, tmp_path_factory):
    with ExitStack() as stack:
        worker = start_tiny_worker(stack, gateway_model_dir)
        config = gateway_config([worker_entry("w0", worker.url)], gateway_model_dir,
                                limits={"offload_min_bytes": 1024})
        config["pools"]["default"]["max_model_len"] = MAX_MODEL_LEN
        gateway = start_gateway(stack, config, tmp_path_factory.mktemp("large"))
        yield {"gateway": gateway.url, "worker": worker.url}


def post(url: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else httpx.Request("POST", url, json=body).content
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={**AUTH, "content-type": "application/json"})


COMPLETION = {"model": MODEL, "prompt": "the cat sat on the", "max_tokens": 6, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "the cat sat on the"}], "max_tokens": 6,
        "temperature": 0}


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", COMPLETION, "text"),
    ("/v1/chat/completions", CHAT, "message"),
], ids=["completion", "chat"])
@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_a_large_request_gets_the_answer_a_small_one_gets(urls, path, body, field, target):
    small = post(urls[target], path, body)
    large = post(urls[target], path, {**body, "user": PADDING})
    assert small.status_code == large.status_code == 200, large.text
    choice = large.json()["choices"][0]
    assert choice == small.json()["choices"][0] and choice[field]


def test_a_large_stream_gets_the_answer_a_small_one_gets(urls):
    def streamed_text(body: dict) -> str:
        with httpx.stream("POST", f"{urls['gateway']}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=60) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: {")]
        return "".join(json.loads(event)["choices"][0]["text"] for event in events if json.loads(event)["choices"])

    small = streamed_text(COMPLETION)
    assert small and streamed_text({**COMPLETION, "user": PADDING}) == small


@pytest.mark.parametrize("num_ids", [50_000, 200_000], ids=["refused-by-length", "refused-while-parsing"])
@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_a_token_id_prompt_over_the_context_is_refused_with_context_length_exceeded(urls, target, num_ids):
    """More ids than max_model_len + kvgate.json_body.MAX_OTHER_INTEGERS stop the parse itself."""
    response = post(urls[target], "/v1/completions", {**COMPLETION, "prompt": [5] * num_ids})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_a_long_text_prompt_over_the_context_is_refused(urls, target):
    response = post(urls[target], "/v1/completions", {**COMPLETION, "prompt": "the cat " * 20_000})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"model": "tiny", "prompt": "hi", "user": "' + PADDING.encode() + b'\\ud800"}', "unpaired UTF-16 surrogate"),
    (b'{"model": "tiny", "prompt": "hi", "user": "' + PADDING.encode() + b'", "temperature": NaN}', "NaN"),
    (b'{"model": "tiny", "prompt": "hi", "user": "' + PADDING.encode() + b'"', "not valid JSON"),
], ids=["lone-surrogate", "nan", "truncated"])
@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_a_large_body_that_is_not_strict_json_is_a_400(urls, target, raw, message):
    response = post(urls[target], "/v1/completions", raw)
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert post(urls[target], "/v1/completions", COMPLETION).status_code == 200  # the process goes on
