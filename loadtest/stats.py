"""Percentiles of measured samples, one rule for every report and benchmark."""

from __future__ import annotations

from collections.abc import Iterable


def percentile(samples: Iterable[float], q: float) -> float:
    """The sample at index floor(q * n) of the n sorted samples, capped at the last one: always an
    observed value, never interpolated (p50 of an even count is the upper middle sample)."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("percentile of no samples")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
