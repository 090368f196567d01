"""A completion request's body: read, parsed as strict JSON, and checked as far as routing needs
(the worker validates sampling parameters itself; every problem is a 400 naming the field); and
its prompt's size estimated before tokenization, for admission."""

from __future__ import annotations

from typing import Any

from starlette.types import Receive

from kvgate.api_error import ApiError
from kvgate.json_body import parse_json_object


async def read_body(receive: Receive, limit: int | None = None) -> bytes:
    """The whole request body; ApiError 413 as soon as it grows past limit bytes (None: no limit),
    400 if the client leaves before it ends."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "client disconnected while sending the body")
        chunk = message.get("body", b"")
        if limit is not None:
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
        more = message.get("more_body", False)
        if not more and not chunks:
            return chunk  # the usual body: one message, no copy
        chunks.append(chunk)
        if not more:
            return b"".join(chunks)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")


def parse_body(raw: bytes, kind: str, *, yielding: bool = False,
               max_prompt_tokens: int | None = None) -> dict[str, Any]:
    """The JSON object of a chat (kind "chat") or completions request, checked as far as routing
    needs (yielding, max_prompt_tokens: see kvgate.json_body; for a parse off the event loop)."""
    body = parse_json_object(raw, yielding=yielding, max_prompt_tokens=max_prompt_tokens)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ApiError(400, "model is required and must be a string", param="model")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        if not body.get("stream"):
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    _refuse_unsupported(body)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects", param="messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise ApiError(400, "prompt must be a string or a non-empty list", param="prompt")
    return body


# Fields the gateway cannot carry through retries and failover (it continues one answer, rendered with
# the pool's own chat template, on any worker of the pool), and n out of bounds: refused with a 400 naming
# them, never passed on. n choices are served, but not continued after a failover (gateway/session.py).
MAX_CHOICES = 128  # OpenAI's bound on n

_UNSUPPORTED = {
    "n": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_CHOICES),
          f"n must be an integer in [1, {MAX_CHOICES}]"),
    "best_of": (lambda v: v is None or v == 1, "best_of must be 1"),
    "echo": (lambda v: v is None or v is False, "echo is not supported"),
    "chat_template": (lambda v: v is None, "a request's own chat_template is not supported: the pool's is used"),
    "kv_transfer_params": (lambda v: v is None, "kv_transfer_params is internal to disaggregated serving"),
}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, (accepted, message) in _UNSUPPORTED.items():
        if name in body and not accepted(body[name]):
            raise ApiError(400, message, param=name)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's tokens before it is tokenized (admission counts them against tokens_per_min; the
    router's exact count corrects it): token-id prompts count themselves, text ~4 bytes a token.
    Constant time for token ids (the router checks each id later, off the event loop when large)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    if isinstance(prompt, str):
        return len(prompt.encode()) // 4 + 1
    size = 0
    for message in body.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            size += sum(len(str(part.get("text", "")).encode()) for part in content if isinstance(part, dict))
    return size // 4 + 1
