"""What a real worker server takes from a request, and what it refuses: priority only from the gateway's
x-priority header, prompt token ids only within the model's embedding rows, and a body nested too deep
refused with a 400 that leaves the keep-alive connection usable."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.tiny_models import build_model_dir
from tests.worker.inprocess import completion, serving, tiny_executor, worker_state
from worker.model.tokenizer import load_tokenizer

NUM_EMBEDDING_ROWS = 300  # fewer than the tokenizer's 384 tokens: ids 300..383 decode but have no row
PROMPT = [5, 17, 200, 33]  # ids the model has rows for (text may tokenize to ids past them)


@pytest.fixture(scope="module")
def short_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with an embedding of NUM_EMBEDDING_ROWS rows under its 384-token tokenizer."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-short-vocab"), vocab_size=NUM_EMBEDDING_ROWS)


@pytest.fixture(scope="module")
def worker(short_vocab_dir):
    with serving(worker_state(short_vocab_dir, tiny_executor(short_vocab_dir))) as served:
        yield served


@pytest.fixture
def priorities(worker) -> list[int]:
    """The priority of every request the HTTP handlers hand to the engine, in order."""
    seen: list[int] = []
    engine = worker.state.engine
    generate_choices = engine.generate_choices

    def recording_generate_choices(request_ids, prompt_token_ids, params, priority=0, timing=None):
        seen.append(priority)
        return generate_choices(request_ids, prompt_token_ids, params, priority, timing)

    engine.generate_choices = recording_generate_choices
    yield seen
    del engine.generate_choices


def test_the_tokenizer_has_ids_the_model_has_no_rows_for(short_vocab_dir):
    assert load_tokenizer(short_vocab_dir).vocab_size > NUM_EMBEDDING_ROWS


@pytest.mark.parametrize("token_id", [NUM_EMBEDDING_ROWS, 383], ids=["first-id-past-the-rows", "last-tokenizer-id"])
def test_a_prompt_token_id_past_the_embedding_rows_is_a_400_naming_prompt(worker, token_id):
    response = completion(worker.url, prompt=[5, token_id])

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and str(NUM_EMBEDDING_ROWS) in error["message"]
    assert completion(worker.url, prompt=[5, NUM_EMBEDDING_ROWS - 1]).status_code == 200


@pytest.mark.parametrize(("body", "headers", "expected"), [
    ({"priority": -100}, {}, 0),
    ({"priority": -100}, {"x-priority": "7"}, 7),
    ({}, {"X-Priority": "-2"}, -2),
], ids=["body-ignored", "header-wins-over-body", "header-alone"])
def test_the_engine_gets_the_header_priority_never_the_body_one(worker, priorities, body, headers, expected):
    response = httpx.post(f"{worker.url}/v1/completions", headers=headers, timeout=30,
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **body})

    assert response.status_code == 200, response.text
    assert priorities == [expected]


def test_a_deeply_nested_body_is_a_400_and_the_connection_serves_the_next_request(worker):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with httpx.Client(base_url=worker.url, timeout=30) as client:
        refused = client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
        first_connection = refused.extensions["network_stream"].get_extra_info("client_addr")
        served = completion(worker.url, client, prompt=PROMPT)
        second_connection = served.extensions["network_stream"].get_extra_info("client_addr")

    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert served.status_code == 200 and second_connection == first_connection


def test_a_text_prompt_that_tokenizes_past_the_embedding_rows_is_a_400_not_a_failed_step(worker):
    tokenizer = worker.state.tokenizer
    text = "The quick brown fox " + tokenizer.decode([NUM_EMBEDDING_ROWS + 50])
    assert max(tokenizer.encode(text)) >= NUM_EMBEDDING_ROWS

    response = completion(worker.url, prompt=text)

    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
