"""Slow-worker ejection: a worker whose latency is an outlier against its peers is taken out
of rotation for a while (the idea of Envoy's outlier detection, applied to time to first byte).

Latency is an EWMA of time-to-first-byte per request. A worker with at least min_samples whose
EWMA exceeds ratio x the median of the others (and min_latency_s) is ejected for ejection_s,
then readmitted with a fresh EWMA. At most max_ejected_fraction of a pool is ejected at once.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from kvgate.config import OutlierConfig


@dataclass(slots=True)
class _Stats:
    ewma_s: float = 0.0
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

    def observe(self, worker_id: str, first_byte_s: float) -> bool:
        """Record one latency; returns True if this observation ejected the worker."""
        stats = self._stats.setdefault(worker_id, _Stats())
        alpha = self.config.ewma_alpha
        stats.ewma_s = first_byte_s if stats.samples == 0 else (1 - alpha) * stats.ewma_s + alpha * first_byte_s
        stats.samples += 1
        if stats.ejected_until is not None or stats.samples < self.config.min_samples:
            return False
        peers = [s.ewma_s for w, s in self._stats.items()
                 if w != worker_id and s.samples >= self.config.min_samples and s.ejected_until is None]
        if not peers:
            return False
        threshold = max(self.config.ratio * statistics.median(peers), self.config.min_latency_s)
        if stats.ewma_s <= threshold or not self._may_eject():
            return False
        stats.ejected_until = self._clock() + self.config.ejection_s
        return True

    def _may_eject(self) -> bool:
        ejected = sum(1 for w in self._stats if self.is_ejected(w))
        return ejected + 1 <= self.config.max_ejected_fraction * len(self._stats)
