"""random: a uniformly random order of the candidates (type name "random")."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import explain
from router.types import RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class RandomParams:
    """No parameters."""


class RandomChoice:
    """rank = rng.sample(workers, n)."""

    name = "random"

    def __init__(self, params: RandomParams = RandomParams(), *, rng: random.Random | None = None) -> None:
        self.params = params
        self._rng = rng or random.Random()

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        ranked = self._rng.sample(list(workers), len(workers))
        return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked))
