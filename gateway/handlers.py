"""The gateway's other endpoints: /v1/models (and one model), /health, /ready, /metrics.

The completion endpoints are gateway/proxy.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from kvgate.api_error import ApiError


class ServiceEndpoints:
    """models maps each served model to its pool; created is the models' `created` (when this
    gateway started serving them); redis_ok answers None without Redis, else whether it answers;
    shared_state, None without Redis, else for each kind of shared state whether it is shared now."""

    def __init__(self, *, models: Mapping[str, str], created: int, fleet: Fleet, metrics: GatewayMetrics,
                 redis_ok: Callable[[], Awaitable[bool | None]],
                 shared_state: Callable[[], Mapping[str, bool] | None]) -> None:
        self._models = {model: {"id": model, "object": "model", "created": created, "owned_by": "kvgate",
                                "pool": pool}
                        for model, pool in models.items()}
        self._fleet = fleet
        self._metrics = metrics
        self._redis_ok = redis_ok
        self._shared_state = shared_state

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": list(self._models.values())})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: one model object, as OpenAI's retrieve answers (ids may contain '/')."""
        model_id = request.path_params["model_id"]
        found = self._models.get(model_id)
        if found is None:
            return ApiError(404, f"The model `{model_id}` does not exist.", "invalid_request_error",
                            code="model_not_found", param="model").response()
        return JSONResponse(found)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """200 when every pool has a worker in rotation; otherwise 503 naming what is missing. Workers still
        warming up (slow start) are listed per pool with the share of new requests they take now."""
        missing = [f"pool {pool}: no healthy worker" for pool in self._fleet.pools_without_workers()]
        if missing:
            return JSONResponse({"status": "not ready", "missing": missing}, status_code=503)
        body: dict[str, Any] = {"status": "ready"}
        if warming := self._fleet.warming():  # ready all the same: they serve, at a share ramping up
            body["warming"] = warming
        degraded = []  # still ready: replicas serve on local state, and say so
        if await self._redis_ok() is False:
            degraded.append("redis unreachable: API keys from Redis served from cache for a bounded grace period, "
                            "others refused (503); shared state unavailable")
        shared = self._shared_state() or {}
        for part, note in _LOCAL_STATE_NOTES.items():
            if shared.get(part) is False:
                degraded.append(note)
        if degraded:
            body["degraded"] = degraded
        return JSONResponse(body)

    async def metrics(self, request: Request) -> Response:
        return Response(self._metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# what /ready says while a kind of shared state is local (Redis unreachable)
_LOCAL_STATE_NOTES = {
    "tenant_limits": "tenant limits local: each replica enforces its share until Redis answers",
    "retry_budgets": "retry budgets local: each replica spends its share until Redis answers",
    "peers": "routing decisions, load and breaker changes not shared with other replicas until Redis answers",
    "registry": "worker registry unreadable: registered workers stay as they were until Redis answers",
}
