"""prefix_approx: longest prefix among the router's own recent decisions (no KV events)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import check_number, explain, over_bound
from router.policies.least_load import load_key
from router.types import RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class PrefixApproxParams:
    """prediction_ttl_s: how long a decision is remembered; slack: bounded-load headroom."""

    prediction_ttl_s: float = 60.0
    slack: float = 0.5

    def __post_init__(self) -> None:
        check_number("prediction_ttl_s", self.prediction_ttl_s, above=0)
        check_number("slack", self.slack, minimum=0)


class PrefixApprox:
    """rank = workers within the load bound by (-predicted_blocks, load), then those over it."""

    name = "prefix_approx"

    def __init__(self, params: PrefixApproxParams = PrefixApproxParams(), *, rng: random.Random | None = None) -> None:
        self.params = params
        self.prediction_ttl_s = params.prediction_ttl_s

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        hot = over_bound(workers, self.params.slack)
        order = sorted(
            range(len(workers)), key=lambda i: (hot[i], -workers[i].predicted_blocks, load_key(workers[i]))
        )
        ranked = [workers[i] for i in order]
        return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked))
