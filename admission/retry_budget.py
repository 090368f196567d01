"""Retry budget: retries may be at most `ratio` of requests plus a small floor per second.

A sick fleet then sees at most (1 + ratio) x the offered load instead of a retry storm
(the same idea as Finagle's RetryBudget and gRPC's retry throttling). Counts live in a sliding
window of one-second buckets; time is injected.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class RetryBudgetConfig:
    ratio: float = 0.1
    min_retries_per_s: float = 1.0
    window_s: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError("retry_budget.ratio must be in (0, 1]")
        if self.min_retries_per_s < 0:
            raise ValueError("retry_budget.min_retries_per_s must be >= 0")
        if self.window_s < 1:
            raise ValueError("retry_budget.window_s must be >= 1")


class RetryBudget:
    """`record_request()` for every first attempt; `try_spend()` before every retry."""

    def __init__(self, config: RetryBudgetConfig = RetryBudgetConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, requests, retries]
        self.refused = 0

    def _current(self) -> list[int]:
        now = int(self._clock())
        while self._buckets and self._buckets[0][0] <= now - self.config.window_s:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append([now, 0, 0])
        return self._buckets[-1]

    def record_request(self) -> None:
        self._current()[1] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and counted as refused) when it is spent."""
        bucket = self._current()
        requests = sum(b[1] for b in self._buckets)
        retries = sum(b[2] for b in self._buckets)
        allowed = self.config.ratio * requests + self.config.min_retries_per_s * self.config.window_s
        if retries + 1 > allowed:
            self.refused += 1
            return False
        bucket[2] += 1
        return True
