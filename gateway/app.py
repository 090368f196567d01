"""The gateway ASGI app: routes, and the middleware order in one visible place."""

from __future__ import annotations

import contextlib
import gc

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth import AuthMiddleware, KeyStore
from gateway.core import GatewayCore
from gateway.cors import CorsMiddleware
from gateway.handlers import ServiceEndpoints
from gateway.middleware import BodyLimitsMiddleware, HeaderLimitsMiddleware, RequestContextMiddleware
from gateway.proxy import KINDS, ProxyEndpoint
from kvgate.api_error import ApiError


def build_middleware(core: GatewayCore, keys: KeyStore, completions: dict[str, ProxyEndpoint]) -> list[Middleware]:
    """Outermost first, each refusing before the next does any work: header limits (before anything
    reads a header), browsers' cross-origin preflights (only with gateway.cors_allowed_origins set: they
    carry no key), request id + trace context + the request's log line, auth (HTTP and WebSocket alike),
    body limits (only a known client's body is read); then the completion endpoints (every other path goes
    on to Starlette's router). Admission is the completion endpoint's first step, once the
    body says which pool a request is for (gateway/proxy.py: parse -> admit -> route -> proxy)."""
    origins = core.config.gateway.cors_allowed_origins
    return [
        Middleware(HeaderLimitsMiddleware, limits=core.config.limits),
        *([Middleware(CorsMiddleware, allowed_origins=origins)] if origins else []),
        Middleware(RequestContextMiddleware, telemetry=core.telemetry),
        Middleware(AuthMiddleware, keys=keys, metrics=core.metrics, tracer=core.telemetry.tracer),
        Middleware(BodyLimitsMiddleware, limits=core.config.limits),
        Middleware(CompletionPaths, endpoints=completions),
    ]


class CompletionPaths:
    """POST /v1/chat/completions and /v1/completions straight to their ASGI endpoints: the path
    every completion takes skips the router's route matching and its exception wrapper (the
    endpoints answer their own errors). Other methods on these paths reach the router (405)."""

    def __init__(self, app: ASGIApp, endpoints: dict[str, ASGIApp]) -> None:
        self.app = app
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope.get("path", "")) if scope.get("method") == "POST" else None
        await (endpoint or self.app)(scope, receive, send)


def completion_endpoints(core: GatewayCore) -> dict[str, ProxyEndpoint]:
    """Each completion path's endpoint, given exactly the parts a request touches."""
    prices = {name: pool.prices for name, pool in core.config.pools.items()}
    return {path: ProxyEndpoint(path=path, admission=core.admission, router=core.router, fleet=core.fleet,
                                upstream=core.upstream, settings=core.config.upstream, metrics=core.metrics,
                                prices=prices, tokenizers=core.tokenizers, models=core.models,
                                debug_header_for=core.config.routing.debug_header_for, rng=core.rng,
                                offload=core.offload, longest_prompt_tokens=core.longest_prompt_tokens,
                                telemetry=core.telemetry, shutdown=core.shutdown)
            for path in KINDS}


def build_app(core: GatewayCore, keys: KeyStore | None = None, *, freeze_gc: bool = False) -> GatewayApp:
    """freeze_gc: after startup, move every object alive then out of the collector's reach (for a
    server process; tests leave it off so their objects stay collectable)."""
    keys = keys or core.keys
    completions = completion_endpoints(core)
    service = ServiceEndpoints(models=core.models, created=core.started_at, fleet=core.fleet, metrics=core.metrics,
                               redis_ok=core.redis_ok, shared_state=core.shared_state)
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in completions.items()),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", service.model, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/ready", service.ready, methods=["GET"]),
        Route("/metrics", service.metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await core.start()
        if freeze_gc:
            freeze_startup_objects()
        try:
            yield
        finally:
            await core.stop()

    starlette = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
    starlette.router.redirect_slashes = False  # /v1/completions/ is a 404, not a redirect clients would have to follow
    return GatewayApp(build_middleware(core, keys, completions), starlette)


class GatewayApp:
    """The ASGI app the server runs: every HTTP request and WebSocket through the gateway's own
    middleware (build_middleware, outermost first), then to a completion endpoint or, on any other
    path, to `starlette` (its router, its error pages for the other routes, and the lifespan). A
    completion does not pass through Starlette at all: the endpoints answer their own errors, and an
    exception that escapes the middleware is the server's 500, as Starlette's outermost layer would
    have answered it."""

    def __init__(self, middleware: list[Middleware], starlette: Starlette) -> None:
        self.starlette = starlette
        app: ASGIApp = starlette
        for layer in reversed(middleware):
            app = layer.cls(app, *layer.args, **layer.kwargs)
        self._middleware = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.starlette(scope, receive, send)
        else:
            await self._middleware(scope, receive, send)


# full collections 10x rarer than the interpreter's default (10): each walks every object alive, and a long
# answer being assembled (a 32,000-token answer with logprobs: ~160,000 of them) made its collections cost
# it 2.3x the CPU a token of a short one (1.35x at 100). Requests' own objects are freed as they end, by
# reference counting: what waits longer for a full collection is only garbage in cycles.
FULL_COLLECTION_THRESHOLD = 100


def freeze_startup_objects() -> None:
    """gc.freeze() what startup built (modules, config, clients: tens of thousands of objects), so a
    full collection under load walks only what requests left behind: a pause of a few ms, not tens;
    and run full collections less often (FULL_COLLECTION_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    young, middle, _full = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_THRESHOLD)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, exc.detail or "error", type_).response(exc.headers)  # e.g. 405's Allow
