"""The floor of a proxy on kvgate's HTTP stack, for proxy-peers: the least any Python gateway built
the way kvgate is does per request, so its CPU per request can be split into the stack's and its own.

A plain ASGI app on uvicorn (uvloop, httptools, as `kvgate gateway` runs) that passes each POST on
to one upstream through kvgate's own keep-alive client (gateway/upstream_http.py) and its answer back
as it comes, status, content type and length included: no auth, parsing, admission, routing,
metrics or failover. GET /health answers itself (for the benchmark's start-up check).

    PROXY_FLOOR_UPSTREAM=http://127.0.0.1:8080 python -m uvicorn --factory loadtest.peers.proxy_floor:create_app \\
        --loop uvloop --http httptools --no-access-log
"""

from __future__ import annotations

import os

from gateway.request_body import read_body
from gateway.upstream_http import UpstreamClient

UPSTREAM_ENV = "PROXY_FLOOR_UPSTREAM"
_PASSED_ON = (b"content-type", b"content-length")
_TIMEOUT_S = 30.0


class ProxyFloor:
    """The pass-through ASGI app (one upstream, one keep-alive client)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client = UpstreamClient()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.client)
            return
        if scope["method"] == "GET" and scope["path"] == "/health":
            await _answer(send, 200, b'{"status":"ok"}')
            return
        body = await read_body(receive)
        headers = {"x-request-id": "floor"}
        try:
            response = await self.client.post_stream(self.upstream + scope["path"], body, headers, _TIMEOUT_S, _TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any upstream failure is this proxy's 502
            await _answer(send, 502, f'{{"error":{{"message":"upstream failed: {type(exc).__name__}"}}}}'.encode())
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers if k in _PASSED_ON]})
            while (chunk := await response.next_chunk(_TIMEOUT_S)) is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive, send, client: UpstreamClient) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return


def create_app() -> ProxyFloor:
    upstream = os.environ.get(UPSTREAM_ENV)
    if not upstream:
        raise SystemExit(f"{UPSTREAM_ENV} must name the upstream's base URL (http://host:port)")
    return ProxyFloor(upstream)

