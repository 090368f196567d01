"""A worker served in the test's own process that records what the gateway sends it."""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.conftest import MODEL


def recording_worker(seen: list[dict[str, str]], status: int = 200) -> Starlette:
    """An OpenAI-style worker answering every completion with one streamed token (or, with another
    status, an OpenAI-style error with it); seen gets each completion request's headers (lower-case names)."""

    async def complete(request: Request) -> Response:
        seen.append(dict(request.headers))
        await request.body()
        if status != 200:
            return JSONResponse({"error": {"message": "failing on purpose", "type": "server_error", "code": None}},
                                status_code=status)
        token = {"id": "cmpl-rec", "object": "text_completion", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}]}
        usage = {"id": "cmpl-rec", "object": "text_completion", "created": 0, "model": MODEL, "choices": [],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        events = [b"data: " + json.dumps(payload).encode() + b"\n\n" for payload in (token, usage)]
        return StreamingResponse(iter([*events, b"data: [DONE]\n\n"]), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"]), Route("/health", health)])
