"""API-key authentication: key -> tenant, from hashed keys in the config, a dev key, or Redis.

Only SHA-256 digests are held. Config keys are compared with hmac.compare_digest against every
known digest (no early exit), so the time taken does not depend on how much of a key matched.
Keys are read from `Authorization: Bearer KEY` or `x-api-key`, never from the query string.
A digest that matched a config key is remembered (a small dict keyed by the digest, so no key
is held), and the next request with that key skips the comparisons.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.metrics import GatewayMetrics
from kvgate.api_error import ApiError
from kvgate.config import AuthConfig
from kvgate.keys import REDIS_KEYS_HASH, hash_key

log = logging.getLogger("kvgate.gateway")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
UNAUTHENTICATED_TENANT = "unauthenticated"  # the tenant label of requests refused with 401
_REDIS_CACHE_TTL_S = 30.0
_REDIS_NEGATIVE_TTL_S = 2.0
_MAX_REMEMBERED_DIGESTS = 4096


class KeyStore:
    """Resolves a presented key to its tenant, or None."""

    def __init__(self, config: AuthConfig, env: dict[str, str], redis_client=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._digests: list[tuple[bytes, str]] = [(k.sha256.encode(), k.tenant) for k in config.keys]
        dev_key = env.get(config.dev_key_env) if config.dev_key_env else None
        if dev_key:
            self._digests.append((hash_key(dev_key).encode(), config.dev_tenant))
        self._redis = redis_client
        self._clock = clock
        self._cache: dict[str, tuple[str | None, float]] = {}
        self._local_hits: dict[str, str] = {}  # digest -> tenant, for config keys seen lately

    async def tenant_for(self, key: str) -> str | None:
        digest = hash_key(key)
        tenant = self._local_hits.get(digest)
        if tenant is not None:
            return tenant
        tenant = self._match_local(digest.encode())
        if tenant is not None:
            if len(self._local_hits) >= _MAX_REMEMBERED_DIGESTS:
                self._local_hits.clear()
            self._local_hits[digest] = tenant
        elif self._redis is not None:
            tenant = await self._match_redis(digest)
        return tenant

    def _match_local(self, digest: bytes) -> str | None:
        """Compared with every known digest (no early exit): the time does not depend on the key."""
        found = None
        for known, tenant in self._digests:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    async def _match_redis(self, digest: str) -> str | None:
        cached = self._cache.get(digest)
        now = self._clock()
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            value = await self._redis.hget(REDIS_KEYS_HASH, digest)
        except Exception as exc:  # Redis down: serve on local keys, say so in the log
            log.warning("api-key lookup in Redis failed: %s", type(exc).__name__)
            return cached[0] if cached is not None else None
        tenant = value.decode() if isinstance(value, bytes) else value
        ttl = _REDIS_CACHE_TTL_S if tenant is not None else _REDIS_NEGATIVE_TTL_S
        self._cache[digest] = (tenant, now + ttl)
        return tenant


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from `Authorization: Bearer KEY` or `x-api-key: KEY`, else None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


class AuthMiddleware:
    """Rejects requests to the API without a known key (401); sets scope['state']['tenant']."""

    def __init__(self, app: ASGIApp, keys: KeyStore, metrics: GatewayMetrics | None = None) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        tenant = await self.keys.tenant_for(key) if key is not None else None
        if tenant is None:
            message = ("Missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`." if key is None
                       else "Incorrect API key provided.")
            error = ApiError(401, message, "authentication_error", code="invalid_api_key")
            if self.metrics is not None:  # counted, so error-ratio panels see refused clients too
                self.metrics.child(self.metrics.requests, UNAUTHENTICATED_TENANT, "unknown", "401").inc()
            await error.response({"www-authenticate": "Bearer"})(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
