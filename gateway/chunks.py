"""Pieces of a streamed answer's chunks: tool-call deltas and logprobs folded into the whole answer (for a
non-streaming client), a completions chunk's logprobs shown as a chat's (a chat continued through
completions after a failover), and whether a chunk carries token ids."""

from __future__ import annotations

from typing import Any


def merge_tool_call_deltas(calls: dict[int, dict[str, Any]], deltas: list[Any]) -> None:
    """Fold streamed tool-call deltas into whole calls, by index: id, type and name as they first come,
    the arguments concatenated (OpenAI's streaming format for tool_calls)."""
    for delta in deltas:
        if not isinstance(delta, dict):
            continue
        call = calls.setdefault(int(delta.get("index") or 0), {"id": None, "type": "function",
                                                                "function": {"name": None, "arguments": ""}})
        for key in ("id", "type"):
            if delta.get(key):
                call[key] = delta[key]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] = function["name"]
        call["function"]["arguments"] += function.get("arguments") or ""


def merge_logprobs(merged: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Concatenate a chunk's logprobs onto those before it: every list field is extended (chat's
    content and refusal; completions' tokens, token_logprobs, top_logprobs, text_offset)."""
    merged = dict(merged or {})
    for key, value in part.items():
        if isinstance(value, list):
            merged[key] = list(merged.get(key) or []) + value
        elif key not in merged:
            merged[key] = value
    return merged


def chat_logprobs(completion: dict[str, Any], num_top: int) -> dict[str, Any]:
    """A completions chunk's logprobs (tokens, token_logprobs, top_logprobs: token -> logprob) as a
    chat chunk's (content: token, logprob, bytes, and the num_top likeliest as top_logprobs)."""
    tops = completion.get("top_logprobs") or []
    content = []
    for i, (token, logprob) in enumerate(zip(completion.get("tokens") or [], completion.get("token_logprobs") or [])):
        top = sorted((tops[i] or {}).items(), key=lambda item: -item[1])[:num_top] if i < len(tops) else []
        content.append({"token": token, "logprob": logprob, "bytes": _utf8(token),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in top]})
    return {"content": content}


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", "replace"))


def carries_token_ids(payload: dict[str, Any]) -> bool:
    return "prompt_token_ids" in payload or any(
        "token_ids" in choice or "prompt_token_ids" in choice for choice in payload.get("choices") or ())
