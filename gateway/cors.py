"""Requests from web pages on other origins (CORS), as plain ASGI middleware: a browser's preflight is
answered before auth (it carries no key), and an allowed origin's responses, errors included, are made
readable by its pages. Off unless `gateway.cors_allowed_origins` lists origins ("*": any); never with
credentials (the gateway's keys travel in headers, not cookies)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.api_error import ApiError

ALLOWED_METHODS = b"GET, POST, OPTIONS"
# what a page may read of an answer: the id to quote, when to retry, which worker and pool served it
EXPOSED_HEADERS = (b"x-request-id, retry-after, x-kvgate-worker, x-kvgate-pool, x-kvgate-route, x-kvgate-failovers, "
                   b"server-timing, traceparent, tracestate")
PREFLIGHT_MAX_AGE_S = 600


class CorsMiddleware:
    """Sits outside the request context and auth: a preflight (OPTIONS with Origin and
    Access-Control-Request-Method) is answered here, 204 for an allowed origin (any request header
    allowed: the requested ones are echoed), 403 for another; any other request goes on, and an allowed
    origin's response carries Access-Control-Allow-Origin. A request without Origin (every client but a
    browser) costs one pass over its headers."""

    def __init__(self, app: ASGIApp, allowed_origins: Iterable[str]) -> None:
        self.app = app
        origins = set(allowed_origins)
        self.any_origin = "*" in origins
        self.origins = frozenset(origin.lower().encode() for origin in origins - {"*"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = requested_method = requested_headers = None
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value
            elif name == b"access-control-request-method":
                requested_method = value
            elif name == b"access-control-request-headers":
                requested_headers = value
        if origin is None:
            await self.app(scope, receive, send)
            return
        allowed = self.any_origin or origin.lower() in self.origins
        if scope["method"] == "OPTIONS" and requested_method is not None:
            await self._preflight(origin, allowed, requested_headers, scope, receive, send)
            return
        if not allowed:  # served as ever; the browser keeps the answer from the page
            await self.app(scope, receive, send)
            return
        cors_headers = self._origin_headers(origin) + [(b"access-control-expose-headers", EXPOSED_HEADERS)]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *cors_headers]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _origin_headers(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        if self.any_origin:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]

    async def _preflight(self, origin: bytes, allowed: bool, requested_headers: bytes | None, scope: Scope,
                         receive: Receive, send: Send) -> None:
        if not allowed:
            await ApiError(403, f"origin {origin.decode('latin-1')[:200]} is not allowed to call this gateway "
                                "(gateway.cors_allowed_origins)", "permission_error",
                           code="origin_not_allowed").response()(scope, receive, send)
            return
        headers = [*self._origin_headers(origin), (b"access-control-allow-methods", ALLOWED_METHODS),
                   (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]
        if requested_headers:
            headers.append((b"access-control-allow-headers", requested_headers))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
