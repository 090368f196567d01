"""Request context (request id, W3C trace context) and size limits (headers, body), as plain ASGI middleware."""

from __future__ import annotations

import os
import re

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from kvgate.api_error import ApiError
from kvgate.config import LimitsConfig

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_POLICY_VIOLATION = 1008  # the WebSocket close code for a refused connection (RFC 6455 7.4.1)
_propagator = TraceContextTextMapPropagator()
tracer = trace.get_tracer("kvgate.gateway")


class RequestContextMiddleware:
    """Gives each request an id (X-Request-Id in, or a new one) and a server span continuing
    the caller's traceparent; both are echoed on the response (x-request-id, traceparent) and
    kept in scope['state'] for the proxy to pass upstream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # Looked up once (the middleware is built on the first request): a tracer provider is set
        # at process start (opentelemetry-instrument, OTEL_PYTHON_TRACER_PROVIDER), and while none
        # is, get_tracer_provider() searches the environment on every call.
        self.no_tracer = _no_tracer_installed()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming, has_parent = "", False
        for name, value in scope["headers"]:  # the last of repeated headers wins, as in a dict of them
            if name == b"x-request-id":
                incoming = value.decode("latin-1")
            elif name == b"traceparent":
                has_parent = True
        request_id = incoming if _REQUEST_ID.match(incoming) else os.urandom(16).hex()  # uuid4().hex's form, cheaper
        if not has_parent and self.no_tracer:
            # a no-op tracer without a parent makes an invalid span: nothing to record or echo
            await self._call(scope, receive, send, request_id, {}, None)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = _propagator.extract(headers)
        with tracer.start_as_current_span(f"{scope['method']} {scope['path']}", context=parent,
                                          kind=trace.SpanKind.SERVER) as span:
            carrier: dict[str, str] = {}
            _propagator.inject(carrier)
            await self._call(scope, receive, send, request_id, carrier, span)

    async def _call(self, scope: Scope, receive: Receive, send: Send, request_id: str, carrier: dict[str, str],
                    span: trace.Span | None) -> None:
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["trace_headers"] = carrier
        extra = [(b"x-request-id", request_id.encode())] + [(k.encode(), v.encode()) for k, v in carrier.items()]

        async def send_with_context(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + extra
                if span is not None:
                    span.set_attribute("http.status_code", message["status"])
            await send(message)

        await self.app(scope, receive, send_with_context)


def _no_tracer_installed() -> bool:
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


class HeaderLimitsMiddleware:
    """Header count and size limits (431), checked before anything else reads the headers (auth,
    trace context, request id): the outermost of the gateway's own middleware. A WebSocket over
    the limits is closed before it is accepted (the server answers 403)."""

    def __init__(self, app: ASGIApp, limits: LimitsConfig) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self._check(scope["headers"]) if scope["type"] in ("http", "websocket") else None
        if error is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await error.response()(scope, receive, send)
        else:
            await WebSocketClose(code=_POLICY_VIOLATION, reason=error.message[:100])(scope, receive, send)

    def _check(self, headers: list[tuple[bytes, bytes]]) -> ApiError | None:
        if len(headers) > self.limits.max_header_count:
            return ApiError(431, f"too many request headers (limit {self.limits.max_header_count})")
        if sum(len(k) + len(v) for k, v in headers) > self.limits.max_header_bytes:
            return ApiError(431, f"request headers too large (limit {self.limits.max_header_bytes} bytes)")
        return None


class BodyLimitsMiddleware:
    """Body size limit (413), checked before any parsing (after auth: only a known client's body is read).

    Bodies are read up to the limit and replayed to the app, so an oversized chunked body is
    refused as soon as it crosses the limit.
    """

    def __init__(self, app: ASGIApp, limits: LimitsConfig) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body, error = await self._read_body(scope, receive)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, ApiError | None]:
        limit = self.limits.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return b"", _too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", ApiError(400, "client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: disconnect notifications

    return replay
