"""The worker's OpenAI API as clients see it: the real `openai` SDK against a real worker process."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from loadtest.sse import StreamReader
from tests.processes import running_worker

pytestmark = pytest.mark.slow  # every test runs against a worker process

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def worker_url(tiny_llama_dir):
    with running_worker(tiny_llama_dir, "--block-size", str(BLOCK_SIZE), "--num-blocks", "128",
                        "--served-model-name", "tiny") as url:
        yield url


@pytest.fixture
def client(worker_url):
    with openai.OpenAI(base_url=f"{worker_url}/v1", api_key="unused") as c:
        yield c


def metric(worker_url: str, name: str) -> float:
    text = httpx.get(f"{worker_url}/metrics").text
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for_metric(worker_url: str, name: str, value: float, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(worker_url, name) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {metric(worker_url, name)}, expected {value}"
        time.sleep(0.05)


def test_models_reports_block_size_and_context_length(client):
    (model,) = client.models.list().data
    assert model.id == "tiny"
    assert model.model_extra["block_size"] == BLOCK_SIZE
    assert model.model_extra["max_model_len"] == 512
    assert model.model_extra["executor"] == "torch"


def test_completion_non_streaming(client):
    result = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert result.object == "text_completion"
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_streaming_text_equals_non_streaming_text_greedy(client):
    args = dict(model="tiny", prompt="Hello world, this is", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stream = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_non_streaming_and_streaming_agree(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_async_client_runs_concurrent_requests(worker_url):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{worker_url}/v1", api_key="unused") as aclient:
            calls = [aclient.completions.create(model="tiny", prompt=f"Paged attention {i}", max_tokens=4,
                                                temperature=0, extra_body={"ignore_eos": True})
                     for i in range(8)]
            return await asyncio.gather(*calls)

    results = asyncio.run(main())
    assert all(r.usage.completion_tokens == 4 for r in results)


def test_repeated_prompt_reports_cached_tokens_in_whole_blocks(client):
    prompt = "Paged attention stores keys and values in fixed size blocks. " * 3
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached % BLOCK_SIZE == 0
    assert second.usage.prompt_tokens - BLOCK_SIZE <= cached < second.usage.prompt_tokens


def test_token_id_prompt_and_return_token_ids(client):
    result = client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=3, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = result.choices[0].model_extra
    assert choice["prompt_token_ids"] == [5, 6, 7, 8, 9]
    assert len(choice["token_ids"]) == 3


def test_continue_final_message_extends_the_assistant_text(client):
    messages = [{"role": "user", "content": "Say hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    text = whole.choices[0].message.content
    ids = whole.choices[0].model_extra["token_ids"]
    # Continue from the first three generated tokens' text: the rest must match the uninterrupted run.
    start = client.completions.create(model="tiny", prompt=whole.model_extra["prompt_token_ids"] + ids[:3],
                                      max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    head = text[: len(text) - len(start.choices[0].text)]
    rest = client.chat.completions.create(
        model="tiny", messages=messages + [{"role": "assistant", "content": head}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    assert head + rest.choices[0].message.content == text


def test_text_parts_and_developer_role_render_as_joined_text_and_system(worker_url):
    def prompt_ids(messages):
        body = {"model": "tiny", "messages": messages, "max_tokens": 1, "return_token_ids": True}
        response = httpx.post(f"{worker_url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["prompt_token_ids"]

    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]
    as_parts = prompt_ids([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}])
    as_text = prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is\n2+2?"}])
    assert as_parts == as_text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 600}]}, "messages"),
    ("/v1/completions", {"prompt": "fox " * 600}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
     "max_completion_tokens"),
], ids=["chat-prompt", "completion-prompt", "chat-max-completion-tokens"])
def test_context_length_error_names_the_param_the_client_sent(worker_url, path, body, param):
    response = httpx.post(f"{worker_url}{path}", json={"model": "tiny", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)


def test_priority_header_and_body_field_are_accepted(worker_url):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "priority": -5}
    assert httpx.post(f"{worker_url}/v1/completions", json=body).status_code == 200
    response = httpx.post(f"{worker_url}/v1/completions", json={**body, "priority": None},
                          headers={"X-Priority": "3"})
    assert response.status_code == 200


BAD_INPUT = [
    ("malformed-json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid_request_error"),
    ("body-not-object", "/v1/completions", b"[1, 2]", 400, "invalid_request_error"),
    ("prompt-wrong-type", "/v1/completions", {"model": "tiny", "prompt": 42}, 400, "invalid_request_error"),
    ("empty-prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, 400, "invalid_request_error"),
    ("max-tokens-zero", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400,
     "invalid_request_error"),
    ("max-tokens-string", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400,
     "invalid_request_error"),
    ("max-tokens-past-context", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 100000}, 400,
     "invalid_request_error"),
    ("prompt-longer-than-context", "/v1/completions", {"model": "tiny", "prompt": [5] * 600}, 400,
     "invalid_request_error"),
    ("token-id-out-of-vocab", "/v1/completions", {"model": "tiny", "prompt": [5, 10**6]}, 400,
     "invalid_request_error"),
    ("temperature-negative", "/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400,
     "invalid_request_error"),
    ("n-zero", "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "invalid_request_error"),
    ("n-past-128", "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 129}, 400, "invalid_request_error"),
    ("empty-messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "invalid_request_error"),
    ("message-bad-role", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     400, "invalid_request_error"),
    ("messages-not-list", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "invalid_request_error"),
    ("message-without-content", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400,
     "invalid_request_error"),
    ("json-response-format", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "invalid_request_error"),
    ("template-rejects-role", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error"),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "NotFoundError"),
    ("bad-priority-header", "/v1/completions", {"model": "tiny", "prompt": "hi", "_headers": {"X-Priority": "high"}},
     400, "invalid_request_error"),
]


@pytest.mark.parametrize(("path", "body", "status", "error_type"), [c[1:] for c in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gets_openai_error_and_worker_keeps_serving(worker_url, client, path, body, status, error_type):
    headers = {"content-type": "application/json"}
    if isinstance(body, dict):
        headers.update(body.pop("_headers", {}))
        body = json.dumps(body).encode()
    response = httpx.post(f"{worker_url}{path}", content=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["message"]
    ok = client.completions.create(model="tiny", prompt="still serving", max_tokens=1)
    assert ok.usage.completion_tokens == 1


@pytest.mark.parametrize("n", [1, 3], ids=["one-choice", "three-choices"])
def test_client_that_disconnects_mid_stream_aborts_its_request(worker_url, n):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0, "n": n}
    with httpx.stream("POST", f"{worker_url}/v1/completions", json=body, timeout=30) as response:
        for received, _ in enumerate(StreamReader().read(response.iter_lines()), start=1):
            if received == 3:
                break
    wait_for_metric(worker_url, "vllm:num_requests_running", 0.0)
    wait_for_metric(worker_url, "vllm:kv_cache_usage_perc", 0.0)
    generated = metric(worker_url, "vllm:generation_tokens_total")
    time.sleep(0.3)
    assert metric(worker_url, "vllm:generation_tokens_total") == generated  # no work after the abort


def test_metrics_use_vllm_names(worker_url, client):
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=2)
    text = httpx.get(f"{worker_url}/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"]:
        assert f"\n{name}" in text, name
    assert 'kvgate_worker_info{executor="torch",model_name="tiny"} 1.0' in text
    assert f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",num_gpu_blocks="128"}} 1.0' in text  # a gateway reads it
