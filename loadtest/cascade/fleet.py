"""The two-pool sim fleet: pool `primary` (big-model) and pool `small` (small-model, a faster sim timing),
each worker a `kvgate worker --executor sim` on a port it keeps, so the harness can kill one (SIGKILL),
restart it slowed (a degraded worker) or restart it cold, and a router in front never sees its address
change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from loadtest.engines import Engine, KVGATE_WORKER, worker_launch
from loadtest.procs import ChildProcess, Started, free_port

PRIMARY, SMALL = "primary", "small"
PRIMARY_MODEL, SMALL_MODEL = "big-model", "small-model"
# The default sim timing's coefficients (Llama-3.1-8B on one H100, estimated: docs/sim-calibration.md),
# scaled below so that a handful of sim workers serve a load two cores can also generate and route.
DEFAULT_COEFFICIENTS = {"step_overhead_s": 6.5e-3, "prefill_token_s": 6.0e-5, "decode_seq_s": 2.0e-5,
                        "kv_token_s": 5.0e-8}


def sim_timing(scale: float) -> str:
    """`--sim-timing` with every default coefficient times scale (named so)."""
    pairs = ",".join(f"{key}={value * scale:.6g}" for key, value in DEFAULT_COEFFICIENTS.items())
    return f"name=default x{scale:g} (every coefficient of the default H100 estimate x{scale:g}; not calibrated),{pairs}"


@dataclass(frozen=True, slots=True)
class FleetShape:
    """How many workers each pool has, what each runs at once, and their sim timings (as scales of the
    default); the small pool's workers are faster (a smaller model)."""

    primary_workers: int = 3
    small_workers: int = 2
    max_num_seqs: int = 2
    primary_scale: float = 8.0
    small_scale: float = 4.0

    def __post_init__(self) -> None:
        if self.primary_workers < 2 or self.small_workers < 1:
            raise ValueError("the primary pool needs at least 2 workers (one degraded, one killed), small at least 1")

    def workers(self) -> list[tuple[str, str]]:
        """(name, pool) of every worker: p0.. then s0.."""
        return ([(f"p{i}", PRIMARY) for i in range(self.primary_workers)]
                + [(f"s{i}", SMALL) for i in range(self.small_workers)])


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker's fixed place: its pool, URL and KV-event endpoint (kept across restarts)."""

    name: str
    pool: str
    port: int
    kv_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def model(self) -> str:
        return PRIMARY_MODEL if self.pool == PRIMARY else SMALL_MODEL


class CascadeFleet(Started):
    """The workers of one configuration's run; cpus pins each of them (None: unpinned)."""

    def __init__(self, work_dir: Path, shape: FleetShape, cpus: Collection[int] | None = None,
                 health_timeout_s: float = 60.0) -> None:
        self.work_dir, self.shape, self.cpus, self.health_timeout_s = work_dir, shape, cpus, health_timeout_s
        self.specs = {name: WorkerSpec(name, pool, free_port(), free_port(pair=True)) for name, pool in shape.workers()}
        self.children: dict[str, ChildProcess] = {}
        self._generation: dict[str, int] = {}

    def start(self) -> None:
        for name in self.specs:
            self._launch(name, 1.0)
        self.wait_healthy(list(self.specs))

    def pool_workers(self, pool: str) -> list[WorkerSpec]:
        return [spec for spec in self.specs.values() if spec.pool == pool]

    def _launch(self, name: str, slowdown: float) -> None:
        spec = self.specs[name]
        scale = (self.shape.primary_scale if spec.pool == PRIMARY else self.shape.small_scale) * slowdown
        extra = ("--sim-timing", sim_timing(scale), "--served-model-name", spec.model,
                 "--max-num-seqs", str(self.shape.max_num_seqs), "--no-request-log")
        launch = worker_launch(Engine("sim", KVGATE_WORKER), name, spec.port, spec.kv_port, extra_args=extra)
        generation = self._generation[name] = self._generation.get(name, -1) + 1
        log = self.work_dir / "logs" / f"{name}.{generation}.log"
        self.children[name] = ChildProcess(name, launch.argv, log, f"{spec.url}/health", launch.env, self.cpus)

    def wait_healthy(self, names: list[str]) -> None:
        for name in names:
            self.children[name].wait_healthy(self.health_timeout_s)

    def kill(self, name: str) -> None:
        """SIGKILL the worker (a crash: what it was serving is cut) and wait until it is gone."""
        child = self.children[name]
        child.kill()
        child.popen.wait(10)
        child.stop()

    def degrade(self, name: str, slowdown: float) -> None:
        """The worker, killed and at once started again with its sim timing slowdown times slower."""
        self.kill(name)
        self._launch(name, slowdown)
        self.wait_healthy([name])

    def restart(self, names: list[str]) -> None:
        """Start these (dead) workers again at their own timing, side by side, cold; wait until they answer."""
        for name in names:
            if self.children[name].alive:
                raise RuntimeError(f"worker {name} still runs")
            self._launch(name, 1.0)
        self.wait_healthy(names)

    def stop(self) -> None:
        for child in self.children.values():
            child.stop()

