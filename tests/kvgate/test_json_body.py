"""Strict JSON request bodies (kvgate/json_body.py): what is refused with a 400, that the yielding
parse and encode give the same values and bytes, and that the yielding parse lets other threads
run while it works on a large body."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from kvgate.api_error import ApiError
from kvgate.json_body import MAX_OTHER_INTEGERS, dump_json, parse_json_object


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"temperature": 1e999}', "number out of range"),
    (b'{"prompt": "' + b"\\ud800" + b'"}', "unpaired UTF-16 surrogate"),
    (b'{"x": [{"' + b"\\uDC00" + b'": 1}]}', "unpaired UTF-16 surrogate"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
    (b'{"a": 1', "not valid JSON"),
    (b'{"a": "\xff"}', "not valid JSON"),
    (b'["a list"]', "must be a JSON object"),
], ids=["nan", "infinity", "float-overflow", "lone-surrogate", "lone-surrogate-key", "too-deep", "truncated",
        "bad-utf8", "not-an-object"])
@pytest.mark.parametrize("yielding", [False, True], ids=["inline", "yielding"])
def test_what_is_not_strict_json_is_a_400(raw, message, yielding):
    with pytest.raises(ApiError) as info:
        parse_json_object(raw, yielding=yielding)
    assert info.value.status == 400 and message in info.value.message


def test_paired_surrogate_escapes_are_text():
    assert parse_json_object(b'{"emoji": "\\ud83d\\ude00", "e": "\\u00e9"}') == {"emoji": "\U0001F600", "e": "é"}


def large_body(num_ids: int = 200_000) -> dict:
    rng = random.Random(7)
    return {"model": "m", "prompt": [rng.randrange(50_000) for _ in range(num_ids)], "temperature": 0.5,
            "stop": ["\n", "é中"], "logit_bias": {"11": -100}, "user": None, "stream": True,
            "messages": [{"role": "user", "content": "x" * 10_000}] * 5000}


def test_the_yielding_parse_and_encode_give_the_same_values_and_bytes():
    body = large_body()
    raw = json.dumps(body).encode()
    assert parse_json_object(raw, yielding=True) == parse_json_object(raw) == body
    encoded = dump_json(body, yielding=True)
    assert encoded == dump_json(body)
    assert json.loads(encoded) == body


def test_the_yielding_encode_of_what_orjson_declines_is_the_json_modules():
    """A key that is not a string (orjson declines it) inside a value with long lists: the yielding encode
    falls back piece by piece to the same bytes json's encoder writes for the whole."""
    body = {"logit_bias": {50256: -100}, "prompt": list(range(10_000)), "seed": 2 ** 70}
    assert dump_json(body, yielding=True) == dump_json(body)
    assert json.loads(dump_json(body, yielding=True)) == {**body, "logit_bias": {"50256": -100}}


def test_encoding_refuses_nan():
    with pytest.raises(ValueError):
        dump_json({"x": [float("nan")] * 10_000}, yielding=True)


@pytest.mark.parametrize("value", [{"temperature": float("nan")}, {"x": [1.0, float("-inf")], "user": None}],
                         ids=["nan", "infinity-beside-a-null"])
@pytest.mark.parametrize("yielding", [False, True], ids=["inline", "yielding"])
def test_encoding_refuses_nan_and_infinity_however_it_is_encoded(value, yielding):
    with pytest.raises(ValueError):
        dump_json(value, yielding=yielding)


@pytest.mark.parametrize("extra", [{}, {"user": None}, {"seed": 2 ** 70}], ids=["plain", "a-null", "a-big-integer"])
@pytest.mark.parametrize("yielding", [False, True], ids=["inline", "yielding"])
def test_a_body_encodes_to_the_bytes_the_json_module_gives(yielding, extra):
    """orjson, or the json module where orjson declines or writes a null: the same bytes either way."""
    body = {**{k: v for k, v in large_body(5_000).items() if v is not None}, "t": 0.25, "s": "n\u00e9 \u2028 \" \x00",
            **extra}
    assert dump_json(body, yielding=yielding) == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def longest_loop_stall_s(work) -> float:
    """The longest the event loop went without running while work ran in a thread."""
    async def measure() -> float:
        gaps: list[float] = []

        async def tick() -> None:
            while True:
                before = time.perf_counter()
                await asyncio.sleep(0)
                gaps.append(time.perf_counter() - before)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        await asyncio.to_thread(work)
        ticker.cancel()
        return max(gaps)

    return asyncio.run(measure())


def test_a_yielding_parse_in_a_thread_lets_the_event_loop_run():
    """The plain parse holds the interpreter lock for the whole body (the loop waits it out); the
    yielding one hands it over every switch interval. Compared in one run, not against a clock."""
    raw = json.dumps({"model": "m", "prompt": list(range(600_000))}).encode()
    held = longest_loop_stall_s(lambda: parse_json_object(raw))
    yielded = longest_loop_stall_s(lambda: parse_json_object(raw, yielding=True))
    assert yielded < held / 2, (yielded, held)


def test_a_body_with_more_integers_than_any_prompt_plus_the_rest_is_refused_while_parsing():
    limit = 1000 + MAX_OTHER_INTEGERS
    at_limit = json.dumps({"prompt": list(range(limit))}).encode()
    assert len(parse_json_object(at_limit, yielding=True, max_prompt_tokens=1000)["prompt"]) == limit
    with pytest.raises(ApiError) as info:
        parse_json_object(json.dumps({"prompt": list(range(limit + 1))}).encode(), yielding=True,
                          max_prompt_tokens=1000)
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", "prompt")
    assert "1,000 tokens" in info.value.message
