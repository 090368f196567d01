"""A streamed answer's chunks folded into a non-streaming answer: tool calls and logprobs."""

from __future__ import annotations

from gateway.chunks import ToolCalls, chat_logprobs, merge_logprobs


def test_tool_call_deltas_fold_into_whole_calls_by_index():
    calls = ToolCalls()
    assert not calls
    calls.add([{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}},
               {"index": 1, "id": "b", "function": {"name": "g"}}])
    calls.add([{"index": 0, "function": {"arguments": '"x": '}}, "junk"])
    assert calls
    assert calls.calls() == [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": '}},
                             {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}]
    calls.add([{"index": 0, "function": {"arguments": "1}"}}])  # more after a read: appended to what was read
    assert calls.calls()[0]["function"]["arguments"] == '{"x": 1}'


def test_logprobs_of_chunks_are_concatenated_field_by_field():
    first = {"tokens": ["a"], "token_logprobs": [-1.0], "text_offset": [0]}
    merged = merge_logprobs(None, first)
    merged = merge_logprobs(merged, {"tokens": ["b"], "token_logprobs": [-2.0], "text_offset": [1]})
    assert merged == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1]}
    assert first == {"tokens": ["a"], "token_logprobs": [-1.0], "text_offset": [0]}  # the chunk's own lists untouched


def test_a_list_field_that_starts_empty_or_null_is_extended_by_later_chunks():
    merged = merge_logprobs(None, {"content": None, "refusal": []})
    merged = merge_logprobs(merged, {"content": [{"token": "a"}], "refusal": None})
    merged = merge_logprobs(merged, {"content": [{"token": "b"}]})
    assert merged == {"content": [{"token": "a"}, {"token": "b"}], "refusal": []}


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

