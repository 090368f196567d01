"""The workers behind the gateway: who is in rotation, and the background work that keeps it true.

A worker is in rotation when its health checks pass, its breaker is not open (or a half-open
trial is due) and it is not ejected as a slow outlier. A failed worker (health checks failing or
breaker open) has its KV-index entries dropped at once: its cache is unknown from then on. An
ejected one keeps them: it is alive, its KV events keep them true, and when it rejoins the
prefixes it holds draw their requests back instead of being computed again elsewhere. The fleet
also runs each worker's KV-event subscriber and scrapes its /metrics for the router's load view.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from gateway.breakers import OPEN, STATE_VALUES, WorkerBreaker
from gateway.metrics import GatewayMetrics
from gateway.outliers import OutlierDetector
from gateway.upstream_http import UpstreamClient
from kvgate.config import KvgateConfig, WorkerConfig
from kvgate.kv_endpoints import replay_endpoint
from kvgate.tasks import stop_tasks
from router.router import Router
from router.subscriber import KvEventSubscriber
from router.types import WorkerSpec

log = logging.getLogger("kvgate.gateway")

_SCRAPED = {"vllm:num_requests_waiting": "waiting_requests", "vllm:num_requests_running": "running_requests",
            "vllm:kv_cache_usage_perc": "kv_usage_frac"}
_CACHE_CONFIG = "vllm:cache_config_info"
_SCRAPED_PREFIXES = (*_SCRAPED, _CACHE_CONFIG)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class Worker:
    """One worker's runtime state in this gateway."""

    worker_id: str
    pool: str
    url: str
    config: WorkerConfig
    breaker: WorkerBreaker
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    in_rotation: bool = True
    failed: bool = False  # health checks failing or breaker open
    answered: bool = False  # has passed a health check since the gateway started
    has_left_rotation: bool = False  # was in rotation and left it since the gateway started (a return is a rejoin)
    cold: bool = False  # its next entry into rotation starts a warm-up (registered while running, or it failed)
    subscriber: KvEventSubscriber | None = field(default=None, repr=False)


class Fleet:
    def __init__(self, config: KvgateConfig, router: Router, metrics: GatewayMetrics,
                 http: UpstreamClient | None, clock=time.monotonic) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.outliers = {name: OutlierDetector(config.outliers, clock=clock) for name in config.pools}  # per pool
        self._http = http
        self._tasks: list[asyncio.Task] = []
        self.workers: dict[str, Worker] = {}
        self.on_breaker_change: Callable[[str, str], None] | None = None  # (worker, new state): told to peers
        for pool_name, pool in config.pools.items():
            for wc in pool.workers:
                self._add(pool_name, wc)  # the router has the configured workers from its construction

    def _add(self, pool_name: str, wc: WorkerConfig) -> Worker:
        breaker = WorkerBreaker(wc.name, self.config.breaker.fail_max, self.config.breaker.reset_timeout_s,
                                on_change=self._on_breaker_change)
        worker = self.workers[wc.name] = Worker(wc.name, pool_name, wc.url.rstrip("/"), wc, breaker)
        self.outliers[pool_name].add_worker(wc.name)
        self.metrics.breaker_state.labels(worker=wc.name).set(0)
        self.metrics.worker_healthy.labels(worker=wc.name).set(1)
        self.metrics.ejections.labels(worker=wc.name)
        return worker

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        for worker in self.workers.values():
            self._subscribe(worker)
        await self.check_all(initial=True)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health-checks"))

    async def stop(self) -> None:
        await stop_tasks(self._tasks)
        for worker in self.workers.values():
            if worker.subscriber is not None:
                await worker.subscriber.stop()

    def _subscribe(self, worker: Worker) -> None:
        endpoint = worker.config.kv_events_endpoint
        if endpoint:
            worker.subscriber = self.router.kv_event_subscriber(worker.worker_id, endpoint, replay_endpoint(endpoint))
            worker.subscriber.start()

    # -- membership (workers that register and leave while the gateway runs) -------------------

    async def add_worker(self, pool_name: str, wc: WorkerConfig, spec: WorkerSpec) -> None:
        """A worker joins pool_name: follow its KV events, check its health once now (it is in rotation
        when that passes), then keep checking it with the others."""
        if wc.name in self.workers:
            raise ValueError(f"worker {wc.name!r} is already in the fleet")
        worker = self._add(pool_name, wc)
        self.router.worker_joined(pool_name, spec)
        self.router.start_warm_up(wc.name)  # a worker new to the pool starts cold: its share ramps up
        self._subscribe(worker)
        await self._check(worker, initial=True)
        log.info("worker %s joined pool %s at %s", wc.name, pool_name, worker.url)

    async def remove_worker(self, worker_id: str) -> None:
        """A worker leaves: out of rotation at once, its KV-index entries, load and series gone.
        Attempts in flight on it end as they would (their outcome no longer judges it)."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self.router.worker_left(worker_id)
        self.outliers[worker.pool].remove_worker(worker_id)
        for metric in (self.metrics.breaker_state, self.metrics.worker_healthy, self.metrics.ejections):
            try:
                metric.remove(worker_id)
            except KeyError:
                pass
        if worker.subscriber is not None:
            await worker.subscriber.stop()
        log.info("worker %s left pool %s", worker_id, worker.pool)

    # -- rotation ----------------------------------------------------------------------------

    def available(self, worker_id: str) -> bool:
        """May an attempt go to this worker now?"""
        worker = self.workers.get(worker_id)
        return (worker is not None and worker.healthy and worker.breaker.available()
                and not self.outliers[worker.pool].is_ejected(worker_id))

    def _others_in_rotation(self, worker: Worker) -> bool:
        """Whether another worker of its pool would take its requests (a pool's last one is never ejected)."""
        return any(w.pool == worker.pool and w is not worker and self.available(w.worker_id)
                   for w in self.workers.values())

    def warming(self) -> dict[str, dict[str, float]]:
        """pool -> {worker: its share of new requests} for the workers still warming up (slow start)."""
        warming: dict[str, dict[str, float]] = {}
        for worker_id, share in self.router.warm_up_shares().items():
            worker = self.workers.get(worker_id)
            if worker is not None and worker.in_rotation:
                warming.setdefault(worker.pool, {})[worker_id] = round(share, 3)
        return warming

    def pools_without_workers(self) -> list[str]:
        """Configured pools with no worker in rotation (none healthy, or none registered yet)."""
        return sorted(p for p in self.config.pools if not any(w.pool == p and self.available(w.worker_id)
                                                              for w in self.workers.values()))

    def _refresh_rotation(self, worker: Worker) -> None:
        failed = not worker.healthy or worker.breaker.state == OPEN
        if failed and not worker.failed:
            self.router.worker_failed(worker.worker_id)  # its cache is unknown from here on
            worker.cold = True  # restarted or not, it comes back to slow start
        worker.failed = failed
        in_rotation = self.available(worker.worker_id)
        if in_rotation == worker.in_rotation:
            return
        worker.in_rotation = in_rotation
        self.router.set_in_rotation(worker.worker_id, in_rotation)
        self.metrics.worker_healthy.labels(worker=worker.worker_id).set(1 if in_rotation else 0)
        if not in_rotation and not worker.answered:  # e.g. started together with the gateway, still loading
            log.info("worker %s not in rotation yet: waiting for its first health check to pass", worker.worker_id)
        elif not in_rotation:
            worker.has_left_rotation = True
            log.warning("worker %s left rotation (healthy=%s breaker=%s ejected=%s)", worker.worker_id,
                        worker.healthy, worker.breaker.state, self.outliers[worker.pool].is_ejected(worker.worker_id))
        else:
            log.info("worker %s %s rotation", worker.worker_id, "rejoined" if worker.has_left_rotation else "joined")
            if worker.cold:
                worker.cold = False
                self.router.start_warm_up(worker.worker_id)

    def _on_breaker_change(self, worker_id: str, old: str, new: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        self.metrics.breaker_state.labels(worker=worker_id).set(STATE_VALUES.get(new, 0))
        log.warning("worker %s breaker %s -> %s", worker_id, old, new)
        self._refresh_rotation(worker)
        if self.on_breaker_change is not None and not worker.breaker.applying_peer_state:
            self.on_breaker_change(worker_id, new)

    def peer_breaker_change(self, worker_id: str, state: str) -> None:
        """Another gateway replica's breaker for worker_id went to state (open or closed): follow it."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.breaker.follow_peer(state)

    def record_attempt(self, worker_id: str, ok: bool, first_byte_s: float | None = None,
                       expected_first_byte_s: float | None = None) -> None:
        """Outcome of one upstream attempt: feeds the breaker and slow-worker ejection (time to
        first token against the router's expectation for it, when both are known)."""
        worker = self.workers.get(worker_id)
        if worker is None:  # it left the fleet while the attempt ran
            return
        self.metrics.child(self.metrics.attempts, worker_id, "ok" if ok else "error").inc()
        if ok:
            worker.breaker.record_success()
            if first_byte_s is not None and expected_first_byte_s is not None and self.config.outliers.enabled \
                    and self.outliers[worker.pool].observe(worker_id, first_byte_s, expected_first_byte_s,
                                                           may_eject=lambda: self._others_in_rotation(worker)):
                self.metrics.ejections.labels(worker=worker_id).inc()
        else:
            worker.breaker.record_failure()
        self._refresh_rotation(worker)

    # -- health checks -----------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(w) for w in self.workers.values()), return_exceptions=True)
            await asyncio.sleep(self.config.health.interval_s)

    async def check_all(self, initial: bool = False) -> None:
        """One round of health checks now; the initial round sets each worker's state outright."""
        await asyncio.gather(*(self._check(w, initial) for w in self.workers.values()), return_exceptions=True)

    async def _check(self, worker: Worker, initial: bool = False) -> None:
        cfg = self.config.health
        try:
            status, _ = await self._http.get(f"{worker.url}/health", cfg.timeout_s)
            ok = status == 200
        except (httpx.HTTPError, TimeoutError):
            ok = False
        if initial:
            worker.healthy = ok
        if ok:
            worker.answered = True
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            if not worker.healthy and worker.consecutive_successes >= cfg.healthy_threshold:
                worker.healthy = True
        else:
            worker.consecutive_successes = 0
            worker.consecutive_failures += 1
            if worker.healthy and worker.consecutive_failures >= cfg.unhealthy_threshold:
                worker.healthy = False
        if self.workers.get(worker.worker_id) is not worker:  # it left the fleet during the check
            return
        self._refresh_rotation(worker)
        if ok:
            cache = await self._scrape(worker) if cfg.scrape_metrics else {}
            self.router.worker_cache_config(worker.worker_id, **cache)

    async def _scrape(self, worker: Worker) -> dict:
        """Feeds the worker's scraped load to the router; returns what it says of its KV cache."""
        try:
            status, page = await self._http.get(f"{worker.url}/metrics", self.config.health.timeout_s)
            values = parse_vllm_load(page.decode("utf-8", "replace")) if status == 200 else {}
        except (httpx.HTTPError, TimeoutError, ValueError):
            return {}
        if self.workers.get(worker.worker_id) is not worker:
            return {}
        cache = {key: values.pop(key) for key in ("num_blocks", "block_size") if key in values}
        if values:
            self.router.worker_load_scraped(worker.worker_id, **values)
        return cache

    def healthy_per_pool(self) -> dict[str, int]:
        """Workers in rotation in each pool (every configured pool named, 0 when none serves)."""
        counts = dict.fromkeys(self.outliers, 0)
        for worker in self.workers.values():
            counts[worker.pool] = counts.get(worker.pool, 0) + worker.in_rotation
        return counts

    def kv_events_applied(self) -> dict[str, int]:
        """KV events each subscribed worker's subscriber has applied since it started."""
        return {w.worker_id: w.subscriber.counters.events_applied
                for w in self.workers.values() if w.subscriber is not None}


def _sample_lines(text: str, name: str) -> Iterator[str]:
    """The lines of a metrics page that are samples of the family `name` (the name at a line's start, then
    its labels or a space: not a longer name that starts with it, nor a comment that mentions it)."""
    start, size = 0, len(name)
    while (found := text.find(name, start)) >= 0:
        end = text.find("\n", found)
        end = len(text) if end < 0 else end
        if (found == 0 or text[found - 1] == "\n") and text[found + size:found + size + 1] in ("{", " ", "\t"):
            yield text[found:end]
        start = end


def parse_vllm_load(text: str) -> dict:
    """waiting/running requests and KV usage from a vLLM-style /metrics page (summed over engines),
    and the KV cache's num_blocks and block_size (vllm:cache_config_info's num_gpu_blocks and
    block_size) where they are given, alike for every engine on the page.

    Reads only the sample lines of those four families, found by searching the page for their names:
    vLLM's page is ~600 lines of histograms, which a full exposition parser takes ~8 ms of the event
    loop to read (each worker, each scrape), and splitting it into lines to look at each 140 us (this: 85).
    ValueError for a value that is not a number."""
    totals: dict[str, float] = {}
    config_labels: dict[str, set[str]] = {"num_blocks": set(), "block_size": set()}
    for name in _SCRAPED_PREFIXES:
        for line in _sample_lines(text, name):
            brace = line.find("{")
            if name == _CACHE_CONFIG:
                labels = dict(_LABEL.findall(line[brace:line.rfind("}")])) if brace >= 0 else {}
                for label, key in (("num_gpu_blocks", "num_blocks"), ("block_size", "block_size")):
                    config_labels[key].add(labels.get(label, ""))
            else:
                rest = line[line.rfind("}") + 1:] if brace >= 0 else line[len(name):]
                value = float(rest.split()[0])
                if math.isfinite(value):  # NaN or Inf: no reading
                    totals[name] = totals.get(name, 0.0) + value
    values: dict = {}
    for name, key in _SCRAPED.items():
        if name in totals:
            total = totals[name]
            values[key] = min(max(total, 0.0), 1.0) if key == "kv_usage_frac" else int(total)
    for key, found in config_labels.items():
        if len(found) == 1 and (number := next(iter(found))).isdigit() and int(number) > 0:
            values[key] = int(number)
    return values
