"""API-key authentication: key -> tenant, from hashed keys in the config, a dev key, or Redis.

Only SHA-256 digests are held. Config keys are compared with hmac.compare_digest against every
known digest (no early exit), so the time taken does not depend on how much of a key matched.
Keys are read from `Authorization: Bearer KEY` or `x-api-key`, never from the query string.
A digest that matched a config key is remembered (a small dict keyed by the digest, so no key
is held), and the next request with that key skips the comparisons.

Redis lookups are cached in two bounded LRUs keyed by digest: keys Redis holds for
FOUND_TTL_S, keys it does not for NOT_FOUND_TTL_S, so neither a flood of random keys nor a
repeated wrong key costs memory or a Redis call each. When Redis fails, no request waits on it
again until a background PING (every REDIS_RETRY_INTERVAL_S) answers; meanwhile a key Redis held
is served for at most STALE_GRACE_S past its TTL, and any other key Redis would have to vouch for
is answered 503 (it cannot be checked), never served.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from opentelemetry.trace import Tracer
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from admission.redis_buckets import REDIS_ERRORS, wait_until_redis_answers
from gateway.metrics import GatewayMetrics
from gateway.telemetry import PROBE_PATHS, step_span
from kvgate.api_error import ApiError
from kvgate.config import AuthConfig
from kvgate.keys import REDIS_KEYS_HASH, hash_key
from kvgate.tasks import stop_tasks

log = logging.getLogger("kvgate.gateway")

UNAUTHENTICATED_TENANT = "unauthenticated"  # the tenant label of requests refused with 401
FOUND_TTL_S = 30.0  # a key Redis holds is trusted this long before it is looked up again (a revocation's delay)
NOT_FOUND_TTL_S = 2.0  # a key Redis does not hold is refused this long without asking again
STALE_GRACE_S = 60.0  # Redis unreachable: a key it held is served this long past FOUND_TTL_S, then refused
REDIS_RETRY_INTERVAL_S = 1.0  # Redis unreachable: PING it this often in the background
MAX_FOUND_ENTRIES = 65_536  # about 10 MiB at most
MAX_NOT_FOUND_ENTRIES = 8_192
_MAX_REMEMBERED_DIGESTS = 4096
_POLICY_VIOLATION = 1008  # the WebSocket close code for a refused connection (RFC 6455 7.4.1)

V = TypeVar("V")


class TtlLru(Generic[V]):
    """At most max_entries values, each with its expiry; when full, the least recently used goes.
    get() answers an expired entry too (with its expiry): whether stale is good enough is the caller's call."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[V, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[V, float] | None:
        """(value, expires_s), or None when absent."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, value: V, expires_s: float) -> None:
        self._entries[key] = (value, expires_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def pop(self, key: str) -> None:
        self._entries.pop(key, None)


class KeysUnavailable(Exception):
    """Only Redis could say whether the key is valid, and Redis is unreachable."""


class KeyStore:
    """Resolves a presented key to its tenant, or None; raises KeysUnavailable when only an
    unreachable Redis could tell (see the module docstring for the caching and the grace period)."""

    def __init__(self, config: AuthConfig, env: dict[str, str], redis_client=None,
                 clock: Callable[[], float] = time.monotonic, *, found_ttl_s: float = FOUND_TTL_S,
                 not_found_ttl_s: float = NOT_FOUND_TTL_S, stale_grace_s: float = STALE_GRACE_S,
                 retry_interval_s: float = REDIS_RETRY_INTERVAL_S, max_found_entries: int = MAX_FOUND_ENTRIES,
                 max_not_found_entries: int = MAX_NOT_FOUND_ENTRIES) -> None:
        self._digests: list[tuple[bytes, str]] = [(k.sha256.encode(), k.tenant) for k in config.keys]
        dev_key = env.get(config.dev_key_env) if config.dev_key_enabled and config.dev_key_env else None
        if dev_key:
            self._digests.append((hash_key(dev_key).encode(), config.dev_tenant))
        self._local_hits: dict[str, str] = {}  # digest -> tenant, for config keys seen lately
        self._redis = redis_client
        self._clock = clock
        self._found_ttl_s, self._not_found_ttl_s, self._stale_grace_s = found_ttl_s, not_found_ttl_s, stale_grace_s
        self._retry_interval_s = retry_interval_s
        self.found: TtlLru[str] = TtlLru(max_found_entries)  # digest -> tenant Redis gave
        self.not_found: TtlLru[None] = TtlLru(max_not_found_entries)  # digests Redis did not hold
        self._lookups: dict[str, asyncio.Task[str | None]] = {}  # one Redis call per digest at a time
        self._probe: asyncio.Task[None] | None = None  # set while Redis is known unreachable

    @property
    def redis_down(self) -> bool:
        """True while Redis is known unreachable (lookups answer from the cache until a PING answers)."""
        return self._probe is not None and not self._probe.done()

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

    async def aclose(self) -> None:
        """Stop the background probe (at shutdown); the Redis client is its owner's to close."""
        await stop_tasks([self._probe, *self._lookups.values()])
        self._probe = None

    def _match_local(self, digest: bytes) -> str | None:
        """Compared with every known digest (no early exit): the time does not depend on the key."""
        found = None
        for known, tenant in self._digests:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    async def _match_redis(self, digest: str) -> str | None:
        now = self._clock()
        found = self.found.get(digest)
        if found is not None and now < found[1]:
            return found[0]
        not_found = self.not_found.get(digest)
        if not_found is not None and now < not_found[1]:
            return None
        if self.redis_down:
            return self._stale(found, now)
        try:
            return await self._lookup(digest)
        except REDIS_ERRORS as exc:
            self._went_down(exc)
            return self._stale(found, self._clock())

    def _stale(self, found: tuple[str, float] | None, now: float) -> str:
        """Redis unreachable: the cached tenant within the grace period after its TTL, else KeysUnavailable."""
        if found is not None and now < found[1] + self._stale_grace_s:
            return found[0]
        raise KeysUnavailable

    async def _lookup(self, digest: str) -> str | None:
        """One HGET per digest at a time: requests presenting the same key meanwhile share its answer."""
        task = self._lookups.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._fetch(digest))
            self._lookups[digest] = task
            task.add_done_callback(lambda done: self._lookup_done(digest, done))
        return await asyncio.shield(task)

    def _lookup_done(self, digest: str, task: asyncio.Task) -> None:
        self._lookups.pop(digest, None)
        if not task.cancelled():
            task.exception()  # retrieved here, so a lookup whose waiters all went away logs nothing

    async def _fetch(self, digest: str) -> str | None:
        value = await self._redis.hget(REDIS_KEYS_HASH, digest)
        tenant = value.decode() if isinstance(value, bytes) else value
        now = self._clock()
        if tenant is None:
            self.found.pop(digest)  # revoked: no grace period may bring it back
            self.not_found.put(digest, None, now + self._not_found_ttl_s)
        else:
            self.not_found.pop(digest)
            self.found.put(digest, tenant, now + self._found_ttl_s)
        return tenant

    def _went_down(self, exc: BaseException) -> None:
        if self.redis_down:
            return
        log.warning("api-key lookup in Redis failed (%s): serving keys Redis held from the cache, for at most "
                    "%.0f s past their TTL, until a PING answers", type(exc).__name__, self._stale_grace_s)
        self._probe = asyncio.create_task(self._probe_until_redis_answers(), name="api-keys-redis-probe")

    async def _probe_until_redis_answers(self) -> None:
        await wait_until_redis_answers(self._redis, self._retry_interval_s)
        log.info("Redis answers again: api keys are looked up there again")


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
    """Refuses HTTP requests to the API without a known key (401; 503 while only an unreachable
    Redis could tell) and WebSocket connections without one (closed before accept: the server
    answers 403); sets scope['state']['tenant']. Only lifespan events pass unchecked."""

    def __init__(self, app: ASGIApp, keys: KeyStore, metrics: GatewayMetrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.tracer = tracer  # an `auth` span per request while tracing is on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] in PROBE_PATHS):
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        try:
            with step_span(self.tracer, "auth") as span:
                tenant = await self.keys.tenant_for(key) if key is not None else None
                if span is not None:
                    span.set_attribute("kvgate.tenant", tenant or UNAUTHENTICATED_TENANT)
        except KeysUnavailable:
            await self._refuse(scope, receive, send, ApiError(
                503, "API keys cannot be checked now (the key store is unreachable); retry shortly.",
                "service_unavailable", code="auth_unavailable", retry_after_s=1))
            return
        if tenant is None:
            message = ("Missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`." if key is None
                       else "Incorrect API key provided.")
            await self._refuse(scope, receive, send, ApiError(401, message, "authentication_error",
                                                              code="invalid_api_key"))
            return
        state = scope.setdefault("state", {})
        state["tenant"] = tenant
        if (record := state.get("log")) is not None:
            record["tenant"] = tenant
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        if scope["type"] != "http":  # a WebSocket (or anything else): closed before it is accepted
            await WebSocketClose(code=_POLICY_VIOLATION, reason=error.message[:100])(scope, receive, send)
            return
        if self.metrics is not None:  # counted, so error-ratio panels see refused clients too
            self.metrics.child(self.metrics.requests, UNAUTHENTICATED_TENANT, "unknown", "none",
                               str(error.status)).inc()
        if (record := scope.get("state", {}).get("log")) is not None:
            record.update(tenant=UNAUTHENTICATED_TENANT, outcome=error.code, error=error.message)
        headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
        await error.response(headers)(scope, receive, send)
