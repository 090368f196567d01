"""least_load: fewest requests first, then lowest KV usage, then list order."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import explain
from router.types import RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class LeastLoadParams:
    """No parameters."""


def load_key(worker: WorkerView) -> tuple[int, int, float]:
    """(requests, queued prefill tokens, KV usage): smaller is less loaded."""
    load = worker.load
    return (load.num_requests, load.prefill_tokens_queued, load.kv_usage_frac or 0.0)


class LeastLoad:
    """rank = workers sorted by (num_requests, prefill_tokens_queued, kv_usage_frac)."""

    name = "least_load"

    def __init__(self, params: LeastLoadParams = LeastLoadParams(), *, rng: random.Random | None = None) -> None:
        self.params = params

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        ranked = sorted(workers, key=load_key)
        return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked))
