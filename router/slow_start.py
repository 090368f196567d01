"""Slow start: a worker that comes into rotation cold gets a share of new requests that ramps up over its
pool's slow_start_s, on top of whatever the routing policy chose, as Envoy's slow start does.

A cold worker (registered while the gateway runs, restarted, or back after its health checks or breaker took
it out) has an empty KV cache and cold allocator and kernels: given its full share at once (and a load-aware
policy sends an idle worker more than its share) its first requests queue behind prefills nobody else would
pay. Its share ramps from MIN_SHARE to 1 over the window, as the square of the time gone (Envoy's slow start
with aggression 0.5): when the policy ranks a warming worker first, the request stays there with probability
share, and otherwise goes to the best-ranked worker that takes it (a warm one, or a warming one that draws
its own share). Squared, the share stays near MIN_SHARE for the first third of the window, so a worker just
back takes about a tenth of what the policy would give it while its cache fills, under half its steady share
in a pool of up to five even if the policy ranked it first every time. A request of which the worker holds
more (cached or predicted blocks) than any other candidate is never held back: its prefix is worth more than
its coldness (a prefix every worker holds, such as a chat template's first block, is not). Nor is one whose
candidates are all warming (a pool started together, or every other worker out): someone must serve it.

Pure logic: the clock and the random draws are injected.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

MIN_SHARE = 0.1  # a worker just back takes a tenth of what the policy would give it (Envoy's min_weight_percent)


class SlowStart:
    """Warming workers and their shares; windows: pool -> slow_start_s (0 or absent: no slow start)."""

    def __init__(self, windows: Mapping[str, float] | None = None, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self._windows = dict(windows or {})
        self._clock = clock
        self._rng = rng or random.Random()
        self._started: dict[str, tuple[float, float]] = {}  # worker -> (when it began, its window)

    def begin(self, worker_id: str, pool: str) -> None:
        """worker_id came into rotation cold: its share ramps up from now (nothing without a window)."""
        window_s = self._windows.get(pool, 0.0)
        if window_s > 0:
            self._started[worker_id] = (self._clock(), window_s)

    def forget(self, worker_id: str) -> None:
        self._started.pop(worker_id, None)

    def share(self, worker_id: str) -> float | None:
        """The warming worker's share of what the policy would give it now, in [MIN_SHARE, 1); None once warm."""
        started = self._started.get(worker_id)
        if started is None:
            return None
        began_s, window_s = started
        ramp = (self._clock() - began_s) / window_s
        if ramp >= 1.0:
            del self._started[worker_id]
            return None
        return max(MIN_SHARE, ramp * ramp)

    def shares(self) -> dict[str, float]:
        """Every warming worker's share now (for metrics and /ready)."""
        return {worker: share for worker in list(self._started) if (share := self.share(worker)) is not None}

    def rank(self, ranked: Sequence[str], cached_blocks: Callable[[str], int]) -> tuple[Sequence[str], str | None]:
        """ranked with the worker that takes the request first, and the warming worker held back (or None).
        cached_blocks(worker): how many of the prompt's blocks the worker holds (or is predicted to)."""
        if not self._started:  # nobody warming: the hot path
            return ranked, None
        first = ranked[0]
        share = self.share(first)
        if share is None or self._rng.random() < share:
            return ranked, None
        if all(self.share(w) is not None for w in ranked):  # every candidate is warming
            return ranked, None
        if cached_blocks(first) > max(cached_blocks(w) for w in ranked[1:]):  # it alone holds that much
            return ranked, None
        for i, worker in enumerate(ranked[1:], start=1):
            other = self.share(worker)
            if other is None or self._rng.random() < other:
                return (worker, *ranked[:i], *ranked[i + 1:]), first
        return ranked, None
