"""A streamed answer's chunks folded into a non-streaming answer: tool calls and logprobs."""

from __future__ import annotations

from gateway.chunks import merge_logprobs, merge_tool_call_deltas


def test_tool_call_deltas_fold_into_whole_calls_by_index():
    calls: dict = {}
    merge_tool_call_deltas(calls, [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}},
                                   {"index": 1, "id": "b", "function": {"name": "g"}}])
    merge_tool_call_deltas(calls, [{"index": 0, "function": {"arguments": "}"}}, "junk"])
    assert calls == {0: {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                     1: {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}}


def test_logprobs_of_chunks_are_concatenated_field_by_field():
    merged = merge_logprobs(None, {"tokens": ["a"], "token_logprobs": [-1.0], "text_offset": [0]})
    merged = merge_logprobs(merged, {"tokens": ["b"], "token_logprobs": [-2.0], "text_offset": [1]})
    assert merged == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1]}
