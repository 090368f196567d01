"""The request that continues an answer after a failover: from token ids, with the request's sampling options."""

from __future__ import annotations

from gateway.continuation import token_id_continuation


def _chat_request(**body):
    return {"model": "m", **body}


def test_a_chat_continues_from_its_token_ids_as_a_completions_prompt_with_its_sampling_options():
    request = _chat_request(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}],
                            temperature=0, stop=["\n\n"], max_completion_tokens=10, logprobs=True,
                            stream=True, continue_final_message=False)
    body = token_id_continuation(request, [1, 2, 3, 7, 8], delivered_tokens=2)
    assert body == {"model": "m", "temperature": 0, "stop": ["\n\n"], "stream": True, "max_tokens": 8,
                    "prompt": [1, 2, 3, 7, 8]}


def test_nothing_continues_an_answer_that_used_its_max_tokens():
    assert token_id_continuation(_chat_request(max_tokens=2), [1, 7, 8], delivered_tokens=2) is None
    assert token_id_continuation(_chat_request(), [1, 7], delivered_tokens=1)["prompt"] == [1, 7]  # no limit
