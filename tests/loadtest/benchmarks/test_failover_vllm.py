"""The vLLM failover scenario's pure parts: reading chunks, comparing answers, the gateway's failover
counter, the verdicts, who is blamed for a difference, and the docs section (no vLLM needed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import httpx
import pytest

from loadtest.benchmarks.failover_vllm import (Answer, MAX_TOKENS, blame, compare, counter_delta, cut_tokens, diagnose,
                                               failovers_by_mode, first_difference, judge, markdown, metric_total,
                                               summarise, survivor_counts)

METRICS = """# HELP kvgate_failovers_total Streams continued on another worker mid-answer
# TYPE kvgate_failovers_total counter
kvgate_failovers_total{mode="token_ids",pool="default"} 2.0
kvgate_failovers_total{mode="text",pool="default"} 1.0
kvgate_failovers_total{mode="token_ids",pool="other"} 7.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""
SURVIVOR_BEFORE = """vllm:prompt_tokens_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
vllm:generation_tokens_total{engine="0",model_name="m"} 5.0
"""
SURVIVOR_AFTER = """vllm:prompt_tokens_total{engine="0",model_name="m"} 117.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1105.0
"""


def _answer(ids: list[int], text: str | None = None, completion_tokens: int | None = None) -> Answer:
    return Answer(worker="w0", text="".join(f"t{i} " for i in ids) if text is None else text, token_ids=ids,
                  prompt_token_ids=[1, 2, 3], usage={"completion_tokens": completion_tokens or len(ids)},
                  finish_reason="length", done=True)


def _kind_result(reference: Answer, failover: Answer, failovers: dict[str, int] | None = None) -> dict[str, Any]:
    return {"killed": "w0", "continued_on": "w1", "kill_at_chunks": 100, "kill_at_tokens": 100, "cut_tokens": 104,
            "survivor": {"prompt_tokens": 111, "cached_tokens": 96, "generated_tokens": 1096},
            "failovers": failovers or {"token_ids": 1, "text": 0}, "comparison": compare(reference, failover),
            "diagnosis": None, "reference": asdict(reference), "failover": asdict(failover)}


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([1, 2, 3], [1, 2], 2),
    ([], [], None),
    ("abc", "abd", 2),
], ids=["equal", "differs", "shorter", "empty", "text"])
def test_first_difference_is_the_first_unequal_index_or_none(a, b, expected):
    assert first_difference(a, b) == expected


def test_a_chat_stream_gives_its_prompt_ids_on_the_first_chunk_and_counts_token_chunks():
    answer = Answer()
    assert not answer.feed({"prompt_token_ids": [5, 6], "choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert answer.feed({"choices": [{"delta": {"content": "Hi"}, "token_ids": [7]}]})
    assert answer.feed({"choices": [{"delta": {"content": ""}, "token_ids": [8], "finish_reason": "length"}]})
    assert (answer.prompt_token_ids, answer.token_ids, answer.num_chunks, answer.finish_reason) == (
        [5, 6], [7, 8], 2, "length")


def test_a_completions_stream_gives_its_prompt_ids_in_the_choice():
    answer = Answer()
    answer.feed({"choices": [{"text": " a", "token_ids": [9], "prompt_token_ids": [1, 2]}]})
    answer.feed({"choices": [{"text": " b", "token_ids": [10], "prompt_token_ids": None}]})
    assert (answer.prompt_token_ids, answer.token_ids) == ([1, 2], [9, 10])


def test_failovers_are_read_for_one_pool_by_mode_and_differenced():
    before = failovers_by_mode(METRICS)
    assert before == {"token_ids": 2.0, "text": 1.0}
    assert counter_delta(before, {"token_ids": 3.0, "text": 1.0}) == {"text": 0, "token_ids": 1}
    assert counter_delta({}, {}) == {"text": 0, "token_ids": 0}
    assert metric_total(METRICS, "vllm:prompt_tokens_total") == 1234.0


def test_the_cut_is_what_the_survivor_was_given_beyond_the_prompt():
    counts = survivor_counts(SURVIVOR_BEFORE, SURVIVOR_AFTER)
    assert counts == {"prompt_tokens": 107, "cached_tokens": 96, "generated_tokens": 1100}
    assert cut_tokens(counts, [1, 2, 3, 4, 5, 6, 7]) == 100
    assert cut_tokens(counts, None) is None


def _vllm(answer_ids: list[int], seen: list[dict[str, Any]]) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "", "token_ids": answer_ids}]})

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_diagnosis_sends_the_exact_continuation_and_blames_vllm_when_it_repeats_the_difference():
    reference = _answer(list(range(MAX_TOKENS)))
    failover = _answer(list(range(700)) + [0] * (MAX_TOKENS - 700))
    seen: list[dict[str, Any]] = []
    with _vllm(failover.token_ids[100:], seen) as client:
        found = diagnose(client, "http://w1", reference, failover, 100, 700)
    assert seen[0]["prompt"] == [1, 2, 3] + list(range(100)) and seen[0]["max_tokens"] == MAX_TOKENS - 100
    assert seen[0]["temperature"] == 0 and seen[0]["ignore_eos"] is True
    assert (found["blame"], found["direct_first_diff"], found["direct_matches_failover"]) == (
        "vllm_numerics", 700, True)


def test_diagnosis_blames_the_gateway_when_vllm_alone_continues_exactly():
    reference = _answer(list(range(MAX_TOKENS)))
    failover = _answer(list(range(700)) + [0] * (MAX_TOKENS - 700))
    with _vllm(reference.token_ids[100:], []) as client:
        found = diagnose(client, "http://w1", reference, failover, 100, 700)
    assert (found["blame"], found["direct_first_diff"], found["direct_matches_failover"]) == ("gateway", None, False)


def test_an_identical_answer_after_one_token_id_failover_passes():
    ids = list(range(MAX_TOKENS))
    result = _kind_result(_answer(ids), _answer(list(ids)))
    assert all(judge(result).values())
    assert result["comparison"]["matched_tokens"] == MAX_TOKENS


@pytest.mark.parametrize(("failover", "failovers", "failing"), [
    (_answer(list(range(500)) + [0] * (MAX_TOKENS - 500)), None, {"same_token_ids", "same_text"}),
    (_answer(list(range(MAX_TOKENS)), text="other"), None, {"same_text"}),
    (_answer(list(range(MAX_TOKENS)), completion_tokens=MAX_TOKENS - 3), None, {"same_usage"}),
    (_answer(list(range(MAX_TOKENS))), {"token_ids": 0, "text": 1}, {"token_ids_mode"}),
], ids=["tokens-differ", "text-differs", "usage-differs", "text-mode"])
def test_each_way_an_answer_can_fall_short_fails_its_own_check(failover, failovers, failing):
    verdicts = judge(_kind_result(_answer(list(range(MAX_TOKENS))), failover, failovers))
    assert {name for name, ok in verdicts.items() if not ok} == failing


def test_a_stream_that_ended_with_an_error_is_not_one_complete_stream():
    ids = list(range(MAX_TOKENS))
    failover = _answer(ids)
    failover.error = "stream_error"
    assert not judge(_kind_result(_answer(ids), failover))["one_complete_stream"]


@pytest.mark.parametrize(("args", "expected"), [
    ((None, 104, None, False), "none"),
    ((50, 104, None, False), "first_worker"),
    ((700, 104, 700, True), "vllm_numerics"),
    ((700, 104, None, False), "gateway"),
    ((700, 104, 700, False), "gateway"),
], ids=["identical", "before-cut", "vllm-does-the-same", "vllm-continues-exactly", "vllm-differs-otherwise"])
def test_a_difference_is_blamed_on_vllm_only_when_vllm_alone_repeats_it(args, expected):
    assert blame(*args) == expected


def test_the_section_shows_each_kind_its_figures_and_verdict():
    ids = list(range(MAX_TOKENS))
    kinds = {"completion": _kind_result(_answer(ids), _answer(list(ids))),
             "chat": _kind_result(_answer(ids), _answer(ids[:600] + [0] * 600))}
    kinds["chat"]["diagnosis"] = {"blame": "vllm_numerics", "cut": 104, "direct_first_diff": 600,
                                  "direct_matches_failover": True}
    figures = summarise(kinds)
    assert figures["pass"] == {"completion": True, "chat": False} and not figures["all_pass"]
    for kind in kinds.values():
        kind["reference"]["wall_s"], kind["failover"]["wall_s"] = 80.0, 95.0
    text = markdown({"kinds": kinds, "figures": figures, "command": ".venv/bin/python -m loadtest.benchmarks.failover_vllm",
                     "machine": "test cpu", "date": "2030-01-01", "vllm_version": "0.32.0",
                     "settings": {"model": "m", "policy": "kv_aware", "max_tokens": MAX_TOKENS,
                                  "kill_after_chunks": 100}})
    assert ("| completion | w0 after 100 chunks (100 tokens) | w1 at token 104 (111 prompt tokens, 96 of them cached; "
            "1096 generated) | 1200 / 1200 | 1200 | - | - |") in text
    assert "| 1 / 0 | 80 / 95 s | pass |" in text
    assert "| chat |" in text and "| 600 | 600 |" in text and "FAIL" in text
    assert "chat: blamed on vllm_numerics" in text and "differs from the reference at token 600" in text
