"""round_robin: each request starts one worker further along the candidate list."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import explain
from router.types import RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class RoundRobinParams:
    """No parameters."""


class RoundRobin:
    """rank = workers rotated by a counter that advances once per request."""

    name = "round_robin"

    def __init__(self, params: RoundRobinParams = RoundRobinParams(), *, rng: random.Random | None = None) -> None:
        self.params = params
        self._next = 0

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        start = self._next % len(workers)
        self._next += 1
        ranked = list(workers[start:]) + list(workers[:start])
        return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked))
