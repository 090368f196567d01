"""Tenants and their own limits: requests per second, tokens per minute, requests in flight.

A request over its tenant's limits is refused with 429 before it reaches a pool's queue. Tokens
are counted at admission as the prompt (estimated before tokenization, corrected once routing has
counted it) plus the completion reserved from max_tokens; the reservation is settled with the
usage the worker reports. Requests per second and tokens per minute live in token buckets (shared
across gateway replicas through Redis when configured); requests in flight are counted here, by
each replica (a limit shared by N replicas is max_concurrency / N each).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from admission.priority import Priority
from admission.token_bucket import BucketSpec, TokenBuckets


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's class (its ceiling), fair-share weight and optional limits."""

    name: str
    priority: Priority = Priority.STANDARD
    weight: float = 1.0
    requests_per_s: float | None = None
    requests_burst: float | None = None  # default: one second's worth (at least 1)
    tokens_per_min: float | None = None
    tokens_burst: float | None = None  # default: one minute's worth
    max_concurrency: int | None = None
    deadline_ms: float | None = None  # when the client sends no x-request-deadline-ms
    fallbacks: bool | frozenset[str] = True  # may a rule's fallback pools serve it (all, none, or these)?

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError("weight must be > 0")
        for name in ("requests_per_s", "requests_burst", "tokens_per_min", "tokens_burst", "max_concurrency",
                     "deadline_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0")

    def allows_fallback(self, pool: str) -> bool:
        """Whether a fallback pool may serve this tenant's requests: a tenant that must never be answered by
        another pool's model says `fallbacks: false` (or lists the pools it accepts) and is refused instead."""
        return self.fallbacks if isinstance(self.fallbacks, bool) else pool in self.fallbacks

    @property
    def request_bucket(self) -> BucketSpec | None:
        if self.requests_per_s is None:
            return None
        return BucketSpec(self.requests_per_s, self.requests_burst or max(1.0, self.requests_per_s))

    @property
    def token_bucket(self) -> BucketSpec | None:
        if self.tokens_per_min is None:
            return None
        return BucketSpec(self.tokens_per_min / 60.0, self.tokens_burst or self.tokens_per_min)


@dataclass(frozen=True, slots=True)
class OverLimit:
    """Why a tenant's request is refused, and when to try again."""

    reason: str  # "requests_per_s", "tokens_per_min" or "max_concurrency"
    retry_after_s: float


@dataclass(slots=True)
class TenantGrant:
    """What a request took from its tenant's limits; settle() it once, when the request ends.
    requests_left, tokens_left: what its buckets held after the take (None: no such limit, or not
    taken: a batch's later prompts take no request)."""

    tenant: TenantPolicy
    reserved_tokens: float
    settled: bool = False
    requests_left: float | None = None
    tokens_left: float | None = None


class TenantLimits:
    """Checks and takes a request's share of its tenant's limits. replicas: gateways sharing
    them (each counts max_concurrency / replicas of the requests in flight itself)."""

    def __init__(self, buckets: TokenBuckets, replicas: int = 1) -> None:
        self._buckets = buckets
        self._replicas = replicas
        self._in_flight: dict[str, int] = {}
        self._pending: set[asyncio.Task] = set()

    async def acquire(self, tenant: TenantPolicy, tokens: float, counts_request: bool = True) -> TenantGrant | OverLimit:
        """Take one request in flight and `tokens` (prompt estimate + completion reserved) from the limits,
        and one request from requests_per_s unless counts_request is False (a batch's prompts after its
        first: a batch counts once there, as OpenAI's rate limits count it)."""
        allowed = self.allowed_in_flight(tenant)
        if allowed is not None and self._in_flight.get(tenant.name, 0) >= allowed:
            return OverLimit("max_concurrency", 1.0)
        requests, token_spec = tenant.request_bucket if counts_request else None, tenant.token_bucket
        requests_left = tokens_left = None
        if requests is not None:
            wait_s, requests_left = await self._buckets.take(_key(tenant, "requests"), requests, 1)
            if wait_s > 0:
                return OverLimit("requests_per_s", wait_s)
        if token_spec is not None:
            wait_s, tokens_left = await self._buckets.take(_key(tenant, "tokens"), token_spec, tokens)
            if wait_s > 0:
                if requests is not None:  # the request was not admitted: its request token goes back
                    await self._buckets.adjust(_key(tenant, "requests"), requests, -1)
                return OverLimit("tokens_per_min", wait_s)
        self._in_flight[tenant.name] = self._in_flight.get(tenant.name, 0) + 1
        return TenantGrant(tenant, tokens if token_spec is not None else 0.0, requests_left=requests_left,
                           tokens_left=tokens_left)

    def allowed_in_flight(self, tenant: TenantPolicy) -> int | None:
        """The tenant's requests this replica lets run at once (None: no limit)."""
        if tenant.max_concurrency is None:
            return None
        return max(1, math.ceil(tenant.max_concurrency / self._replicas))

    def recount(self, grant: TenantGrant, tokens: float) -> None:
        """The request's tokens are now known better (routing counted the prompt): the difference
        is charged (in the background), and the reservation becomes tokens."""
        spec = grant.tenant.token_bucket
        if spec is None or grant.settled or tokens == grant.reserved_tokens:
            return
        self._adjust_later(_key(grant.tenant, "tokens"), spec, tokens - grant.reserved_tokens)
        grant.reserved_tokens = tokens

    def settle(self, grant: TenantGrant, used_tokens: float | None) -> None:
        """The request ended: it leaves the in-flight count at once, and its token reservation is
        settled with what it used (in the background; None keeps the reservation as the charge).
        Nothing here waits, so a request ending as its client is cancelled still settles."""
        if grant.settled:
            return
        grant.settled = True
        name = grant.tenant.name
        self._in_flight[name] = self._in_flight.get(name, 1) - 1
        spec = grant.tenant.token_bucket
        if spec is not None and used_tokens is not None and used_tokens != grant.reserved_tokens:
            self._adjust_later(_key(grant.tenant, "tokens"), spec, used_tokens - grant.reserved_tokens)

    async def settled(self) -> None:
        """Wait until every background settlement is written (tests, shutdown)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _adjust_later(self, key: str, spec: BucketSpec, amount: float) -> None:
        task = asyncio.get_running_loop().create_task(self._buckets.adjust(key, spec, amount))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)


def _key(tenant: TenantPolicy, limit: str) -> str:
    return f"{tenant.name}:{limit}"
