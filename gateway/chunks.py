"""Pieces of a streamed answer's chunks: tool-call deltas and logprobs folded into the whole answer (for a
non-streaming client), the parts of an answer's further choices (OpenAI's n), a completions chunk's
logprobs shown as a chat's (a chat continued through completions after a failover), and whether a chunk
carries token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NOT_GIVEN: Any = object()  # a field the worker did not send (as opposed to one it sent as null)


class ToolCalls:
    """Streamed tool-call deltas folded into whole calls, by index (OpenAI's streaming format for
    tool_calls): id, type and name as they first come; the arguments' pieces are kept and joined when
    the calls are read (appending to one string each delta would cost the square of long arguments)."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}
        self._arguments: dict[int, list[str]] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, deltas: list[Any]) -> None:
        for delta in deltas:
            if not isinstance(delta, dict):
                continue
            index = int(delta.get("index") or 0)
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
                self._arguments[index] = []
            for key in ("id", "type"):
                if delta.get(key):
                    call[key] = delta[key]
            function = delta.get("function") or {}
            if function.get("name"):
                call["function"]["name"] = function["name"]
            if function.get("arguments"):
                self._arguments[index].append(function["arguments"])

    def calls(self) -> list[dict[str, Any]]:
        """The whole calls so far, in index order."""
        for index, pieces in self._arguments.items():
            if pieces:
                self._calls[index]["function"]["arguments"] += "".join(pieces)
                pieces.clear()
        return [self._calls[index] for index in sorted(self._calls)]


@dataclass(slots=True)
class ChoiceParts:
    """What a choice beyond an answer's first (n > 1) has streamed so far, kept for the whole answer
    (the first choice's parts are the session's own)."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tool_calls: ToolCalls = field(default_factory=ToolCalls)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = NOT_GIVEN

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def merge_logprobs(merged: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Concatenate a chunk's logprobs onto those before it: every list field is extended (chat's
    content and refusal; completions' tokens, token_logprobs, top_logprobs, text_offset). The first
    call builds merged, with lists of its own; later calls extend them in place (copying them each
    chunk would cost the square of a long answer's length)."""
    merged = {} if merged is None else merged
    for key, value in part.items():
        if isinstance(value, list):
            held = merged.get(key)
            if isinstance(held, list):
                held.extend(value)
            else:
                merged[key] = list(value)
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
    """Whether a chunk carries token ids where workers put them (the chunk's prompt_token_ids, a chat's
    first; each choice's token_ids and prompt_token_ids): asked for by the gateway, cut for a client
    that did not ask. Runs for every token."""
    if "prompt_token_ids" in payload:
        return True
    for choice in payload.get("choices") or ():
        if "token_ids" in choice or "prompt_token_ids" in choice:
            return True
    return False
