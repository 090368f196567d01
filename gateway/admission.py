"""Admission in the gateway: every completion request takes a permit before it is routed.

First the tenant's own limits (requests per second, tokens per minute, requests in flight: 429),
then its pool's adaptive concurrency limit and fair queue (admission/pool_admission.py): admitted
at once, queued (the client waits), or refused (503). Every refusal carries Retry-After and an
OpenAI-style error naming the reason, and no worker sees the request. The permit is the admitted
work: its priority (the tenant's class, or lower if the client asked), its deadline, the pool's
retry budget (retries and failovers spend it), and it ends once, giving the pool's slot back with
the request's latency sample and settling the tenant's tokens with the usage reported.
With Redis, each pool's retry budget is one budget for every replica (admission/shared_retry_budget.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio

from admission.concurrency_limit import LimitConfig
from admission.fair_queue import QueuedRequest
from admission.pool_admission import PoolAdmission, PoolAdmissionSettings, Verdict
from admission.priority import Priority, admitted_priority
from admission.retry_budget import RetryBudget, RetryBudgetConfig
from admission.shared_retry_budget import RedisRetryCounts, SharedRetryBudget
from admission.tenants import OverLimit, TenantGrant, TenantLimits, TenantPolicy
from admission.token_bucket import TokenBuckets
from gateway.metrics import GatewayMetrics
from kvgate.api_error import ApiError
from kvgate.config import KvgateConfig, PoolConfig

log = logging.getLogger("kvgate.gateway")

EXPIRY_TICK_S = 0.01  # how often queued requests are checked for their deadline and allowed wait

_MESSAGES = {
    "requests_per_s": "tenant {tenant} is over its requests_per_s limit",
    "tokens_per_min": "tenant {tenant} is over its tokens_per_min limit",
    "max_concurrency": "tenant {tenant} has max_concurrency requests in flight already",
    "overloaded": "pool {pool} is overloaded: the request would wait longer than its queue allows",
    "queue_full": "pool {pool} is overloaded: its queue is full",
    "shed": "pool {pool} is overloaded: the request was shed for more urgent or fairer work",
    "queue_timeout": "pool {pool} is overloaded: the request waited its longest allowed time in the queue",
    "deadline_unmeetable": "pool {pool} cannot start the request before its deadline",
    "deadline_exceeded": "the request's deadline passed before a worker could take it",
}


# OpenAI's rate-limit headers: (limit, remaining, reset) of each limit
_REQUEST_LIMIT_HEADERS = tuple(f"x-ratelimit-{what}-requests".encode() for what in ("limit", "remaining", "reset"))
_TOKEN_LIMIT_HEADERS = tuple(f"x-ratelimit-{what}-tokens".encode() for what in ("limit", "remaining", "reset"))


class Refused(ApiError):
    """An admission refusal (429 or 503): its code is the reason; no worker saw the request."""


@dataclass(slots=True)  # built per request: not frozen (its __init__ would cost ~3x); never changed once built
class AdmissionRequest:
    """What admission needs to know about a completion request (before it is tokenized)."""

    tenant: str
    pool: str
    priority: Priority
    deadline_ms: float | None = None
    workflow_step: int | None = None
    prompt_tokens_estimate: int = 0
    max_tokens: int | None = None
    counts_request: bool = True  # False: a batch's prompt after its first (requests_per_s counts a batch once)


@dataclass(frozen=True, slots=True)
class _Waiter:
    """A queued request's client: the future it awaits, and what it asked for."""

    future: asyncio.Future
    request: AdmissionRequest


@dataclass(slots=True, eq=False)
class Permit:
    """An admitted request's hold on its tenant's limits and its pool's concurrency. end() once."""

    admission: Admission
    request: AdmissionRequest
    grant: TenantGrant
    admitted_s: float
    deadline_s: float | None
    reserved_completion_tokens: int
    ended: bool = field(default=False)

    @property
    def priority(self) -> Priority:
        return self.request.priority

    def deadline_passed(self) -> bool:
        return self.deadline_s is not None and self.admission.clock() >= self.deadline_s

    def retry_allowed(self) -> bool:
        """A retry or failover is more admitted work: it spends the pool's retry budget."""
        return self.admission.budgets[self.request.pool].try_spend()

    def prompt_counted(self, prompt_tokens: int) -> None:
        """Routing counted the prompt: the tenant's token reservation is corrected to it."""
        self.admission.limits.recount(self.grant, prompt_tokens + self.reserved_completion_tokens)

    def rate_limit_headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tenant's limits (none
        without limits): each limit's burst, what its bucket held after this request took its share, and
        how long until the bucket is full again ("6m0s", "1.5s", "250ms")."""
        grant = self.grant
        if grant.requests_left is None and grant.tokens_left is None:
            return []
        tenant = grant.tenant
        headers: list[tuple[bytes, bytes]] = []
        for names, spec, left in ((_REQUEST_LIMIT_HEADERS, tenant.request_bucket, grant.requests_left),
                                  (_TOKEN_LIMIT_HEADERS, tenant.token_bucket, grant.tokens_left)):
            if spec is None or left is None:
                continue
            limit, remaining, reset = names
            headers += [(limit, b"%d" % spec.burst), (remaining, b"%d" % max(0, math.floor(left))),
                        (reset, duration_text(max(0.0, spec.burst - left) / spec.rate_per_s).encode())]
        return headers

    def end(self, *, queue_delay_s: float | None, dropped: bool, usage: Mapping[str, Any] | None,
            first_token_at_s: float | None = None) -> None:
        """The request is over: the pool's slot goes back with its latency samples (queue_delay_s:
        time at the worker beyond its own prefill, None without a first token; dropped: the fleet
        failed it; first_token_at_s: when its first token came, on the admission clock), and the
        tenant's tokens are settled on usage (the reservation when None).
        Nothing here waits: it runs from a stream's cleanup, even as its client is cancelled."""
        if self.ended:
            return
        self.ended = True
        first_token_s = None if first_token_at_s is None else first_token_at_s - self.admitted_s
        self.admission.release(self, queue_delay_s, dropped, usage, first_token_s)


@dataclass(kw_only=True, eq=False)
class Admission:
    """Every pool's admission and every tenant's limits. run_expiry() is a background task.
    completion_reserve: per pool, the completion tokens reserved when a request gives no max_tokens."""

    tenants: dict[str, TenantPolicy]
    pools: Mapping[str, PoolAdmission]
    limits: TenantLimits
    budgets: Mapping[str, RetryBudget | SharedRetryBudget]
    metrics: GatewayMetrics
    completion_reserve: Mapping[str, int]
    clock: Callable[[], float] = time.monotonic
    _queued: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def tenant(self, name: str) -> TenantPolicy:
        """The tenant's policy; a tenant the config does not list (e.g. a key stored in Redis) gets the defaults."""
        policy = self.tenants.get(name)
        if policy is None:
            policy = self.tenants[name] = TenantPolicy(name)
        return policy

    def allowed_in_flight(self, tenant: str) -> int | None:
        """The tenant's requests this gateway lets run at once (None: no limit)."""
        return self.limits.allowed_in_flight(self.tenant(tenant))

    def priority_for(self, tenant: str, requested: Priority | None) -> Priority:
        return admitted_priority(self.tenant(tenant).priority, requested)

    async def admit(self, request: AdmissionRequest, overflow: Sequence[str] = ()) -> Permit:
        """A permit, after waiting in the pool's queue if need be; ApiError (429/503) when refused.
        overflow: pools that admit the request instead, in order, when request.pool would refuse it at
        arrival (gateway/fallbacks.py); the permit's request names the pool that admitted it. The tenant's
        limits count the request once, wherever it goes."""
        tenant = self.tenant(request.tenant)
        completion = request.max_tokens or self.completion_reserve[request.pool]
        verdict = await self.limits.acquire(tenant, request.prompt_tokens_estimate + completion, request.counts_request)
        if isinstance(verdict, OverLimit):
            raise self._refused(request, verdict.reason, verdict.retry_after_s, status=429)
        grant, now = verdict, self.clock()
        deadline_ms = request.deadline_ms if request.deadline_ms is not None else tenant.deadline_ms
        deadline_s = None if deadline_ms is None else now + deadline_ms / 1000.0
        queued = QueuedRequest(tenant.name, request.priority, tenant.weight, deadline_s=deadline_s,
                               workflow_step=request.workflow_step)
        try:
            request = await self._first_slot(request, overflow, queued)
        except BaseException:
            self.limits.settle(grant, 0)  # refused or gone: it used nothing
            raise
        self.budgets[request.pool].record_request()
        self.metrics.child(self.metrics.admitted, request.pool, tenant.name, request.priority.label).inc()
        return Permit(self, request, grant, self.clock(), deadline_s, completion)

    async def move(self, permit: Permit, pool: str) -> None:
        """The permit's request goes to another pool (its prompt is too long for its own): a slot there
        first (it may wait; Refused when that pool refuses it), then its slot here given back. The tenant's
        limits stay counted once; the permit's request names the new pool."""
        request, tenant = permit.request, self.tenant(permit.request.tenant)
        moved = dataclasses.replace(request, pool=pool)
        queued = QueuedRequest(tenant.name, request.priority, tenant.weight, deadline_s=permit.deadline_s,
                               workflow_step=request.workflow_step)
        refusal = await self._take_slot(self.pools[pool], queued, moved)
        if refusal is not None:
            raise self._refused(moved, refusal.reason or "queue_full", refusal.retry_after_s or 1.0)
        left = self.pools[request.pool]
        self._admit(left, left.forget())
        permit.request = moved
        self.budgets[pool].record_request()

    async def _first_slot(self, request: AdmissionRequest, overflow: Sequence[str],
                          queued: QueuedRequest) -> AdmissionRequest:
        """request with the pool that took it: its own, or the first of overflow that admits it at once or
        queues it (a refusal at arrival moves it on; when every pool refuses, its own pool's refusal is the
        client's)."""
        first_refusal: Verdict | None = None
        for pool_name in (request.pool, *overflow):
            offered = request if pool_name == request.pool else dataclasses.replace(request, pool=pool_name)
            refusal = await self._take_slot(self.pools[pool_name], queued, offered)
            if refusal is None:
                return offered
            first_refusal = first_refusal or refusal
        raise self._refused(request, first_refusal.reason or "queue_full", first_refusal.retry_after_s or 1.0)

    async def _take_slot(self, pool: PoolAdmission, queued: QueuedRequest, request: AdmissionRequest) -> Verdict | None:
        """None once admitted (at once, or after waiting in the queue: Refused if refused there); the
        verdict when the pool refuses the request at arrival."""
        verdict = pool.offer(queued)
        if verdict.shed is not None:
            self._refuse_waiting(verdict.shed, "shed", pool)
        if verdict.outcome == "admitted":
            return None
        if verdict.outcome == "rejected":
            return verdict
        future = asyncio.get_running_loop().create_future()
        queued.handle = _Waiter(future, request)
        self._queued.set()
        try:
            await future
        except asyncio.CancelledError:  # the client left while it waited
            if future.done() and not future.cancelled() and future.exception() is None:
                self._admit(pool, pool.forget())  # admitted just as it left: the slot goes to the next
            else:
                pool.cancel(queued)
            raise
        finally:
            waited_s = self.clock() - queued.enqueued_s
            self.metrics.child(self.metrics.queue_wait, request.pool, request.priority.label).observe(waited_s)

    def release(self, permit: Permit, queue_delay_s: float | None, dropped: bool,
                usage: Mapping[str, Any] | None, first_token_s: float | None = None) -> None:
        pool = self.pools[permit.request.pool]
        held_s = self.clock() - permit.admitted_s
        if queue_delay_s is None and not dropped:  # never reached a worker's first token: no sample
            self._admit(pool, pool.forget())
        else:
            self._admit(pool, pool.release(held_s, queue_delay_s, dropped, first_token_s, permit.priority))
        used = None if usage is None else (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
        self.limits.settle(permit.grant, used)

    async def run_expiry(self) -> None:
        """Answer queued requests past their deadline or their allowed wait, a few times a second
        while anything waits (and not at all while nothing does)."""
        while True:
            await self._queued.wait()
            self._queued.clear()
            while any(len(pool.queue) for pool in self.pools.values()):
                for pool in self.pools.values():
                    for queued, reason in pool.expire():
                        self._refuse_waiting(queued, reason, pool)
                await asyncio.sleep(EXPIRY_TICK_S)

    async def start_budget_sync(self) -> None:
        """Start syncing the retry budgets shared through Redis (budgets of this process alone have none)."""
        for budget in self.budgets.values():
            if isinstance(budget, SharedRetryBudget):
                await budget.start()

    def budgets_shared(self) -> bool:
        """Whether every pool's retry budget is shared through Redis now (False: some replica's
        budget is local; always False without Redis)."""
        return all(isinstance(b, SharedRetryBudget) and b.state == "redis" for b in self.budgets.values())

    async def stop_budget_sync(self) -> None:
        """Stop those syncs (at shutdown, before the Redis client closes)."""
        for budget in self.budgets.values():
            if isinstance(budget, SharedRetryBudget):
                await budget.aclose()

    def _admit(self, pool: PoolAdmission, admitted: list[QueuedRequest]) -> None:
        """Wake the clients of requests the pool admitted; one that left already gives its slot on."""
        for queued in admitted:
            if not queued.handle.future.done():
                queued.handle.future.set_result(None)
            else:
                self._admit(pool, pool.forget())

    def _refuse_waiting(self, queued: QueuedRequest, reason: str, pool: PoolAdmission) -> None:
        waiter: _Waiter = queued.handle
        if not waiter.future.done():
            waiter.future.set_exception(self._refused(waiter.request, reason, pool.retry_after_s()))

    def _refused(self, request: AdmissionRequest, reason: str, retry_after_s: float, status: int = 503) -> Refused:
        self.metrics.child(self.metrics.rejected, request.pool, request.tenant, request.priority.label, reason).inc()
        message = _MESSAGES[reason].format(tenant=request.tenant, pool=request.pool)
        type_ = "rate_limit_exceeded" if status == 429 else "service_unavailable"
        return Refused(status, message, type_, code=reason, retry_after_s=max(1, math.ceil(retry_after_s)))


DEFAULT_WORKER_CONCURRENCY = 64  # a worker without a launch section: vLLM's default max_num_seqs is higher


def admission_from_config(config: KvgateConfig, metrics: GatewayMetrics, buckets: TokenBuckets,
                          clock: Callable[[], float] = time.monotonic,
                          redis_client: redis.asyncio.Redis | None = None) -> Admission:
    """Every pool's admission (its ceiling: what its workers run, unless configured) and every
    configured tenant's policy; the retry budgets of upstream.retry_budget_*, shared by the
    config.redis.replicas gateways through redis_client when one is given (start_budget_sync())."""
    pools = {name: PoolAdmission(_pool_admission_settings(pool), clock) for name, pool in config.pools.items()}
    tenants = {name: TenantPolicy(name, Priority.parse(t.priority), t.weight, t.requests_per_s, t.requests_burst,
                                  t.tokens_per_min, t.tokens_burst, t.max_concurrency, t.deadline_ms,
                                  t.fallbacks if isinstance(t.fallbacks, bool) else frozenset(t.fallbacks))
               for name, t in config.tenants.items()}
    return Admission(tenants=tenants, pools=pools, limits=TenantLimits(buckets, config.redis.replicas),
                     budgets=_retry_budgets(config, metrics, clock, redis_client), metrics=metrics,
                     completion_reserve={name: p.admission.default_completion_tokens
                                         for name, p in config.pools.items()}, clock=clock)


def _retry_budgets(config: KvgateConfig, metrics: GatewayMetrics, clock: Callable[[], float],
                   redis_client: redis.asyncio.Redis | None) -> dict[str, RetryBudget | SharedRetryBudget]:
    up = config.upstream
    budget = RetryBudgetConfig(ratio=up.retry_budget_ratio, min_retries_per_s=up.retry_budget_min_per_s)
    if redis_client is None:
        return {name: RetryBudget(budget, clock) for name in config.pools}
    shared = {name: SharedRetryBudget(RedisRetryCounts(redis_client, name, budget.window_s), budget,
                                      config.redis.replicas, clock,
                                      on_change=functools.partial(_log_budget_state, name))
              for name in config.pools}
    return shared


def _log_budget_state(pool: str, state: str) -> None:
    if state == "redis":
        log.info("pool %s: retry budget shared through Redis", pool)
    else:
        log.warning("pool %s: Redis unreachable: retry budget enforced locally, this replica's share, "
                    "until it answers", pool)


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it: "250ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"


def pool_concurrency_ceiling(pool: PoolConfig, registered_workers: int = 0) -> int:
    """The most requests a pool's workers run at once: its max_concurrency, else the sum over its
    configured and registered workers (a pool with none yet counts one, the limit's starting scale)."""
    if pool.admission.max_concurrency is not None:
        return pool.admission.max_concurrency
    ceiling = sum(w.launch.max_num_seqs if w.launch else DEFAULT_WORKER_CONCURRENCY for w in pool.workers)
    return ceiling + registered_workers * DEFAULT_WORKER_CONCURRENCY or DEFAULT_WORKER_CONCURRENCY


def _pool_admission_settings(pool: PoolConfig) -> PoolAdmissionSettings:
    knobs = pool.admission
    ceiling = pool_concurrency_ceiling(pool)
    minimum = min(knobs.min_concurrency, ceiling)
    initial = None if knobs.initial_concurrency is None else min(max(knobs.initial_concurrency, minimum), ceiling)
    limit = LimitConfig(max_limit=ceiling, min_limit=minimum, initial_limit=initial,
                        queue_delay_target_s=knobs.queue_delay_target_s)
    return PoolAdmissionSettings(limit, queue_size=knobs.queue_size, queue_target_s=knobs.queue_target_s,
                               queue_interval_s=knobs.queue_interval_s, max_queue_wait_s=knobs.max_queue_wait_s)
