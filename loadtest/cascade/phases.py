"""The phases of a cascading failure and the fault schedule that makes them: healthy; one primary worker
degraded (restarted with its sim timing slowed); a second one killed (SIGKILL); both back, restarted cold
(the slow one is taken down first and both start again down_s later, as a replaced worker is out of
rotation for a while)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PHASES = ("healthy", "degraded", "two-down", "recovery")
Action = Literal["degrade", "kill", "restart"]


@dataclass(frozen=True, slots=True)
class PhaseWindow:
    """One phase: requests scheduled in [start_s, end_s) of the load belong to it."""

    name: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def holds(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.end_s


@dataclass(frozen=True, slots=True)
class FaultStep:
    """What the harness does at at_s (seconds since the load started) to these workers."""

    at_s: float
    action: Action
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """phase_s each phase; the degraded worker runs slow_factor times slower; down_s: how long it is out
    before it and the killed one are restarted at the start of the recovery phase."""

    phase_s: float
    slow_factor: float = 5.0
    down_s: float = 5.0
    degraded: str = "p0"
    killed: str = "p1"

    def __post_init__(self) -> None:
        if self.phase_s <= 0:
            raise ValueError("--phase-s must be > 0")
        if self.slow_factor < 1:
            raise ValueError("--slow-factor must be >= 1")
        if not 0 <= self.down_s < self.phase_s:
            raise ValueError("--down-s must be in [0, --phase-s)")
        if self.degraded == self.killed:
            raise ValueError("the degraded and the killed worker must differ")

    @property
    def total_s(self) -> float:
        return self.phase_s * len(PHASES)

    def windows(self) -> list[PhaseWindow]:
        return [PhaseWindow(name, i * self.phase_s, (i + 1) * self.phase_s) for i, name in enumerate(PHASES)]

    def window(self, name: str) -> PhaseWindow:
        return self.windows()[PHASES.index(name)]

    def schedule(self) -> list[FaultStep]:
        """The faults in time order: degrade, kill, take the slow one down, restart both."""
        t = self.phase_s
        return [FaultStep(t, "degrade", (self.degraded,)), FaultStep(2 * t, "kill", (self.killed,)),
                FaultStep(3 * t, "kill", (self.degraded,)),
                FaultStep(3 * t + self.down_s, "restart", (self.degraded, self.killed))]

    @property
    def returning(self) -> tuple[str, ...]:
        return self.degraded, self.killed
