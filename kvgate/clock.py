"""A manual clock: the injected `clock` for tests and benchmarks, moved by hand instead of sleeping."""

from __future__ import annotations


class ManualClock:
    """Callable like time.monotonic; returns now_s, which only advance() (or an assignment) moves."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
