"""The long-answers benchmark's pure parts: the answers its worker streams, the growth of a run's
figures, the verdict and the docs section (no processes)."""

from __future__ import annotations

import json

import pytest

from gateway.sse import SseParser
from loadtest.benchmarks.long_answers import (EVENT_SIZES, MODES, SIZES, TARGET_GROWTH, VARIANTS, answer_stream, cells,
                                              growth, markdown)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_answer_is_a_whole_stream_of_its_tokens_with_their_ids(variant):
    events = SseParser().feed(answer_stream(5, variant))
    assert events[-1].is_done
    usage = events[-2].payload["usage"]
    chunks = [e.payload["choices"][0] for e in events[:-2]]
    assert usage["completion_tokens"] == len(chunks) == 5
    assert [c["token_ids"] for c in chunks] == [[i] for i in range(5)]
    assert [c["finish_reason"] for c in chunks][-1] in ("length", "tool_calls")
    if variant == "tool call":
        arguments = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks)
        assert arguments == "abcd" * 5 and chunks[0]["delta"]["tool_calls"][0]["id"] == "call_0"
    else:
        assert "".join(c["delta"]["content"] for c in chunks) == "tok " * 5
    assert ("logprobs" in chunks[0]) == (variant == "logprobs")


def test_one_event_carries_its_whole_size_in_one_chunk():
    events = SseParser().feed(answer_stream(1, "tool call", event_bytes=1000))
    [chunk] = [e for e in events if e.payload and e.payload["choices"]]
    assert len(chunk.payload["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]) == 1000


def _run(per_unit):
    """A tree's cells with CPU a unit per_unit(mode, variant, size)."""
    out = []
    for mode, variant, size, event_bytes in cells():
        name = "one event" if event_bytes else variant
        out.append({"mode": mode, "variant": name, "size": event_bytes or size, "requests": 1, "cpu_s": 1.0,
                    "wall_s": 1.0, "cpu_us_per_unit": per_unit(mode, name, event_bytes or size)})
    return out


def test_growth_is_the_largest_sizes_cost_a_unit_over_the_smallest():
    flat = growth(_run(lambda mode, variant, size: 2.0))
    assert flat == {mode: {v: 1.0 for v in [*VARIANTS, "one event"]} for mode in MODES}
    square = growth(_run(lambda mode, variant, size: size / 1000))
    assert square["stream"]["logprobs"] == SIZES[-1] / SIZES[0]
    assert square["collect"]["one event"] == EVENT_SIZES[-1] / EVENT_SIZES[0]


def test_the_section_marks_each_growth_against_its_bound():
    trees = {"baseline (abc)": _run(lambda mode, variant, size: size / 1000), "this checkout": _run(
        lambda mode, variant, size: 2.0 if variant != "logprobs" else 2.0 * (1 + (size > 8000) * TARGET_GROWTH["tokens"]))}
    result = {"command": "c", "machine": "m", "date": "d", "rounds": 2, "baseline": "abc",
              "trees": {name: {"cells": tree, "growth": growth(tree)} for name, tree in trees.items()}}
    text = markdown(result)
    assert "| stream, text: CPU a unit, 32,000 / 1,000 tokens | 1.00x (baseline (abc): 32.00x) | <= 3x | pass |" in text
    assert "| stream, logprobs: CPU a unit, 32,000 / 1,000 tokens | 4.00x" in text and "| <= 3x | FAIL |" in text
    assert "| collect, one event: CPU a unit, 16 MiB / 1 MiB | 1.00x (baseline (abc): 16.00x) | <= 2x | pass |" in text
    assert "`abc`'s gateway" in text
    json.dumps(result)  # what the run writes
