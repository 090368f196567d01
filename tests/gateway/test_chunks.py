"""A streamed answer's chunks folded into a non-streaming answer: tool calls and logprobs."""

from __future__ import annotations

from gateway.chunks import chat_logprobs, merge_logprobs, merge_tool_call_deltas


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


def test_a_completions_chunks_logprobs_read_as_a_chats():
    completion = {"tokens": ["Hé", "!"], "token_logprobs": [-0.5, -0.25], "text_offset": [0, 2],
                  "top_logprobs": [{"Hé": -0.5, "Hi": -1.5, "Ho": -0.75}, {"!": -0.25, ".": -2.0}]}
    assert chat_logprobs(completion, num_top=2) == {"content": [
        {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169],
         "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
                          {"token": "Ho", "logprob": -0.75, "bytes": [72, 111]}]},
        {"token": "!", "logprob": -0.25, "bytes": [33],
         "top_logprobs": [{"token": "!", "logprob": -0.25, "bytes": [33]}, {"token": ".", "logprob": -2.0, "bytes": [46]}]},
    ]}
    assert chat_logprobs(completion, num_top=0)["content"][0]["top_logprobs"] == []
