"""The request that continues an answer on another worker after a failover: from the token ids the
first worker gave (the prompt's and the generated ones, as a completions prompt: exact), or, from a
worker that gave none, from the text already delivered (exact only where it re-tokenizes to the same ids)."""

from __future__ import annotations

import copy
from typing import Any

# What a continuation through the completions endpoint keeps of the request: its sampling and
# output options (a chat's messages, tools and template options are in the prompt's ids already).
# min_tokens goes on less the tokens delivered, as max_tokens does. The presence and frequency
# penalties count only the continuation's own output: the answer's first part is its prompt now.
_CONTINUATION_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                        "allowed_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                        "include_stop_str_in_output", "stream", "stream_options", "user")


def token_id_continuation(kind: str, request_body: dict[str, Any], token_ids: list[int],
                          delivered_tokens: int) -> dict[str, Any] | None:
    """The completions request that continues an answer (of kind "chat" or "completion") from its
    token ids (the prompt's and those generated so far); None if its max_tokens are used up. A
    chat's logprobs (true, with top_logprobs) are asked as completions ask them (the number of top
    logprobs); the session shows them to the client as a chat's again (gateway/chunks.py)."""
    body = {key: request_body[key] for key in _CONTINUATION_FIELDS if key in request_body}
    if kind == "completion" and request_body.get("logprobs") is not None:
        body["logprobs"] = request_body["logprobs"]
    elif kind == "chat" and request_body.get("logprobs"):
        body["logprobs"] = request_body.get("top_logprobs") or 0
    limit = request_body.get("max_completion_tokens") or request_body.get("max_tokens")
    if limit is not None:
        if int(limit) - delivered_tokens < 1:
            return None
        body["max_tokens"] = int(limit) - delivered_tokens
    _min_tokens_left(body, request_body, delivered_tokens)
    body["prompt"] = token_ids
    return body


def _min_tokens_left(body: dict[str, Any], request_body: dict[str, Any], delivered_tokens: int) -> None:
    """min_tokens less the tokens already delivered (absent once they are reached)."""
    body.pop("min_tokens", None)
    wanted = request_body.get("min_tokens")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > delivered_tokens:
        body["min_tokens"] = wanted - delivered_tokens


def text_continuation(kind: str, request_body: dict[str, Any], delivered_text: str, delivered_tokens: int,
                      encode) -> dict[str, Any] | None:
    """The request (of the same kind, "chat" or "completion") that continues an answer after
    delivered_text, for a worker that gave no token ids; None if nothing is left to do."""
    body = copy.deepcopy(request_body)
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            remaining = int(body[key]) - delivered_tokens
            if remaining < 1:
                return None
            body[key] = remaining
    _min_tokens_left(body, request_body, delivered_tokens)
    if kind == "completion":
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            body["prompt"] = prompt + delivered_text
        elif encode is not None:
            body["prompt"] = list(prompt) + encode(delivered_text)
        else:
            return None
        return body
    messages = list(body["messages"])
    last = messages[-1] if messages else {}
    if body.get("continue_final_message") and last.get("role") == "assistant" and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": last["content"] + delivered_text}
    else:
        messages.append({"role": "assistant", "content": delivered_text})
    body["messages"] = messages
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    return body
