"""Retry budget: retries may be at most `ratio` of requests plus a small floor per second.

A sick fleet then sees at most (1 + ratio) x the offered load instead of a retry storm
(the same idea as Finagle's RetryBudget and gRPC's retry throttling). Counts live in a sliding
window of one-second buckets (RetryWindow); time is injected. admission/shared_retry_budget.py
holds one budget across gateway replicas with the same arithmetic.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
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

    def allowed_retries(self, requests: float) -> float:
        """Retries a window holding `requests` first attempts allows: ratio x requests + the floor over the window."""
        return self.ratio * requests + self.min_retries_per_s * self.window_s

    def floor_scaled(self, share: float) -> RetryBudgetConfig:
        """The same budget with its floor times share (one replica's part of a fleet's floor)."""
        return replace(self, min_retries_per_s=self.min_retries_per_s * share)


class RetryWindow:
    """Requests and retries counted per second over the last window_s seconds of the clock."""

    def __init__(self, window_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, requests, retries], oldest first

    def add(self, requests: int = 0, retries: int = 0) -> None:
        bucket = self._current()
        bucket[1] += requests
        bucket[2] += retries

    def totals(self) -> tuple[int, int]:
        """(requests, retries) in the window."""
        self._current()
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def _current(self) -> list[int]:
        now = int(self._clock())
        while self._buckets and self._buckets[0][0] <= now - self._window_s:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append([now, 0, 0])
        return self._buckets[-1]


class RetryBudget:
    """`record_request()` for every first attempt; `try_spend()` before every retry."""

    def __init__(self, config: RetryBudgetConfig = RetryBudgetConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._window = RetryWindow(config.window_s, clock)
        self.refused = 0

    def record_request(self) -> None:
        self._window.add(requests=1)

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and counted as refused) when it is spent."""
        requests, retries = self._window.totals()
        if retries + 1 > self.config.allowed_retries(requests):
            self.refused += 1
            return False
        self._window.add(retries=1)
        return True

    def record_retry(self) -> None:
        """A retry another budget granted (a shared one): it counts in this window without a check."""
        self._window.add(retries=1)
