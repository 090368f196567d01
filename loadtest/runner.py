"""One measured run: drive the workload (with any fault schedule alongside), summarize, build the result."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Sequence

from loadtest.driver import DriverConfig, DriverRun, run_load
from loadtest.faults import FaultActions, FaultSpec, fault_report, run_schedule, scrape_counters
from loadtest.oracle import oracle_hit_rate, static_partition_hit_rate
from loadtest.report import build_result
from loadtest.slo import Slo, summarize
from loadtest.types import RequestSpec


@dataclasses.dataclass(frozen=True, slots=True)
class RunPlan:
    """Everything one run needs besides the requests: where/how to drive, SLOs, and what to record."""

    name: str
    driver: DriverConfig
    slo: Slo = Slo()
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    oracle: dict[str, Any] | None = None
    command: str = ""
    workers: tuple[str, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    actions: FaultActions | None = None
    metrics_url: str | None = None

    def __post_init__(self) -> None:
        if self.faults and self.actions is None:
            raise ValueError("faults need actions to carry them out")


def execute(specs: Sequence[RequestSpec], plan: RunPlan) -> dict[str, Any]:
    """Run, summarize and return the result dict (not yet written)."""
    before = scrape_counters(plan.metrics_url) if plan.metrics_url else {}
    run, schedule_log = asyncio.run(_drive(specs, plan))
    summary = summarize(run.records, max(run.duration_s, 1e-9), plan.slo, workers=plan.workers)
    extra: dict[str, Any] = {"started_at_unix_s": run.started_at_unix_s}
    if plan.faults or plan.metrics_url:
        after = scrape_counters(plan.metrics_url) if plan.metrics_url else {}
        extra["faults"] = fault_report(plan.faults, run.records, summary, before, after, schedule_log)
    config = {**plan.config, "driver": _driver_json(plan.driver), "slo": _slo_json(plan.slo)}
    oracle = _oracle_over_sent(specs, run.records, plan.oracle)
    return build_result(plan.name, config, run.records, summary, oracle, plan.command, extra=extra)


def _oracle_over_sent(specs: Sequence[RequestSpec], records: Sequence[Any], oracle: dict[str, Any] | None
                      ) -> dict[str, Any] | None:
    """The oracle over the requests this run actually issued (a run cut short by --duration-s sends fewer)."""
    if not oracle or "block_size_tokens" not in oracle:
        return oracle
    sent = {r.index for r in records}
    issued = [s for s in specs if s.index in sent]
    result = oracle_hit_rate(issued, oracle["block_size_tokens"])
    out = {**oracle, "hit_rate": result.hit_rate, "prompt_tokens": result.prompt_tokens,
           "shared_tokens": result.shared_tokens}
    partition = oracle.get("partition")
    if partition:  # the fleet's KV capacity is known: the static partition's hit rate with caches that size
        out["static_partition_hit_rate"] = static_partition_hit_rate(
            issued, partition["num_workers"], partition["capacity_tokens"], oracle["block_size_tokens"]).hit_rate
    return out


async def _drive(specs: Sequence[RequestSpec], plan: RunPlan) -> tuple[DriverRun, list[dict[str, Any]]]:
    clock = time.perf_counter
    t0 = clock()
    load = asyncio.create_task(run_load(specs, plan.driver, clock=clock))
    if not plan.faults or plan.actions is None:
        return await load, []
    schedule = asyncio.create_task(run_schedule(plan.faults, plan.actions, clock, t0))
    run = await load
    if not schedule.done():
        schedule.cancel()
    (log,) = await asyncio.gather(schedule, return_exceptions=True)
    if isinstance(log, asyncio.CancelledError):
        return run, [{"error": "the run ended before every fault was applied"}]
    return run, log if isinstance(log, list) else [{"error": repr(log)}]


def _driver_json(driver: DriverConfig) -> dict[str, Any]:
    data = {f.name: getattr(driver, f.name) for f in dataclasses.fields(driver)}
    data["api_key"] = "***" if driver.api_key else None
    data["tenant_api_keys"] = sorted(driver.tenant_api_keys)
    return data


def _slo_json(slo: Slo) -> dict[str, float]:
    return {f.name: getattr(slo, f.name) for f in dataclasses.fields(slo) if getattr(slo, f.name) is not None}
