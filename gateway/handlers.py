"""HTTP handlers: the OpenAI endpoints (validate, route, proxy) and /v1/models, /health, /ready, /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, Awaitable, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.core import GatewayCore
from gateway.errors import GatewayError, UpstreamError
from gateway.session import ProxyRequest, Session
from gateway.sse import compact_json
from router.router import NoRouteError
from router.types import RouteRequest

log = logging.getLogger("kvgate.gateway")
T = TypeVar("T")

FORWARDED_HEADERS = ("traceparent", "tracestate", "x-priority", "x-request-deadline-ms", "x-session-id",
                     "x-workflow-id", "x-workflow-step", "x-workflow-steps")


def _core(request: Request) -> GatewayCore:
    return request.app.state.core


class ProxyEndpoint:
    """POST /v1/chat/completions and /v1/completions: validate, route, proxy.

    A plain ASGI app (Starlette routes to it without building Request and Response objects): this
    is the one path every completion takes, so it does no more per request than it must.
    """

    def __init__(self, kind: str, path: str) -> None:
        self.kind, self.path = kind, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        core: GatewayCore = scope["app"].state.core
        tenant = scope.get("state", {}).get("tenant", "anonymous")
        model_label = "unknown"
        try:
            body = _parse_body(await _read_body(receive), self.kind)
            model = body["model"]
            model_label = model if model in core.models else "unknown"
            started = await _unless_disconnected(receive, _start(core, scope, self.kind, self.path, body, tenant))
        except GatewayError as error:
            core.metrics.child(core.metrics.requests, tenant, model_label, str(error.status)).inc()
            await error.response()(scope, receive, send)
            return
        except UpstreamError as error:  # the worker refused the request itself (4xx): pass its answer on
            core.metrics.child(core.metrics.requests, tenant, model_label, str(error.status)).inc()
            await Response(error.body, status_code=error.status or 502, media_type="application/json")(
                scope, receive, send)
            return
        except Exception:  # a bug: the client still gets an OpenAI-style 500 (with its request id) and it is counted
            log.exception("request %s failed", scope.get("state", {}).get("request_id", ""))
            core.metrics.child(core.metrics.requests, tenant, model_label, "500").inc()
            await GatewayError(500, "internal error in the gateway", "server_error").response()(scope, receive, send)
            return
        if started is None:  # the client went away before the first token: the attempt was cancelled
            core.metrics.child(core.metrics.requests, tenant, model_label, "499").inc()
            await _client_gone(send)
            return
        session, held, decision = started
        headers = [(b"x-kvgate-worker", session.tried[-1].encode())]
        if core.config.routing.debug_header:
            headers.append((b"x-kvgate-route", decision.explain()[:2000].encode("latin-1", "replace")))
        if session.req.client_stream:
            response = StreamingResponse(_observed(core, session, session.stream(held), tenant),
                                         media_type="text/event-stream", headers={"cache-control": "no-cache"})
            response.raw_headers += headers
            await response(scope, receive, send)
            return
        result = await _unless_disconnected(receive, session.collect(held))
        _finish(core, session, tenant)
        if result is None:
            await _client_gone(send)
            return
        content = compact_json(result)
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                    (b"x-kvgate-failovers", str(session.failovers).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})


async def _client_gone(send: Send) -> None:
    """Close the exchange of a client that disconnected (499, nginx's "client closed request")."""
    await send({"type": "http.response.start", "status": 499, "headers": []})
    await send({"type": "http.response.body", "body": b""})


chat_completions = ProxyEndpoint("chat", "/v1/chat/completions")
completions = ProxyEndpoint("completion", "/v1/completions")


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(400, "client disconnected while sending the body")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _start(core: GatewayCore, scope: Scope, kind: str, path: str, body: dict[str, Any], tenant: str):
    pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    first = dict(reversed(pairs))  # Headers.get semantics: the first of repeated headers
    headers = {k: v for k, v in pairs if k in FORWARDED_HEADERS}
    state = scope.get("state", {})
    headers.update(state.get("trace_headers", {}))
    request_id = state.get("request_id", "")
    headers["x-request-id"] = request_id
    route_req = RouteRequest(
        model=body["model"], messages=body.get("messages") if kind == "chat" else None,
        prompt=body.get("prompt") if kind == "completion" else None, tools=body.get("tools"),
        request_id=request_id, tenant=tenant, priority=_priority(first.get("x-priority")),
        session_id=first.get("x-session-id"),
        headers={k.lower(): v for k, v in pairs if k.lower() not in ("authorization", "x-api-key")},
        path=path)
    decision = _route(core, route_req)
    pool = decision.pool or core.models.get(body["model"], "")
    stream_options = body.get("stream_options") or {}
    req = ProxyRequest(kind=kind, path=path, body=body, model=body["model"], pool=pool, tenant=tenant,
                       request_id=request_id, headers=headers, client_stream=bool(body.get("stream")),
                       client_include_usage=bool(body.get("stream")) and bool(stream_options.get("include_usage")),
                       num_prompt_tokens=decision.num_prompt_tokens,
                       predicted_cached_tokens=decision.predicted_cached_tokens)
    session = Session(core, req, list(decision.worker_ids))
    if not req.client_stream:
        req.client_include_usage = True  # the aggregated response always carries usage
    held = await session.start()
    return session, held, decision


def _route(core: GatewayCore, route_req: RouteRequest):
    core.maybe_reload_policies()
    started = time.perf_counter()
    try:
        decision = core.router.route(route_req)
    except NoRouteError as exc:
        if route_req.model not in core.models:
            raise GatewayError(404, f"The model `{route_req.model}` does not exist.", "invalid_request_error",
                               code="model_not_found", param="model") from None
        raise GatewayError(503, f"no healthy worker: {exc}", "service_unavailable", code="no_healthy_worker",
                           retry_after_s=1) from None
    except OverflowError:  # token ids are packed as u32 for the block keys
        raise GatewayError(400, "prompt token ids must be integers in [0, 2**32)", param="prompt") from None
    except (ValueError, TypeError) as exc:  # e.g. a chat template that rejects the messages
        raise GatewayError(400, f"cannot tokenize the request: {exc}",
                           param="messages" if route_req.messages is not None else "prompt") from None
    core.metrics.decision_seconds.observe(time.perf_counter() - started)
    return decision


def _priority(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise GatewayError(400, "X-Priority must be an integer", param="X-Priority") from None


def _parse_body(raw: bytes, kind: str) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # NaN, Infinity, or a number too large for a float
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise GatewayError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise GatewayError(400, "model is required and must be a string", param="model")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise GatewayError(400, "stream must be a boolean", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise GatewayError(400, "stream_options must be an object", param="stream_options")
        if not body.get("stream"):
            raise GatewayError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise GatewayError(400, "messages must be a non-empty list of message objects", param="messages")
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise GatewayError(400, "prompt must be a string or a non-empty list", param="prompt")
        if len(prompt) > 1 and isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            raise GatewayError(400, "only one prompt per request is supported", param="prompt")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


async def _observed(core: GatewayCore, session: Session, stream, tenant: str):
    try:
        async for data in stream:
            yield data
    finally:
        _finish(core, session, tenant)


def _finish(core: GatewayCore, session: Session, tenant: str) -> None:
    req, m = session.req, core.metrics
    status = "200" if session.done or session.finish_reason is not None else "499"  # 499: client left
    m.child(m.requests, tenant, req.model, status).inc()
    m.child(m.e2e, req.model).observe(time.monotonic() - req.started_s)
    usage = session.final_usage() or {}
    if usage:
        m.child(m.prompt_tokens, tenant, req.model).inc(usage.get("prompt_tokens", 0))
        m.child(m.completion_tokens, tenant, req.model).inc(usage.get("completion_tokens", 0))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        m.child(m.cached_tokens, tenant, req.model).inc(cached)
        if session.failovers == 0 and len(session.tried) == 1 and req.predicted_cached_tokens is not None:
            core.router.record_outcome(req.predicted_cached_tokens, cached)
            m.child(m.predicted_cached, req.pool).inc(req.predicted_cached_tokens)
            m.child(m.reported_cached, req.pool).inc(cached)
            ratio = core.router.closed_loop.prediction_hit_ratio
            if ratio is not None:
                m.prediction_hit_ratio.set(ratio)


async def _unless_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T | None:
    """awaitable's result, awaited in this task; None if the client disconnects first (this task
    is then cancelled, so the upstream attempt is aborted at once and cleans up after itself)."""
    task = asyncio.current_task()
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        try:
            await _wait_disconnect(receive)
        except Exception:  # noqa: BLE001 - a broken receive counts as a client gone away
            pass
        disconnected = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not disconnected:
            raise
        task.uncancel()
        return None
    finally:
        watcher.cancel()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": list(_model_objects(_core(request)).values())})


async def model(request: Request) -> Response:
    """GET /v1/models/{id}: one model object, as OpenAI's retrieve answers (ids may contain '/')."""
    model_id = request.path_params["model_id"]
    found = _model_objects(_core(request)).get(model_id)
    if found is None:
        return GatewayError(404, f"The model `{model_id}` does not exist.", "invalid_request_error",
                            code="model_not_found", param="model").response()
    return JSONResponse(found)


def _model_objects(core: GatewayCore) -> dict[str, dict[str, Any]]:
    return {pool.model: {"id": pool.model, "object": "model", "created": core.started_at, "owned_by": "kvgate",
                         "pool": name}
            for name, pool in core.config.pools.items()}


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 when every pool has a worker in rotation; otherwise 503 naming what is missing."""
    core = _core(request)
    missing = [f"pool {pool}: no healthy worker" for pool in core.fleet.pools_without_workers()]
    if missing:
        return JSONResponse({"status": "not ready", "missing": missing}, status_code=503)
    body: dict[str, Any] = {"status": "ready"}
    redis_ok = await core.redis_ok()
    if redis_ok is False:  # still ready: replicas serve on local state, and say so
        body["degraded"] = ["redis unreachable: API keys from Redis and shared state unavailable"]
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    return Response(_core(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
