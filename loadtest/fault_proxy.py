"""A fault-injecting reverse proxy in front of one worker: added delay, or 503 for a fraction of requests.

Run as `python -m loadtest.fault_proxy --upstream URL --port P`; the fault is switched on and off
over HTTP with `POST /_fault {"delay_ms": 500, "error_fraction": 0.5}` (zeros = healthy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer", "upgrade"}


class FaultState:
    """The fault now in force: delay before forwarding and the fraction of requests answered 503."""

    def __init__(self, seed: int = 0) -> None:
        self.delay_ms = 0.0
        self.error_fraction = 0.0
        self.rng = random.Random(seed)

    def set(self, delay_ms: float, error_fraction: float) -> None:
        if delay_ms < 0 or not 0 <= error_fraction <= 1:
            raise ValueError("delay_ms must be >= 0 and error_fraction in [0, 1]")
        self.delay_ms, self.error_fraction = delay_ms, error_fraction


def build_app(upstream: str, state: FaultState | None = None,
              transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The proxy app; `transport` replaces the network to the worker (tests pass an httpx.MockTransport)."""
    state = state or FaultState()
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0, connect=5.0), transport=transport)

    async def control(request: Request) -> Response:
        body = await request.json()
        try:
            state.set(float(body.get("delay_ms", 0)), float(body.get("error_fraction", 0)))
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"delay_ms": state.delay_ms, "error_fraction": state.error_fraction})

    async def forward(request: Request) -> Response:
        if state.delay_ms:
            await asyncio.sleep(state.delay_ms / 1000)
        if state.error_fraction and state.rng.random() < state.error_fraction:
            return JSONResponse({"error": {"message": "injected fault", "type": "service_unavailable", "code": 503}},
                                status_code=503)
        return await pass_on(client, request, request.url.path, await request.body())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await client.aclose()

    return Starlette(routes=[Route("/_fault", control, methods=["POST"]),
                             Route("/{path:path}", forward, methods=["GET", "POST"])], lifespan=lifespan)


async def pass_on(client: httpx.AsyncClient, request: Request, url: str, body: bytes) -> Response:
    """Send request (its body already read) on to url and stream the answer back; 502 when the
    upstream cannot be reached. Hop-by-hop headers stay on their own hop."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    upstream_req = client.build_request(request.method, url, params=request.url.query, headers=headers, content=body)
    try:
        resp = await client.send(upstream_req, stream=True)
    except httpx.HTTPError as exc:
        return JSONResponse({"error": {"message": f"upstream: {type(exc).__name__}", "code": 502}}, status_code=502)
    out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
    return StreamingResponse(relay(resp), status_code=resp.status_code, headers=out_headers)


async def relay(resp: httpx.Response):
    """A worker's streamed answer, passed on chunk by chunk as it comes (for the proxies' StreamingResponse)."""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        await resp.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fault_proxy", description=__doc__)
    parser.add_argument("--upstream", required=True, help="worker base URL, e.g. http://127.0.0.1:8101")
    parser.add_argument("--port", required=True, type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.upstream, FaultState(args.seed)), host="127.0.0.1", port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
