"""A worker that fails on purpose, for gateway fault tests.

usage: fake_worker.py PORT MODE
  (MODE: status503 | hang | hang_after_headers | hang_first | answer | slow | hold | trickle | stall_mid_stream)
answer streams a one-token completion at once; slow does the same after SLOW_FIRST_TOKEN_S; hold
answers its first token at once and finishes after HOLD_S (a request that takes a while to serve);
hang_first hangs after the headers on its first request and answers the others;
trickle streams a token every 0.1 s for a minute; stall_mid_stream sends two tokens, then nothing;
GET /calls counts requests ("generate") and streams (trickle, hang_after_headers, hang_first) cut off by the
client ("cancelled"); GET /requests lists every request's headers and JSON body, in order.
/health always answers 200 so the worker stays in rotation: only the breaker, the timeouts
and slow-worker ejection can take it out.
"""

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODE = sys.argv[2]
SLOW_FIRST_TOKEN_S = 1.0
HOLD_S = 1.0
calls = {"generate": 0, "cancelled": 0}
received: list[dict] = []


async def generate(request: Request) -> Response:
    calls["generate"] += 1
    received.append({"headers": dict(request.headers), "body": json.loads(await request.body() or b"null")})
    if MODE == "status503":
        return JSONResponse({"error": {"message": "overloaded", "type": "service_unavailable"}}, status_code=503)
    if MODE == "hang":
        await asyncio.sleep(3600)
    if MODE in ("answer", "slow", "hold") or (MODE == "hang_first" and calls["generate"] > 1):
        return StreamingResponse(one_token_answer(), media_type="text/event-stream")
    if MODE in ("trickle", "stall_mid_stream"):
        return StreamingResponse(tokens(), media_type="text/event-stream")

    async def nothing():
        try:
            await asyncio.sleep(3600)
        except BaseException:  # the gateway went away
            calls["cancelled"] += 1
            raise
        yield b""

    return StreamingResponse(nothing(), media_type="text/event-stream")


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
                                   **payload}).encode() + b"\n\n"


def token(text: str, finish_reason: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]})


async def one_token_answer():
    if MODE == "slow":
        await asyncio.sleep(SLOW_FIRST_TOKEN_S)
    if MODE == "hold":
        yield token("hi")
        await asyncio.sleep(HOLD_S)
        yield token("", "length")
    else:
        yield token("hi", "length")
    yield event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    yield b"data: [DONE]\n\n"


async def tokens():
    try:
        for i in range(2 if MODE == "stall_mid_stream" else 600):
            yield token(f" t{i}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(3600)
    except BaseException:  # the client went away: Starlette cancels the stream
        calls["cancelled"] += 1
        raise


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def stats(request: Request) -> Response:
    return JSONResponse(calls)


async def requests_received(request: Request) -> Response:
    return JSONResponse(received)


app = Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                        Route("/v1/completions", generate, methods=["POST"]),
                        Route("/health", health), Route("/calls", stats), Route("/requests", requests_received)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
