"""Gateway metrics (prefix `kvgate_`), one registry per app; no API key ever becomes a label. The series
every request updates are kept on the event loop without locks (gateway/loop_metrics.py)."""

from __future__ import annotations

import importlib.metadata
import math
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from admission.pool_admission import PoolState
from gateway.loop_metrics import LoopCounter, LoopHistogram
from router.router import RouterStats

disable_created_metrics()  # no `_created` series beside every counter: scrape noise no dashboard reads

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.5)
_QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FAILOVER_MODES = ("token_ids", "text")  # how a failover continued the answer (gateway/session.py)
_REFUSAL_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DECISION_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Loop*: the series requests update, without locks (gateway/loop_metrics.py); the rest are prometheus_client's
        self.requests = LoopCounter("kvgate_requests", "Requests by tenant, model, pool (none: refused before "
                                    "one was chosen) and final HTTP status.", ["tenant", "model", "pool", "status"], r)
        self.ttft = LoopHistogram("kvgate_time_to_first_token_seconds", "Client-side time to first token.",
                                  ["model", "pool"], _LATENCY_BUCKETS_S, r)
        self.itl = LoopHistogram("kvgate_inter_token_latency_seconds", "Time between streamed chunks.",
                                 ["model", "pool"], _ITL_BUCKETS_S, r)
        self.e2e = LoopHistogram("kvgate_e2e_request_latency_seconds", "End-to-end request latency.",
                                 ["model", "pool"], _LATENCY_BUCKETS_S, r)
        self.requests_in_flight = 0  # completion requests inside the gateway (gateway/proxy.py counts them)
        self.routed = LoopCounter("kvgate_routed", "Routing decisions, by pool, policy and the worker ranked first.",
                                  ["pool", "policy", "worker"], r)
        self.attempts = LoopCounter("kvgate_upstream_attempts", "Upstream attempts by worker and outcome.",
                                    ["worker", "outcome"], r)
        self.retries = Counter("kvgate_upstream_retries", "Retries on another worker.", ["pool"], registry=r)
        self.budget_refusals = Counter("kvgate_retry_budget_refusals", "Retries refused by the retry budget.",
                                       ["pool"], registry=r)
        self.failovers = Counter("kvgate_failovers", "Streams continued on another worker mid-answer, by how: "
                                 "from the token ids (exact) or from the delivered text.", ["pool", "mode"],
                                 registry=r)
        self.fallbacks = Counter("kvgate_fallbacks", "Requests served by another pool than their rule's, by the pool "
                                 "they left, the pool that took them and why (overloaded, unavailable, "
                                 "context_length_exceeded).", ["from_pool", "to_pool", "reason"], registry=r)
        self.breaker_state = Gauge("kvgate_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                   ["worker"], registry=r)
        self.worker_healthy = Gauge("kvgate_worker_healthy", "1 if the worker is in rotation.", ["worker"],
                                    registry=r)
        self.ejections = Counter("kvgate_worker_ejections", "Slow-worker ejections.", ["worker"], registry=r)
        self.prompt_tokens = LoopCounter("kvgate_prompt_tokens", "Prompt tokens (from upstream usage).",
                                         ["tenant", "model", "pool"], r)
        self.completion_tokens = LoopCounter("kvgate_completion_tokens", "Completion tokens (from upstream usage).",
                                             ["tenant", "model", "pool"], r)
        self.cached_tokens = LoopCounter("kvgate_cached_tokens", "Prompt tokens served from a worker's prefix cache "
                                         "(over prompt tokens: the pool's actual hit rate).",
                                         ["tenant", "model", "pool"], r)
        self.decision_seconds = LoopHistogram("kvgate_routing_decision_seconds",
                                              "Tokenize + key + match + score time per request.", [],
                                              _DECISION_BUCKETS_S, r)
        self.policy_reloads = Counter("kvgate_policy_reloads", "Routing-policy file reloads, by outcome.",
                                      ["outcome"], registry=r)
        self.admitted = LoopCounter("kvgate_admitted", "Requests admitted, by pool, tenant and priority.",
                                    ["pool", "tenant", "priority"], r)
        self.rejected = LoopCounter("kvgate_rejected", "Requests refused by admission (429 tenant limits, 503 pool "
                                    "overload), by reason.", ["pool", "tenant", "priority", "reason"], r)
        self.refusal_seconds = LoopHistogram(
            "kvgate_refusal_seconds", "Time from a completion request's arrival at its endpoint to its admission "
            "refusal, by reason (refused on arrival, or after a wait in the queue).",
            ["reason"], _REFUSAL_BUCKETS_S, r)
        self.queue_wait = LoopHistogram("kvgate_queue_wait_seconds", "Time a queued request waited for admission.",
                                        ["pool", "priority"], _QUEUE_WAIT_BUCKETS_S, r)
        self.cost = LoopCounter("kvgate_cost", "What requests cost in USD (the pool's prices x usage), answered "
                                "or not.", ["tenant"], r)
        r.register(_InFlightCollector(self))
        build = Gauge("kvgate_build_info", "The running gateway's version and Python (always 1).",
                      ["version", "python_version"], registry=r)
        build.labels(version=_version(), python_version=platform.python_version()).set(1)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
            r.register(collector)
        self._cost_by_tenant: dict[str, float] = {}
        self._answered_by_tenant: dict[str, int] = {}

        self._children: dict[tuple, object] = {}

    def start_series(self, pools: Iterable[str], workers: Iterable[str]) -> None:
        """Create the per-pool and per-worker counters at 0, so a dashboard shows 0 (not "no data")
        until the first retry, failover or ejection."""
        for pool in pools:
            for counter in (self.retries, self.budget_refusals):
                counter.labels(pool=pool)
            for mode in FAILOVER_MODES:
                self.failovers.labels(pool=pool, mode=mode)
        for worker in workers:
            self.ejections.labels(worker=worker)
        for outcome in ("ok", "error"):
            self.policy_reloads.labels(outcome=outcome)

    def watch_router(self, stats: Callable[[], RouterStats]) -> None:
        """Export the router's closed loop, index size and requests in flight per worker, read from
        stats() at every scrape."""
        self.registry.register(_RouterCollector(stats))

    def watch_fleet(self, applied: Callable[[], Mapping[str, int]],
                    healthy: Callable[[], Mapping[str, int]]) -> None:
        """Export, read at every scrape: the KV events applied per worker since start (worker -> count)
        and the workers in rotation per pool (pool -> count; 0 is a pool that cannot serve)."""
        self.registry.register(_FleetCollector(applied, healthy))

    def watch_admission(self, pools: Callable[[], Mapping[str, PoolState]],
                        shared_limits: Callable[[], bool | None]) -> None:
        """Export each pool's concurrency limit, requests in flight and queue depth per priority, and
        whether tenant limits are shared through Redis (1) or local (0), read at every scrape."""
        self.registry.register(_AdmissionCollector(pools, shared_limits))
        self.registry.register(_CostCollector(self._cost_by_tenant, self._answered_by_tenant))

    def watch_shared_state(self, shared: Callable[[], Mapping[str, bool] | None]) -> None:
        """Export, with Redis, whether each kind of shared state is shared now (1) or local (0)."""
        self.registry.register(_SharedStateCollector(shared))

    def record_cost(self, tenant: str, cost_usd: float, answered: bool) -> None:
        """A request's cost (every request's tokens count), and whether it was answered."""
        if cost_usd:
            self.child(self.cost, tenant).inc(cost_usd)
        self._cost_by_tenant[tenant] = self._cost_by_tenant.get(tenant, 0.0) + cost_usd
        if answered:
            self._answered_by_tenant[tenant] = self._answered_by_tenant.get(tenant, 0) + 1

    def child(self, metric, *label_values: str):
        """metric.labels(*label_values), remembered: prometheus' own lookup locks and validates each call
        (a loop metric's is a dict lookup too)."""
        key = (metric, label_values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*label_values)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RouterCollector:
    """The router's own counts as metrics, at scrape time (nothing to update per request)."""

    def __init__(self, stats: Callable[[], RouterStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        predicted = CounterMetricFamily("kvgate_router_predicted_cached_tokens",
                                        "Cached tokens the router expected at the chosen worker.", labels=["pool"])
        reported = CounterMetricFamily("kvgate_router_reported_cached_tokens",
                                       "Cached tokens the chosen worker reported.", labels=["pool"])
        confirmed = CounterMetricFamily("kvgate_router_confirmed_cached_tokens",
                                        "min(predicted, reported) cached tokens, summed: over a window, its increase "
                                        "over predicted's is the window's prediction hit ratio.", labels=["pool"])
        for pool, loop in sorted(stats.closed_loop.items()):
            predicted.add_metric([pool], loop.predicted_cached_tokens)
            reported.add_metric([pool], loop.reported_cached_tokens)
            confirmed.add_metric([pool], loop.confirmed_cached_tokens)
        yield predicted
        yield reported
        yield confirmed
        in_flight = GaugeMetricFamily("kvgate_worker_requests_in_flight", "This gateway's requests in flight at "
                                      "each worker (dispatched, not yet finished).", labels=["worker"])
        for worker, count in sorted(stats.in_flight.items()):
            in_flight.add_metric([worker], count)
        yield in_flight
        blocks = GaugeMetricFamily("kvgate_kv_index_blocks", "Confirmed blocks indexed per worker.", labels=["worker"])
        for worker, count in sorted(stats.index.blocks_per_worker.items()):
            blocks.add_metric([worker], count)
        yield blocks
        yield GaugeMetricFamily("kvgate_kv_index_bytes", "Approximate memory of the KV index (both layers).",
                                value=stats.index.approx_bytes)
        lookups = CounterMetricFamily("kvgate_tokenizer_prefix_cache_lookups",
                                      "Prompts the routing tokenizer looked up in its prefix cache: hit (tokenized "
                                      "only from where it differs from a text seen before) or miss (whole).",
                                      labels=["model", "result"])
        for model, (hits, misses) in sorted(stats.tokenizer_prefix_cache.items()):
            lookups.add_metric([model, "hit"], hits)
            lookups.add_metric([model, "miss"], misses)
        yield lookups
        warm_up = GaugeMetricFamily("kvgate_worker_warmup_share", "Share of the new requests the routing policy "
                                    "would give a worker that it takes while it warms up after coming into "
                                    "rotation cold (slow start: ramps to 1 over its pool's slow_start_s).",
                                    labels=["worker"])
        for worker, share in sorted(stats.warm_up.items()):
            warm_up.add_metric([worker], share)
        yield warm_up


class _InFlightCollector:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvgate_requests_in_flight", "Completion requests inside the gateway (queued for "
                                "admission, routed or answering).", value=self._metrics.requests_in_flight)


class _FleetCollector:
    def __init__(self, applied: Callable[[], Mapping[str, int]], healthy: Callable[[], Mapping[str, int]]) -> None:
        self._applied = applied
        self._healthy = healthy

    def collect(self) -> Iterator[Metric]:
        applied = CounterMetricFamily("kvgate_kv_events_applied", "KV events applied to the index, per worker "
                                      "(its subscriber, since it started).", labels=["worker"])
        for worker, count in sorted(self._applied().items()):
            applied.add_metric([worker], count)
        yield applied
        healthy = GaugeMetricFamily("kvgate_pool_healthy_workers", "Workers in rotation per pool.", labels=["pool"])
        for pool, count in sorted(self._healthy().items()):
            healthy.add_metric([pool], count)
        yield healthy


class _AdmissionCollector:
    def __init__(self, pools: Callable[[], Mapping[str, PoolState]], shared_limits: Callable[[], bool | None]) -> None:
        self._pools = pools
        self._shared_limits = shared_limits

    def collect(self) -> Iterator[Metric]:
        limit = GaugeMetricFamily("kvgate_concurrency_limit", "A pool's adaptive concurrency limit.", labels=["pool"])
        in_flight = GaugeMetricFamily("kvgate_admitted_in_flight", "Admitted requests in flight, per pool.",
                                      labels=["pool"])
        depth = GaugeMetricFamily("kvgate_queue_depth", "Requests queued for admission.", labels=["pool", "priority"])
        for pool, state in sorted(self._pools().items()):
            limit.add_metric([pool], state.limit)
            in_flight.add_metric([pool], state.in_flight)
            for priority, queued in state.queued.items():
                depth.add_metric([pool, priority.label], queued)
        yield from (limit, in_flight, depth)
        shared = self._shared_limits()
        if shared is not None:
            yield GaugeMetricFamily("kvgate_tenant_limits_shared", "1 while tenant limits are kept in Redis, 0 while "
                                    "each replica keeps its share locally (Redis unreachable).", value=int(shared))


class _CostCollector:
    def __init__(self, cost: Mapping[str, float], answered: Mapping[str, int]) -> None:
        self._cost = cost
        self._answered = answered

    def collect(self) -> Iterator[Metric]:
        per_answer = GaugeMetricFamily("kvgate_cost_per_successful_request", "USD spent per answered request "
                                       "(failed requests' tokens count too).", labels=["tenant"])
        for tenant, cost in sorted(self._cost.items()):
            answered = self._answered.get(tenant, 0)
            per_answer.add_metric([tenant], cost / answered if answered else math.nan)
        yield per_answer


class _SharedStateCollector:
    def __init__(self, shared: Callable[[], Mapping[str, bool] | None]) -> None:
        self._shared = shared

    def collect(self) -> Iterator[Metric]:
        parts = self._shared()
        if parts is None:
            return
        gauge = GaugeMetricFamily("kvgate_shared_state", "With Redis: 1 while this kind of state is shared with the "
                                  "other replicas, 0 while this replica runs on its own (Redis unreachable).",
                                  labels=["part"])
        for part, shared in sorted(parts.items()):
            gauge.add_metric([part], int(shared))
        yield gauge


def _version() -> str:
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
