"""Request context (request id, W3C trace context, the request's log record) and size limits
(headers, body), as plain ASGI middleware."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from gateway.request_body import body_too_large, read_body
from gateway.telemetry import PROBE_PATHS, Telemetry
from kvgate.api_error import ApiError
from kvgate.config import LimitsConfig
from kvgate.request_log import request_id as new_or_incoming_id
from kvgate.tracing import caller_context, trace_context_headers, trace_id_of

_POLICY_VIOLATION = 1008  # the WebSocket close code for a refused connection (RFC 6455 7.4.1)
_propagator = TraceContextTextMapPropagator()
_NOT_LOGGED: dict = {}  # never filled: the layers inside add to state["log"], absent while not logged


class RequestContextMiddleware:
    """Gives each request an id (X-Request-Id in, or a new one), its trace context and its log record.

    With tracing on, a SERVER span continues the caller's traceparent; its context is echoed on the
    response and kept in scope['state']['trace_headers'] (the proxy sends each upstream attempt its
    own child context). With tracing off, a caller's traceparent and tracestate are echoed and passed
    on as they came. scope['state']['log'] is the request's log record: the layers inside add to it
    (tenant, pool, worker, tokens, timings...), and this middleware writes it as one line when the
    response has ended (telemetry.request_log). Probes and /metrics get neither span nor line.
    """

    def __init__(self, app: ASGIApp, telemetry: Telemetry | None = None) -> None:
        self.app = app
        self.telemetry = telemetry or Telemetry()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming, traceparent, tracestate = "", None, None
        for name, value in scope["headers"]:  # the last of repeated headers wins, as in a dict of them
            if name == b"x-request-id":
                incoming = value.decode("latin-1")
            elif name == b"traceparent":
                traceparent = value.decode("latin-1")
            elif name == b"tracestate":
                tracestate = value.decode("latin-1")
        request_id = new_or_incoming_id(incoming)
        tracer = self.telemetry.tracer
        if tracer is None or scope["path"] in PROBE_PATHS:  # probes and scrapes: no spans either
            await self._call(scope, receive, send, request_id, trace_context_headers(traceparent, tracestate), None,
                             traceparent)
            return
        with tracer.start_as_current_span(f"{scope['method']} {scope['path']}",
                                          context=caller_context(traceparent, tracestate),
                                          kind=trace.SpanKind.SERVER,
                                          attributes={"http.request.method": scope["method"],
                                                      "url.path": scope["path"],
                                                      "kvgate.request_id": request_id}) as span:
            carrier: dict[str, str] = {}
            _propagator.inject(carrier)
            await self._call(scope, receive, send, request_id, carrier, span, traceparent)

    async def _call(self, scope: Scope, receive: Receive, send: Send, request_id: str, carrier: dict[str, str],
                    span: trace.Span | None, traceparent: str | None) -> None:
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["trace_headers"] = carrier
        state["span"] = span
        extra = [(b"x-request-id", request_id.encode())] + [(k.encode(), v.encode()) for k, v in carrier.items()]
        request_log = self.telemetry.request_log
        logged = request_log.enabled and scope["path"] not in PROBE_PATHS
        record: dict = {} if logged else _NOT_LOGGED
        if logged:
            state["log"] = record
        status = None
        started = time.perf_counter()

        async def send_with_context(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = list(message.get("headers", [])) + extra
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(trace.StatusCode.ERROR)
            await send(message)

        try:
            await self.app(scope, receive, send_with_context)
        except Exception:
            if status is None:
                status = 500  # Starlette's outermost middleware answers it
            raise
        finally:
            if logged:
                request_log.write({"request_id": request_id, "trace_id": trace_id_of(span, traceparent),
                                   "method": scope["method"], "path": scope["path"],
                                   "status": status if status is not None else 499, **record,
                                   "duration_s": round(time.perf_counter() - started, 6)})


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
    """Body size limit (413), checked before any parsing (after auth: only a known client's body is read);
    a compressed body (Content-Encoding other than identity) is refused (415), not misread as bad JSON.

    A POST, PUT or PATCH body is read here, up to the limit (an oversized chunked body is refused
    as soon as it crosses it), and handed on in scope['state']['body']: the app inside reads it
    from there, and its receive() answers only what follows the body (http.disconnect).
    """

    def __init__(self, app: ASGIApp, limits: LimitsConfig) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        try:
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > limit:
                    raise body_too_large(limit)
                if name == b"content-encoding" and value.strip().lower() != b"identity":
                    raise ApiError(415, f"request bodies with Content-Encoding {value.decode('latin-1')[:50]!r} "
                                        "are not supported: send the body uncompressed",
                                   code="unsupported_content_encoding")
            body = await read_body(receive, limit)
        except ApiError as error:
            await error.response()(scope, receive, send)
            return
        scope.setdefault("state", {})["body"] = body
        await self.app(scope, receive, send)
