"""Gateway metrics (prefix `kvgate_`), one registry per app; no API key ever becomes a label."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.router import RouterStats

disable_created_metrics()  # no `_created` series beside every counter: scrape noise no dashboard reads

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.5)
_DECISION_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvgate_requests", "Requests by tenant, model and final HTTP status.",
                                ["tenant", "model", "status"], registry=r)
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "Client-side time to first token.",
                              ["model"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("kvgate_inter_token_latency_seconds", "Time between streamed chunks.", ["model"],
                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvgate_e2e_request_latency_seconds", "End-to-end request latency.", ["model"],
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.attempts = Counter("kvgate_upstream_attempts", "Upstream attempts by worker and outcome.",
                                ["worker", "outcome"], registry=r)
        self.retries = Counter("kvgate_upstream_retries", "Retries on another worker.", ["pool"], registry=r)
        self.budget_refusals = Counter("kvgate_retry_budget_refusals", "Retries refused by the retry budget.",
                                       ["pool"], registry=r)
        self.failovers = Counter("kvgate_failovers", "Streams continued on another worker mid-answer.", ["pool"],
                                 registry=r)
        self.breaker_state = Gauge("kvgate_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                   ["worker"], registry=r)
        self.worker_healthy = Gauge("kvgate_worker_healthy", "1 if the worker is in rotation.", ["worker"],
                                    registry=r)
        self.ejections = Counter("kvgate_worker_ejections", "Slow-worker ejections.", ["worker"], registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens (from upstream usage).",
                                     ["tenant", "model"], registry=r)
        self.completion_tokens = Counter("kvgate_completion_tokens", "Completion tokens (from upstream usage).",
                                         ["tenant", "model"], registry=r)
        self.cached_tokens = Counter("kvgate_cached_tokens", "Prompt tokens served from a worker's prefix cache.",
                                     ["tenant", "model"], registry=r)
        self.decision_seconds = Histogram("kvgate_routing_decision_seconds",
                                          "Tokenize + key + match + score time per request.",
                                          buckets=_DECISION_BUCKETS_S, registry=r)
        self.kv_events = Gauge("kvgate_kv_events_applied", "KV events applied per worker (subscriber).",
                               ["worker"], registry=r)
        self.policy_reloads = Counter("kvgate_policy_reloads", "Routing-policy file reloads, by outcome.",
                                      ["outcome"], registry=r)

        self._children: dict[tuple, object] = {}

    def start_series(self, pools: Iterable[str], workers: Iterable[str]) -> None:
        """Create the per-pool and per-worker counters at 0, so a dashboard shows 0 (not "no data")
        until the first retry, failover or ejection."""
        for pool in pools:
            for counter in (self.retries, self.budget_refusals, self.failovers):
                counter.labels(pool=pool)
        for worker in workers:
            self.ejections.labels(worker=worker)
        for outcome in ("ok", "error"):
            self.policy_reloads.labels(outcome=outcome)

    def watch_router(self, stats: Callable[[], RouterStats]) -> None:
        """Export the router's closed loop and index size, read from stats() at every scrape."""
        self.registry.register(_RouterCollector(stats))

    def child(self, metric, *label_values: str):
        """metric.labels(*label_values), remembered: prometheus' own lookup locks and validates each call."""
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
        for pool, loop in sorted(stats.closed_loop.items()):
            predicted.add_metric([pool], loop.predicted_cached_tokens)
            reported.add_metric([pool], loop.reported_cached_tokens)
        yield predicted
        yield reported
        ratio = stats.prediction_hit_ratio  # NaN until the router has predicted a cached token
        yield GaugeMetricFamily("kvgate_router_prediction_hit_ratio",
                                "sum(min(predicted, reported)) / sum(predicted) cached tokens.",
                                value=math.nan if ratio is None else ratio)
        blocks = GaugeMetricFamily("kvgate_kv_index_blocks", "Confirmed blocks indexed per worker.", labels=["worker"])
        for worker, count in sorted(stats.index.blocks_per_worker.items()):
            blocks.add_metric([worker], count)
        yield blocks
        yield GaugeMetricFamily("kvgate_kv_index_bytes", "Approximate memory of the KV index (both layers).",
                                value=stats.index.approx_bytes)
