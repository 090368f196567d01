"""The request that continues an answer after a failover: from token ids, with the request's sampling options."""

from __future__ import annotations

from gateway.continuation import text_continuation, token_id_continuation


def _chat_request(**body):
    return {"model": "m", **body}


def test_a_chat_continues_from_its_token_ids_as_a_completions_prompt_with_its_sampling_options():
    request = _chat_request(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}],
                            temperature=0, stop=["\n\n"], max_completion_tokens=10, logprobs=True,
                            stream=True, continue_final_message=False)
    body = token_id_continuation("chat", request, [1, 2, 3, 7, 8], delivered_tokens=2)
    assert body == {"model": "m", "temperature": 0, "stop": ["\n\n"], "stream": True, "max_tokens": 8,
                    "prompt": [1, 2, 3, 7, 8], "logprobs": 0}


def test_nothing_continues_an_answer_that_used_its_max_tokens():
    assert token_id_continuation("chat", _chat_request(max_tokens=2), [1, 7, 8], delivered_tokens=2) is None
    assert token_id_continuation("chat", _chat_request(), [1, 7], delivered_tokens=1)["prompt"] == [1, 7]  # no limit


def test_logprobs_are_asked_as_completions_ask_them():
    chat = token_id_continuation("chat", _chat_request(logprobs=True, top_logprobs=3), [1, 7], delivered_tokens=1)
    assert chat["logprobs"] == 3
    assert "logprobs" not in token_id_continuation("chat", _chat_request(logprobs=False), [1, 7], delivered_tokens=1)
    completion = token_id_continuation("completion", {"model": "m", "prompt": "a", "logprobs": 2}, [1, 7],
                                       delivered_tokens=1)
    assert completion["logprobs"] == 2


def test_min_tokens_go_on_less_the_tokens_delivered_and_the_token_constraints_as_they_were():
    request = _chat_request(min_tokens=5, logit_bias={"7": -100}, allowed_token_ids=[7, 8], max_tokens=20)
    body = token_id_continuation("chat", request, [1, 2, 3], delivered_tokens=2)
    assert (body["min_tokens"], body["logit_bias"], body["max_tokens"]) == (3, {"7": -100}, 18)
    assert body["allowed_token_ids"] == [7, 8]
    assert "min_tokens" not in token_id_continuation("chat", request, [1, 2, 3, 4, 5, 6], delivered_tokens=5)


def test_a_text_continuation_also_asks_only_for_the_min_tokens_left():
    request = {"model": "m", "prompt": "Once", "min_tokens": 4, "max_tokens": 9}
    body = text_continuation("completion", request, " upon", delivered_tokens=1, encode=None)
    assert (body["prompt"], body["min_tokens"], body["max_tokens"]) == ("Once upon", 3, 8)
    assert request["min_tokens"] == 4  # the client's request is left as it was
    done = text_continuation("completion", request, " upon a time", delivered_tokens=4, encode=None)
    assert "min_tokens" not in done
