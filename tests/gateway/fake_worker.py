"""A worker that fails on purpose, for gateway fault tests.

usage: fake_worker.py PORT MODE   (MODE: status503 | hang | hang_after_headers)
/health always answers 200 so the worker stays in rotation: only the breaker and the
timeouts can take it out.
"""

import asyncio
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODE = sys.argv[2]
calls = {"generate": 0}


async def generate(request: Request) -> Response:
    calls["generate"] += 1
    await request.body()
    if MODE == "status503":
        return JSONResponse({"error": {"message": "overloaded", "type": "service_unavailable"}}, status_code=503)
    if MODE == "hang":
        await asyncio.sleep(3600)

    async def nothing():
        await asyncio.sleep(3600)
        yield b""

    return StreamingResponse(nothing(), media_type="text/event-stream")


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def stats(request: Request) -> Response:
    return JSONResponse(calls)


app = Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                        Route("/v1/completions", generate, methods=["POST"]),
                        Route("/health", health), Route("/calls", stats)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
