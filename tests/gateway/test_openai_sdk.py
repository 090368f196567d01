"""The `openai` SDK, unchanged but for base_url, through the gateway to real workers."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import API_KEY, MODEL, metric_value

pytestmark = pytest.mark.slow  # every test runs against the process fleet

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_pools_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404(client):
    found = client.models.retrieve(MODEL)
    assert (found.id, found.object, found.owned_by) == (MODEL, "model", "kvgate") and found.created > 0
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


def test_chat_non_streaming_content_equals_the_workers(client, direct):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    via_gateway = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    from_worker = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    assert via_gateway.choices[0].message.content == from_worker.choices[0].message.content
    assert via_gateway.usage.completion_tokens == 12
    assert via_gateway.usage.prompt_tokens == from_worker.usage.prompt_tokens


def test_chat_streaming_is_passed_through_chunk_by_chunk(client, direct):
    messages = [{"role": "user", "content": "Tell me about paged attention"}]
    args = dict(model=MODEL, messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True},
                **GREEDY)
    chunks = list(client.chat.completions.create(**args))
    direct_chunks = list(direct.chat.completions.create(**args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(c.choices[0].delta.content or "" for c in direct_chunks if c.choices)
    assert len(chunks) == len(direct_chunks)
    assert chunks[-1].usage.completion_tokens == 10


def test_completions_streaming_and_not_agree(client):
    args = dict(model=MODEL, prompt="The quick brown fox", max_tokens=8, **GREEDY)
    full = client.completions.create(**args)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    assert full.choices[0].finish_reason == "length"


def test_async_client_concurrent_requests(fleet):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{fleet['gateway'].url}/v1", api_key=API_KEY) as aclient:
            calls = [aclient.completions.create(model=MODEL, prompt=f"Hello world {i}", max_tokens=4, **GREEDY)
                     for i in range(6)]
            streamed = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, **GREEDY)
            chunks = [c async for c in streamed]
            return await asyncio.gather(*calls), chunks

    results, chunks = asyncio.run(main())
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_prefix_goes_to_the_worker_that_holds_it(client, fleet):
    system = "You are a careful assistant. " * 12
    workers, cached = set(), []
    for question in ["first question", "second question", "third question"]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2, **GREEDY)
        workers.add(raw.headers["x-kvgate-worker"])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(workers) == 1
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0


def test_unknown_model_is_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"


def test_worker_validation_errors_reach_the_client_unchanged(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert "max_tokens" in info.value.message


def test_health_ready_and_metrics(client, fleet):
    url = fleet["gateway"].url
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/ready").json() == {"status": "ready"}
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # a request of its own: the series exist
    text = httpx.get(f"{url}/metrics").text
    for name in ("kvgate_requests_total", "kvgate_time_to_first_token_seconds_bucket", "kvgate_upstream_attempts_total",
                 "kvgate_breaker_state", "kvgate_e2e_request_latency_seconds_bucket", "kvgate_prompt_tokens_total"):
        assert name in text, name
    assert API_KEY not in text


def test_index_size_is_exported_once_kv_events_arrive(client, fleet):
    """The KV index reports its size: blocks per worker (from the workers' events) and bytes."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="index me " * 20, max_tokens=1, **GREEDY)
    worker = raw.headers["x-kvgate-worker"]
    deadline = time.monotonic() + 10
    while metric_value(fleet["gateway"].url, "kvgate_kv_index_blocks", worker=worker) <= 0:
        assert time.monotonic() < deadline, "no kvgate_kv_index_blocks for the worker that served the request"
        time.sleep(0.2)
    assert metric_value(fleet["gateway"].url, "kvgate_kv_index_bytes") > 0


def test_prompts_sharing_a_context_are_counted_as_prefix_cache_hits(client, fleet):
    """The routing tokenizer tokenizes a prompt only from where it differs from one it saw: the hits show."""
    url = fleet["gateway"].url
    before = metric_value(url, "kvgate_tokenizer_prefix_cache_lookups_total", model=MODEL, result="hit")
    context = "Paged attention stores keys and values in fixed size blocks. " * 12
    for question in ("What is the capital of France?", "Hello world, this is a tiny tokenizer"):
        client.completions.create(model=MODEL, prompt=context + question, max_tokens=1, **GREEDY)
    assert metric_value(url, "kvgate_tokenizer_prefix_cache_lookups_total", model=MODEL, result="hit") == before + 1


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_return_token_ids_survive_the_assembled_answer(client, direct, kind):
    """vLLM's return_token_ids: the gateway assembles non-streaming answers from a stream, and
    the ids must come out where the worker's own non-streaming answer puts them."""
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    if kind == "chat":
        call = lambda c: c.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **args)  # noqa: E731
    else:
        call = lambda c: c.completions.create(prompt="The quick brown fox", **args)  # noqa: E731
    via_gateway, from_worker = call(client).model_dump(), call(direct).model_dump()
    holder = (lambda body: body) if kind == "chat" else (lambda body: body["choices"][0])
    assert holder(via_gateway)["prompt_token_ids"] == holder(from_worker)["prompt_token_ids"]
    assert via_gateway["choices"][0]["token_ids"] == from_worker["choices"][0]["token_ids"]
    assert len(via_gateway["choices"][0]["token_ids"]) == 6


def test_content_parts_and_the_developer_role_pass_through_routing(client, direct):
    """The router renders the conversation as the worker does (its block keys depend on it)."""
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    via_gateway = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    from_worker = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **GREEDY)
    assert via_gateway.choices[0].message.content == from_worker.choices[0].message.content
    assert via_gateway.usage.prompt_tokens == from_worker.usage.prompt_tokens


@pytest.mark.parametrize("asked", [False, True], ids=["not-asked", "asked"])
def test_token_ids_the_gateway_asks_workers_for_reach_only_clients_that_asked(fleet, asked):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five"}], "max_tokens": 8,
            "temperature": 0, "stream": True, **({"return_token_ids": True} if asked else {})}
    with httpx.stream("POST", f"{fleet['gateway'].url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    ids = [i for c in chunks for choice in c["choices"] for i in choice.get("token_ids", ())]
    assert bool(ids) == asked and any("prompt_token_ids" in c for c in chunks) == asked
    assert "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_logprobs_through_the_gateway_equal_the_workers(client, direct, kind, stream):
    if kind == "chat":
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about paged attention"}],
                    logprobs=True, top_logprobs=2, max_tokens=10, **GREEDY)
        create = lambda c: c.chat.completions.create(**args, stream=stream)  # noqa: E731
    else:
        args = dict(model=MODEL, prompt="Paged attention stores", logprobs=2, max_tokens=10, **GREEDY)
        create = lambda c: c.completions.create(**args, stream=stream)  # noqa: E731

    def logprobs(answer) -> list:
        choices = [c for chunk in (answer if stream else [answer]) for c in chunk.choices if c.logprobs]
        if kind == "chat":
            return [entry.model_dump() for c in choices for entry in c.logprobs.content]
        return [(token, logprob, top, offset) for c in choices for token, logprob, top, offset in
                zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.logprobs.text_offset)]

    via_gateway = logprobs(create(client))
    assert len(via_gateway) == 10 and via_gateway == logprobs(create(direct))


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_workers_stop_reason_reaches_the_client_collected_and_streamed(client, kind):
    if kind == "chat":
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about paged attention"}],
                    max_tokens=12, temperature=0)
        create, text_of = client.chat.completions.create, lambda choice: choice.message.content
    else:
        args = dict(model=MODEL, prompt="Paged attention stores", max_tokens=12, temperature=0)
        create, text_of = client.completions.create, lambda choice: choice.text
    words = text_of(create(**args).choices[0]).split()
    stop = words[2]
    assert stop not in " ".join(words[:2])  # it stops there, not before

    collected = create(**args, stop=[stop]).choices[0]
    streamed = [chunk.choices[0] for chunk in create(**args, stop=[stop], stream=True) if chunk.choices]

    assert (collected.finish_reason, collected.model_extra["stop_reason"]) == ("stop", stop)
    assert (streamed[-1].finish_reason, streamed[-1].model_extra["stop_reason"]) == ("stop", stop)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n_choices_through_the_gateway_are_the_workers_collected_and_streamed(client, direct, kind):
    if kind == "chat":
        args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about paged attention"}],
                    max_tokens=8, temperature=1.0, seed=3, n=3, logprobs=True, extra_body={"ignore_eos": True})
        create = lambda c, **more: c.chat.completions.create(**args, **more)  # noqa: E731
        text_of = lambda choice: choice.message.content  # noqa: E731
        piece_of = lambda choice: choice.delta.content or ""  # noqa: E731
    else:
        args = dict(model=MODEL, prompt="Paged attention stores", max_tokens=8, temperature=1.0, seed=3, n=3,
                    extra_body={"ignore_eos": True})
        create = lambda c, **more: c.completions.create(**args, **more)  # noqa: E731
        text_of = piece_of = lambda choice: choice.text  # noqa: E731

    from_worker = create(direct)
    collected = create(client)
    chunks = list(create(client, stream=True, stream_options={"include_usage": True}))

    expected = [text_of(choice) for choice in from_worker.choices]
    assert len(set(expected)) > 1  # seeded choices draw tokens of their own
    assert [text_of(choice) for choice in collected.choices] == expected
    assert [choice.index for choice in collected.choices] == [0, 1, 2]
    assert [choice.finish_reason for choice in collected.choices] == ["length"] * 3
    assert collected.usage.completion_tokens == from_worker.usage.completion_tokens == 24
    if kind == "chat":
        assert [[e.token for e in c.logprobs.content] for c in collected.choices] == \
            [[e.token for e in c.logprobs.content] for c in from_worker.choices]
    streamed = ["".join(piece_of(c) for chunk in chunks for c in chunk.choices if c.index == index)
                for index in range(3)]
    assert streamed == expected and chunks[-1].usage.completion_tokens == 24
