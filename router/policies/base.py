"""Helpers every policy shares: parameter checks, the bounded-load limit and plain explanations."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from router.types import Candidate, WorkerView


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """Raise ValueError('name: ...') unless value is a number in range (an int when integer)."""
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{name}: must be {'an integer' if integer else 'a number'}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: must be <= {maximum}, got {value!r}")
    if above is not None and value <= above:
        raise ValueError(f"{name}: must be > {above}, got {value!r}")


def check_str(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty string, got {value!r}")


def load_bound(total_requests: int, num_workers: int, slack: float) -> int:
    """Bounded-load capacity: ceil((1 + slack) * (total + 1) / n), counting the new request.

    From Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (2018).
    A worker is over the bound when its requests + 1 would exceed it.
    """
    return math.ceil((1 + slack) * (total_requests + 1) / num_workers)


def over_bound(workers: Sequence[WorkerView], slack: float) -> list[bool]:
    """For each worker: would one more request put it above the bounded-load capacity?"""
    loads = [w.load.num_requests for w in workers]
    bound = load_bound(sum(loads), len(workers), slack)
    return [load + 1 > bound for load in loads]


def explain(workers: Sequence[WorkerView], top_k: int = 4, note: str | None = None) -> tuple[Candidate, ...]:
    """Plain candidates (cached blocks, request count) for the first top_k ranked workers."""
    return tuple(
        Candidate(w.worker_id, w.cached_blocks, w.load.num_requests, None, note) for w in workers[:top_k]
    )
