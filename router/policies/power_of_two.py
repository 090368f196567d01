"""power_of_two: sample two workers at random, send to the less loaded one."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import explain
from router.policies.least_load import load_key
from router.types import RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class PowerOfTwoParams:
    """No parameters."""


def pick_two(workers: Sequence[WorkerView], rng: random.Random) -> WorkerView:
    """The less loaded of two distinct random workers (Mitzenmacher, "The Power of Two Choices")."""
    if len(workers) == 1:
        return workers[0]
    first, second = rng.sample(range(len(workers)), 2)
    a, b = workers[first], workers[second]
    return b if load_key(b) < load_key(a) else a


class PowerOfTwo:
    """rank = [less loaded of two random workers, then the rest by load]."""

    name = "power_of_two"

    def __init__(self, params: PowerOfTwoParams = PowerOfTwoParams(), *, rng: random.Random | None = None) -> None:
        self.params = params
        self._rng = rng or random.Random()

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        winner = pick_two(workers, self._rng)
        rest = sorted((w for w in workers if w is not winner), key=load_key)
        ranked = [winner, *rest]
        return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked))
