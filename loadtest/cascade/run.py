"""One configuration's run: a fresh fleet and its router, the same open-loop calls through every phase while
the fault schedule runs, the router's /metrics at each phase boundary (kvgate), when the restarted workers
answer again and when kvgate lists them warming (/ready), and how many requests each primary worker
finished over the returning workers' first slow_start_s (their /metrics, for routers that name no worker)."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import httpx

from loadtest.cascade.client import Clients, ClientSettings
from loadtest.cascade.fleet import PRIMARY, PRIMARY_MODEL, CascadeFleet, FleetShape
from loadtest.cascade.phases import FaultStep, PhasePlan
from loadtest.cascade.records import CallRecord
from loadtest.cascade.routers import Router, gateway_config, start_kvgate, start_litellm, start_sglang
from loadtest.cascade.workload import Arrival, TenantLoad
from loadtest.procs import free_port
from loadtest.prometheus_text import parse_samples

FINISHED = "vllm:e2e_request_latency_seconds_count"  # a worker's finished requests
# what is kept of each scrape of kvgate's /metrics: moves between pools, refusals, retries, ejections
SCRAPED = ("kvgate_fallbacks_total", "kvgate_rejected_total", "kvgate_upstream_retries_total",
           "kvgate_worker_ejections_total")
KINDS = ("kvgate", "sglang", "litellm")


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """A configuration: kvgate (fallbacks on or off), SGLang's router or LiteLLM."""

    name: str
    kind: str
    fallbacks: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a configuration's kind is one of {', '.join(KINDS)}, not {self.kind!r}")


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What every configuration shares: fleet, phases, tenants, keys, slow start, client limits."""

    shape: FleetShape
    plan: PhasePlan
    tenants: tuple[TenantLoad, ...]
    api_keys: dict[str, str]
    slow_start_s: float = 30.0
    max_tokens: int = 8
    call_timeout_s: float = 30.0
    health_timeout_s: float = 60.0


def start_router(spec: ConfigSpec, fleet: CascadeFleet, settings: RunSettings, work_dir: Path,
                 cpus: Collection[int] | None) -> Router:
    workers = list(fleet.specs.values())
    if spec.kind == "kvgate":
        config = gateway_config(workers, free_port(), settings.tenants, settings.api_keys, fallbacks=spec.fallbacks,
                                slow_start_s=settings.slow_start_s, max_num_seqs=settings.shape.max_num_seqs)
        return start_kvgate(spec.name, config, work_dir, cpus)
    if spec.kind == "sglang":
        return start_sglang(spec.name, fleet.pool_workers(PRIMARY), work_dir, cpus)
    return start_litellm(spec.name, workers, work_dir, cpus)


def run_config(spec: ConfigSpec, settings: RunSettings, arrivals: Sequence[Arrival], work_dir: Path,
               router_cpus: Collection[int] | None = None, fleet_cpus: Collection[int] | None = None) -> dict[str, Any]:
    """The configuration on a fresh fleet through every phase; its records and what was seen meanwhile."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        fleet = stack.enter_context(CascadeFleet(work_dir, settings.shape, fleet_cpus, settings.health_timeout_s))
        router = start_router(spec, fleet, settings, work_dir, router_cpus)
        stack.callback(router.child.stop)
        router.child.wait_healthy(settings.health_timeout_s, any_answer=router.any_answer)
        client = ClientSettings(router.base_url, PRIMARY_MODEL, settings.api_keys, settings.max_tokens,
                                call_timeout_s=settings.call_timeout_s)
        seen = asyncio.run(_Run(fleet, router, settings).drive(arrivals, client))
    return {"config": spec.name, "kind": spec.kind, "fallbacks": spec.fallbacks, **seen}


class _Run:
    """The tasks of one run beside the calls: the fault schedule, scrapes at boundaries, the return."""

    def __init__(self, fleet: CascadeFleet, router: Router, settings: RunSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet, self.router, self.settings, self.clock = fleet, router, settings, clock
        self.plan = settings.plan
        self.back = asyncio.Event()
        self.t0 = 0.0
        self.faults: list[dict[str, Any]] = []
        self.scrapes: list[dict[str, Any]] = []
        self.warming_s: dict[str, float] = {}
        self.worker_counts: list[dict[str, Any]] = []

    def now_s(self) -> float:
        return self.clock() - self.t0

    async def drive(self, arrivals: Sequence[Arrival], client: ClientSettings) -> dict[str, Any]:
        self.t0 = self.clock() + 0.5
        async with Clients(client, self.clock) as clients:
            side = [asyncio.create_task(task) for task in (self._faults(), self._boundaries(), self._returning())]
            records: list[CallRecord] = await clients.open_loop(arrivals, self.t0)
            await self._scrape("end")
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
        return {"records": [r.to_json() for r in records], "faults": self.faults, "scrapes": self.scrapes,
                "warming_s": self.warming_s, "worker_counts": self.worker_counts}

    async def _faults(self) -> None:
        for step in self.plan.schedule():
            await asyncio.sleep(max(0.0, self.t0 + step.at_s - self.clock()))
            started = self.now_s()
            await asyncio.to_thread(self._apply, step)
            self.faults.append({"at_s": step.at_s, "action": step.action, "workers": list(step.workers),
                                "started_s": started, "done_s": self.now_s()})
            if step.action == "restart":
                self.back.set()

    def _apply(self, step: FaultStep) -> None:
        if step.action == "degrade":
            for name in step.workers:
                self.fleet.degrade(name, self.plan.slow_factor)
        elif step.action == "kill":
            for name in step.workers:
                self.fleet.kill(name)
        else:
            self.fleet.restart(list(step.workers))

    async def _boundaries(self) -> None:
        """The router's /metrics at the start of each phase (the load's end is scraped by drive())."""
        for window in self.plan.windows():
            await asyncio.sleep(max(0.0, self.t0 + window.start_s - self.clock()))
            await self._scrape(window.name)

    async def _scrape(self, label: str) -> None:
        if self.router.metrics_url is None:
            return
        text = await asyncio.to_thread(_get_text, self.router.metrics_url)
        samples = {name: [[labels, value] for labels, value in parse_samples(text or "", name)] for name in SCRAPED}
        self.scrapes.append({"label": label, "t_s": self.now_s(), "ok": text is not None, "samples": samples})

    async def _returning(self) -> None:
        """Once the workers are back: when /ready lists each warming (kvgate), and every primary worker's
        finished requests at their return and a third of slow_start_s and slow_start_s after it."""
        await self.back.wait()
        back_s = self.now_s()
        marks = [back_s + self.settings.slow_start_s * f for f in (0.0, 1 / 3, 1.0)]
        watch = asyncio.create_task(self._watch_ready(back_s + self.settings.slow_start_s))
        for mark in marks:
            await asyncio.sleep(max(0.0, self.t0 + mark - self.clock()))
            counts = {w.name: await asyncio.to_thread(_finished, w.url) for w in self.fleet.pool_workers(PRIMARY)}
            self.worker_counts.append({"t_s": self.now_s(), "finished": counts})
        await watch

    async def _watch_ready(self, until_s: float) -> None:
        if self.router.ready_url is None:
            return
        while self.now_s() < until_s and len(self.warming_s) < len(self.plan.returning):
            body = await asyncio.to_thread(_get_json, self.router.ready_url)
            for name in (body or {}).get("warming", {}).get(PRIMARY, {}):
                self.warming_s.setdefault(name, self.now_s())
            await asyncio.sleep(0.25)


def _get_text(url: str) -> str | None:
    try:
        return httpx.get(url, timeout=5.0).text
    except httpx.HTTPError:
        return None


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        return httpx.get(url, timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return None


def _finished(worker_url: str) -> float | None:
    text = _get_text(f"{worker_url}/metrics")
    return None if text is None else sum(value for _, value in parse_samples(text, FINISHED))
