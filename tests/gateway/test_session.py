"""The session's assembly of a streamed answer into a non-streaming one: tool calls and logprobs."""

from __future__ import annotations

from gateway.session import merge_logprobs, merge_tool_call_deltas


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


def _chat_request(**body):
    from gateway.session import ProxyRequest

    return ProxyRequest(kind="chat", path="/v1/chat/completions", body={"model": "m", **body}, model="m",
                        pool="default", tenant="t", request_id="r", headers={}, client_stream=True,
                        client_include_usage=False)


def test_a_chat_continues_from_its_token_ids_as_a_completions_prompt_with_its_sampling_options():
    from gateway.session import token_id_continuation

    request = _chat_request(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}],
                            temperature=0, stop=["\n\n"], max_completion_tokens=10, logprobs=True,
                            stream=True, continue_final_message=False)
    body = token_id_continuation(request, [1, 2, 3, 7, 8], delivered_tokens=2)
    assert body == {"model": "m", "temperature": 0, "stop": ["\n\n"], "stream": True, "max_tokens": 8,
                    "prompt": [1, 2, 3, 7, 8]}


def test_nothing_continues_an_answer_that_used_its_max_tokens():
    from gateway.session import token_id_continuation

    assert token_id_continuation(_chat_request(max_tokens=2), [1, 7, 8], delivered_tokens=2) is None
    assert token_id_continuation(_chat_request(), [1, 7], delivered_tokens=1)["prompt"] == [1, 7]  # no limit
