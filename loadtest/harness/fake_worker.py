"""A fake OpenAI-compatible worker for gateway benchmarks: raw ASGI on uvicorn, answering at once (or a
chunk every `chunk_delay_ms`) with as many tokens as the request asks, so what is measured is the
gateway, not an engine. Run as `python -m loadtest.harness.fake_worker PORT`."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from loadtest.harness.gateway import MODEL


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(kind: str, finish: str | None) -> bytes:
    if kind == "chat":
        choice = {"index": 0, "delta": {"content": "tok "}, "logprobs": None, "finish_reason": finish}
        return _sse({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                     "choices": [choice]})
    choice = {"index": 0, "text": "tok ", "logprobs": None, "finish_reason": finish}
    return _sse({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL, "choices": [choice]})

_CHUNKS = {kind: (_chunk(kind, None), _chunk(kind, "length")) for kind in ("chat", "completion")}

_HEADERS_SSE = [(b"content-type", b"text/event-stream")]

_HEADERS_JSON = [(b"content-type", b"application/json")]


def _usage(num_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": 50, "completion_tokens": num_tokens, "total_tokens": 50 + num_tokens,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def fake_worker_request(scope, receive, send) -> dict[str, Any] | None:
    """A fake worker's request: a POST's JSON body; None for a GET, answered here (/health: ok, any other
    path: empty), and for any scope but HTTP."""
    if scope["type"] != "http":
        return None
    if scope["method"] == "GET":
        body = b'{"status":"ok"}' if scope["path"] == "/health" else b""
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS_JSON})
        await send({"type": "http.response.body", "body": body})
        return None
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    return json.loads(raw)


async def fake_worker(scope, receive, send) -> None:
    """OpenAI-compatible enough: /health, /metrics, streamed or plain completions with usage.

    The answer has `max_tokens` chunks (default 1), `bench_chunk_delay_ms` apart (default 0).
    """
    request = await fake_worker_request(scope, receive, send)
    if request is None:
        return
    kind = "chat" if scope["path"].endswith("/chat/completions") else "completion"
    num_tokens = int(request.get("max_tokens") or 1)
    if request.get("stream"):
        await _stream_answer(send, kind, num_tokens, request)
    else:
        await _plain_answer(send, kind, num_tokens)


async def _stream_answer(send, kind: str, num_tokens: int, request: dict[str, Any]) -> None:
    delay_s = float(request.get("bench_chunk_delay_ms") or 0) / 1000
    middle, last = _CHUNKS[kind]
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS_SSE})
    for i in range(num_tokens):
        if delay_s:
            await asyncio.sleep(delay_s)
        await send({"type": "http.response.body", "body": last if i == num_tokens - 1 else middle,
                    "more_body": True})
    if (request.get("stream_options") or {}).get("include_usage"):
        envelope = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL}
        await send({"type": "http.response.body", "body": _sse({**envelope, "choices": [], "usage": _usage(num_tokens)}),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _plain_answer(send, kind: str, num_tokens: int) -> None:
    text = "tok " * num_tokens
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "length"}
              if kind == "chat" else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
    body = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": [choice], "usage": _usage(num_tokens)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS_JSON})
    await send({"type": "http.response.body", "body": body})


def run_fake_worker(port: int) -> None:
    import uvicorn

    # keep-alive as long as the gateway's, so an idle pooled connection is never closed under the bench
    uvicorn.run(fake_worker, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools",
                backlog=4096, timeout_keep_alive=75)


if __name__ == "__main__":
    run_fake_worker(int(sys.argv[1]))
