"""Open-loop arrival times: Poisson (exponential gaps) or gamma gaps with a chosen burstiness, seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    """Gaps with mean 1/rate_rps; gamma with coefficient of variation cv (cv=1 is Poisson, >1 is burstier)."""

    rate_rps: float
    kind: Literal["poisson", "gamma"] = "poisson"
    cv: float = 1.0

    def __post_init__(self) -> None:
        if self.rate_rps <= 0:
            raise ValueError("rate_rps must be > 0")
        if self.kind not in ("poisson", "gamma"):
            raise ValueError(f"arrival kind must be poisson or gamma, got {self.kind!r}")
        if self.cv <= 0:
            raise ValueError("cv must be > 0")

    def offsets_s(self, count: int, seed: int) -> list[float]:
        """`count` arrival offsets from 0, the first at one gap."""
        rng = random.Random(f"{seed}:arrivals")
        shape = 1 / self.cv ** 2
        now = 0.0
        offsets = []
        for _ in range(count):
            if self.kind == "poisson":
                now += rng.expovariate(self.rate_rps)
            else:
                now += rng.gammavariate(shape, 1 / (self.rate_rps * shape))
            offsets.append(now)
        return offsets
