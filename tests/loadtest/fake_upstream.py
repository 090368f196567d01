"""A tiny OpenAI-compatible streaming upstream with known timings, served by uvicorn in a thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True, slots=True)
class Timing:
    """First content chunk after first_chunk_s, then one every interval_s; num_chunks chunks of one token."""

    first_chunk_s: float = 0.2
    interval_s: float = 0.05
    num_chunks: int = 8
    prompt_tokens: int = 100
    cached_tokens: int = 40
    worker: str = "w0"


def build_app(timing: Timing, sent: list[list[float]] | None = None) -> Starlette:
    """sent, when given, gets one entry per request: when it arrived and when each content chunk was
    handed to the server (time.monotonic()), the timings as they really were on a busy machine."""
    async def generate(request: Request):
        arrived = time.monotonic()
        body = await request.json()
        chat = "messages" in body
        times = [arrived]
        if sent is not None:
            sent.append(times)

        async def events():
            yield _event(_chunk(chat, ""))  # the role chunk: no content yet
            await asyncio.sleep(timing.first_chunk_s)
            for i in range(timing.num_chunks):
                if i:
                    await asyncio.sleep(timing.interval_s)
                times.append(time.monotonic())
                yield _event(_chunk(chat, f" tok{i}"))
            usage = {"prompt_tokens": timing.prompt_tokens, "completion_tokens": timing.num_chunks,
                     "prompt_tokens_details": {"cached_tokens": timing.cached_tokens}}
            yield _event({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"x-kvgate-worker": timing.worker})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/health", health)])


def _chunk(chat: bool, text: str) -> dict:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"choices": [choice]}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@contextmanager
def serve_in_thread(app, port: int, lifespan: str = "off") -> Iterator[str]:
    """Serve app on 127.0.0.1:port until the block ends; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake upstream did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
