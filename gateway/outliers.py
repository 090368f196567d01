"""Slow-worker ejection: a worker that is slow for the work it gets, against its peers, is taken
out of rotation for a while (the idea of Envoy's outlier detection, applied to time to first token).

Raw time to first token would eject the worker a KV-aware router rightly gave the long cold
prompts (and with it the prefixes it holds). So each request is judged against what the router
expected for the work it waited for (its uncached prompt plus the prefill queued ahead of it, at
the pool's median prefill rate; Router.on_first_token):

    slowness = (time to first token + base_latency_s) / (expected + base_latency_s)

base_latency_s (a few engine steps) is what a request with next to nothing to compute still
waits; added to both sides it keeps such requests near 1 instead of far above or below it, so a
worker serving cache hits and one serving cold prompts both read about 1 when healthy. Per worker
an EWMA of slowness; a worker with at least min_samples whose EWMA exceeds ratio x the median of
its peers' is ejected for ejection_s, then readmitted with a fresh EWMA. One detector per pool
(peers are the pool's workers); at most max_ejected_fraction of a pool is ejected at once, and never
its last worker in rotation (the caller says whether another would take its requests).

One observation counts for at most 2 x ratio: the expectation is a linear model, and a single
very long prompt (attention grows with its square) can take 10x what it predicts on a healthy
worker. Capped, it moves the EWMA only part of the way; a worker is ejected for being slow on
several requests in a row (three far-off ones with the defaults), not for one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from kvgate.config import OutlierConfig


@dataclass(slots=True)
class _Stats:
    slowness: float = 0.0
    samples: int = 0
    ejected_until: float | None = None


class OutlierDetector:
    def __init__(self, config: OutlierConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._stats: dict[str, _Stats] = {}

    def add_worker(self, worker_id: str) -> None:
        self._stats.setdefault(worker_id, _Stats())

    def remove_worker(self, worker_id: str) -> None:
        self._stats.pop(worker_id, None)

    def is_ejected(self, worker_id: str) -> bool:
        stats = self._stats.get(worker_id)
        if stats is None or stats.ejected_until is None:
            return False
        if self._clock() >= stats.ejected_until:
            self._stats[worker_id] = _Stats()  # readmitted with a clean slate
            return False
        return True

    def observe(self, worker_id: str, first_token_s: float, expected_s: float,
                may_eject: Callable[[], bool] = lambda: True) -> bool:
        """Record one request's time to first token and the router's expectation for it; returns
        True if this observation ejected the worker (never while may_eject() is False: asked only
        when the worker is slow enough to be ejected)."""
        base = self.config.base_latency_s
        slowness = min((first_token_s + base) / (expected_s + base), 2 * self.config.ratio)
        stats = self._stats.setdefault(worker_id, _Stats())
        alpha = self.config.ewma_alpha
        stats.slowness = slowness if stats.samples == 0 else (1 - alpha) * stats.slowness + alpha * slowness
        stats.samples += 1
        if stats.ejected_until is not None or stats.samples < self.config.min_samples:
            return False
        peers = [s.slowness for w, s in self._stats.items()
                 if w != worker_id and s.samples >= self.config.min_samples and s.ejected_until is None]
        if not peers or stats.slowness <= self.config.ratio * statistics.median(peers) or not self._may_eject() \
                or not may_eject():
            return False
        stats.ejected_until = self._clock() + self.config.ejection_s
        return True

    def _may_eject(self) -> bool:
        ejected = sum(1 for w in self._stats if self.is_ejected(w))
        return ejected + 1 <= self.config.max_ejected_fraction * len(self._stats)
