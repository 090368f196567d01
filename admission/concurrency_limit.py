"""The adaptive concurrency limit of a pool: how many admitted requests may be at its workers at once.

AIMD after Netflix concurrency-limits (`AIMDLimit`), on the one latency a pool's load moves: the
time a request waited at the worker beyond its own prefill (time to first token minus the router's
estimate of computing its own uncached prompt; `queue_delay_s`). Samples are judged together, a
window of decrease_interval_s at a time (single samples are noisy: a request arriving just after
an engine step began waits for it), as TCP judges a round trip: when the window's median is within
the target and nothing was dropped, the limit grows by one if at least half of it was in use; when
the median is over the target, it is cut by target / median, at least backoff_ratio and at most
max_cut (by default both backoff_ratio, 0.9: gentle steps, so the requests in flight above a cut limit drain in a
moment and the queue never stalls for long); a request the worker refused or dropped cuts it by
backoff_ratio. Only requests admitted since the last cut count: the others report on the limit
before it, and counting them would cut again and again for one congested moment. The limit stays in
[min_limit, max_limit]; max_limit is what the pool's workers can run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LimitConfig:
    max_limit: int
    min_limit: int = 1
    initial_limit: int | None = None  # default: a quarter of max_limit (at least min_limit)
    queue_delay_target_s: float = 0.5
    backoff_ratio: float = 0.9
    max_cut: float | None = None  # the deepest one window can cut the limit to (times it); None: backoff_ratio
    decrease_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError("limits must satisfy 1 <= min_limit <= max_limit")
        if self.initial_limit is not None and not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("initial_limit must be in [min_limit, max_limit]")
        if self.queue_delay_target_s <= 0 or self.decrease_interval_s < 0:
            raise ValueError("queue_delay_target_s must be > 0 and decrease_interval_s >= 0")
        if not 0.5 <= (self.max_cut or self.backoff_ratio) <= self.backoff_ratio < 1:
            raise ValueError("must hold: 0.5 <= max_cut <= backoff_ratio < 1")


class AimdLimit:
    """The current limit (a float; callers use int(limit)) moved by each window of samples."""

    def __init__(self, config: LimitConfig) -> None:
        self.config = config
        initial = config.initial_limit or max(config.min_limit, config.max_limit // 4)
        self.limit = float(initial)
        self._window_start_s: float | None = None
        self._delays: list[float] = []
        self._busy_samples = 0
        self._dropped = False
        self._last_cut_s: float | None = None

    def resize(self, config: LimitConfig) -> None:
        """New bounds (a pool's workers joined or left): the limit keeps its place between them, scaled
        by the ratio of the new max_limit to the old."""
        scaled = self.limit * config.max_limit / self.config.max_limit
        self.config = config
        self.limit = min(float(config.max_limit), max(float(config.min_limit), scaled))

    def on_sample(self, now_s: float, queue_delay_s: float | None, in_flight: int, dropped: bool = False,
                  admitted_s: float | None = None) -> None:
        """One request's outcome: its queueing delay at the worker (None when it never got a first
        token), the requests in flight when it ended, whether the worker refused or dropped it, and
        when it was admitted. A request admitted before the last cut tells of the limit before it
        and is not counted (as TCP reduces its window once per round trip, not once per loss)."""
        if self._window_start_s is None:
            self._window_start_s = now_s
        if admitted_s is not None and self._last_cut_s is not None and admitted_s < self._last_cut_s:
            return
        if queue_delay_s is not None:
            self._delays.append(queue_delay_s)
            if in_flight * 2 >= self.limit:
                self._busy_samples += 1
        self._dropped = self._dropped or dropped
        if now_s - self._window_start_s >= self.config.decrease_interval_s:
            self._close_window(now_s)

    def _close_window(self, now_s: float) -> None:
        config = self.config
        median_s = statistics.median(self._delays) if self._delays else None
        if median_s is not None and median_s > config.queue_delay_target_s:
            self.limit *= min(config.backoff_ratio, max(config.max_cut or config.backoff_ratio, config.queue_delay_target_s / median_s))
            self._last_cut_s = now_s
        elif self._dropped:
            self.limit *= config.backoff_ratio
            self._last_cut_s = now_s
        elif self._busy_samples:
            self.limit += 1
        self.limit = min(float(config.max_limit), max(float(config.min_limit), self.limit))
        self._window_start_s, self._delays, self._busy_samples, self._dropped = now_s, [], 0, False
