"""A completions request with a batch of prompts, through the gateway to real workers (which take one
prompt a request): each prompt served on its own, the answers merged as OpenAI's API gives a batch."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.gateway.conftest import API_KEY, MODEL, metric_value

pytestmark = pytest.mark.slow  # every test runs against the process fleet

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "A gateway routes each request"]


def _requests_total(fleet) -> float:
    return metric_value(fleet["gateway"].url, "kvgate_requests_total")


def test_a_batch_is_answered_as_its_prompts_alone_are_choice_by_choice(client, direct, fleet):
    alone = [direct.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, **GREEDY) for prompt in PROMPTS]
    before = _requests_total(fleet)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPTS, max_tokens=6, n=2, **GREEDY)
    batch = raw.parse()
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [c.text for answer in alone for c in answer.choices]
    assert [c.finish_reason for c in batch.choices] == ["length"] * 6
    assert batch.usage.prompt_tokens == sum(answer.usage.prompt_tokens for answer in alone)
    assert batch.usage.completion_tokens == 36 and batch.usage.total_tokens == batch.usage.prompt_tokens + 36
    assert len(raw.headers["x-kvgate-worker"].split(",")) == 3  # each prompt routed on its own
    assert _requests_total(fleet) - before == 3  # counted as its prompts


def test_a_streamed_batch_carries_one_id_every_choice_and_the_summed_usage(client):
    collected = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = ["".join(c.text for chunk in chunks for c in chunk.choices if c.index == index) for index in range(3)]
    assert streamed == [c.text for c in collected.choices]
    assert len({chunk.id for chunk in chunks}) == 1
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == 15 and chunks[-1].usage.prompt_tokens == collected.usage.prompt_tokens


def test_a_streamed_batch_without_include_usage_ends_without_it(fleet):
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{fleet['gateway'].url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert not any('"usage":{' in line for line in lines)


def test_a_batch_of_token_id_prompts(client, direct):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, **GREEDY)
    alone = [direct.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY) for prompt in prompts]
    assert [c.text for c in batch.choices] == [answer.choices[0].text for answer in alone]
    assert batch.usage.prompt_tokens == 7


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_prompt_that_fails_fails_the_batch_naming_it_and_nothing_is_left_in_flight(client, fleet, stream):
    before = _requests_total(fleet)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[PROMPTS[0], "word " * 5000, PROMPTS[1]], max_tokens=4,
                                  stream=stream, **GREEDY)
    assert caught.value.body["message"].startswith("prompt 1: ")
    assert caught.value.body["param"] == "prompt"
    assert metric_value(fleet["gateway"].url, "kvgate_requests_in_flight") == 0
    assert _requests_total(fleet) - before == 3  # each prompt ended once: answered, refused or left (499)


def test_a_client_that_leaves_a_streamed_batch_ends_every_prompt(fleet):
    before = _requests_total(fleet)
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 480, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{fleet['gateway'].url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert next(response.iter_lines()).startswith("data: {")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric_value(fleet["gateway"].url, "kvgate_requests_in_flight") > 0:
        time.sleep(0.1)
    assert metric_value(fleet["gateway"].url, "kvgate_requests_in_flight") == 0
    assert _requests_total(fleet) - before == 3
    assert metric_value(fleet["gateway"].url, "kvgate_requests_total", status="499") >= 3


def test_a_client_that_leaves_a_collected_batch_ends_every_prompt_as_gone(fleet):
    before, errors_before = _requests_total(fleet), _server_errors(fleet)
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fleet['gateway'].url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _requests_total(fleet) - before < 3:
        time.sleep(0.1)
    assert _requests_total(fleet) - before == 3
    assert metric_value(fleet["gateway"].url, "kvgate_requests_in_flight") == 0
    assert _server_errors(fleet) == errors_before


def _server_errors(fleet) -> float:
    return metric_value(fleet["gateway"].url, "kvgate_requests_total", status="500")
