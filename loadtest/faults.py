"""Fault scenarios for fleet runs: kill a worker, slow it or make it fail (via fault_proxy), stop Redis.

A fault is written `KIND:TARGET@START[-END][:key=value,...]`, times in seconds since the load
started: `kill:w1@10`, `slow:w1@5-15:delay_ms=500`, `error:w2@5-15:fraction=0.5`, `redis@10`.
Each scenario reports client errors, failovers, the gateway's retry counters, and recovery time.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import httpx

from loadtest.types import RequestRecord

FaultKind = Literal["kill", "slow", "error", "redis"]
_FAULT = re.compile(r"^(kill|slow|error|redis)(?::([A-Za-z0-9_.-]+))?@([0-9.]+)(?:-([0-9.]+))?(?::(.*))?$")
RETRY_METRICS = ("kvgate_upstream_retries_total", "kvgate_retry_budget_refusals_total")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One scripted fault; end_s None means it is instantaneous (kill, redis) or lasts to the end."""

    kind: FaultKind
    start_s: float
    target: str | None = None
    end_s: float | None = None
    delay_ms: float = 0.0
    error_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.kind in ("kill", "slow", "error") and not self.target:
            raise ValueError(f"a {self.kind} fault needs a worker name: {self.kind}:w1@10")
        if self.end_s is not None and self.end_s < self.start_s:
            raise ValueError("a fault's end must come after its start")
        if self.kind == "slow" and self.delay_ms <= 0:
            raise ValueError("a slow fault needs delay_ms > 0")
        if not 0 < self.error_fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")

    @property
    def needs_proxy(self) -> bool:
        return self.kind in ("slow", "error")

    @property
    def over_s(self) -> float:
        """When the fault is over: its end, or its start for an instantaneous one."""
        return self.end_s if self.end_s is not None else self.start_s


def parse_fault(text: str) -> FaultSpec:
    """`slow:w1@5-15:delay_ms=500` -> FaultSpec(kind="slow", target="w1", start_s=5, end_s=15, delay_ms=500)."""
    match = _FAULT.match(text.strip())
    if not match:
        raise ValueError(f"bad fault {text!r}; expected KIND:TARGET@START[-END][:key=value,...]")
    kind, target, start, end, options = match.groups()
    params = dict(kv.split("=", 1) for kv in options.split(",") if kv) if options else {}
    unknown = set(params) - {"delay_ms", "fraction"}
    if unknown:
        raise ValueError(f"unknown fault option(s) {', '.join(sorted(unknown))} in {text!r}")
    return FaultSpec(kind=kind, target=target, start_s=float(start), end_s=float(end) if end else None,
                     delay_ms=float(params.get("delay_ms", 0)), error_fraction=float(params.get("fraction", 1)))


@dataclass(frozen=True, slots=True)
class FaultActions:
    """How to cause and undo faults in this fleet: callables the schedule invokes at the scripted times."""

    kill_worker: Callable[[str], None]
    set_proxy_fault: Callable[[str, float, float], None]  # (worker, delay_ms, error_fraction)
    stop_redis: Callable[[], None]


async def run_schedule(faults: Sequence[FaultSpec], actions: FaultActions, clock: Callable[[], float],
                       t0: float) -> list[dict[str, Any]]:
    """Apply each fault at t0 + start_s and undo it at t0 + end_s; returns what was done, when."""
    steps = []
    for fault in faults:
        steps.append((fault.start_s, fault, True))
        if fault.end_s is not None and fault.needs_proxy:
            steps.append((fault.end_s, fault, False))
    log = []
    for at_s, fault, begin in sorted(steps, key=lambda step: step[0]):
        await asyncio.sleep(max(0.0, t0 + at_s - clock()))
        await asyncio.to_thread(_apply, fault, actions, begin)
        log.append({"at_s": round(clock() - t0, 3), "fault": fault.kind, "target": fault.target,
                    "action": "start" if begin else "end"})
    return log


def _apply(fault: FaultSpec, actions: FaultActions, begin: bool) -> None:
    if fault.kind == "kill":
        actions.kill_worker(fault.target or "")
    elif fault.kind == "redis":
        actions.stop_redis()
    elif begin:
        delay = fault.delay_ms if fault.kind == "slow" else 0.0
        fraction = fault.error_fraction if fault.kind == "error" else 0.0
        actions.set_proxy_fault(fault.target or "", delay, fraction)
    else:
        actions.set_proxy_fault(fault.target or "", 0.0, 0.0)


def set_proxy_fault(proxy_url: str, delay_ms: float, error_fraction: float) -> None:
    """Switch a fault_proxy's fault (zeros = healthy)."""
    httpx.post(f"{proxy_url}/_fault", json={"delay_ms": delay_ms, "error_fraction": error_fraction},
               timeout=5.0).raise_for_status()


def shutdown_redis(port: int) -> None:
    """`redis-cli -p PORT shutdown nosave`; only ever called on a redis-server this run started."""
    subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=10)


def scrape_counters(metrics_url: str, names: Sequence[str] = RETRY_METRICS) -> dict[str, float | None]:
    """Sum each counter over its labels from a Prometheus text page; None when absent or unreachable."""
    try:
        text = httpx.get(metrics_url, timeout=5.0).text
    except httpx.HTTPError:
        return {name: None for name in names}
    return parse_counters(text, names)


def parse_counters(text: str, names: Sequence[str]) -> dict[str, float | None]:
    totals: dict[str, float | None] = {name: None for name in names}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        metric = re.split(r"[{\s]", line, maxsplit=1)[0]
        if metric in totals:
            totals[metric] = (totals[metric] or 0.0) + float(line.rsplit(None, 1)[-1])
    return totals


def recovery_time_s(records: Sequence[RequestRecord], fault_over_s: float, window: int = 20,
                    target: float = 0.99) -> float | None:
    """Seconds from fault_over_s until the success rate over `window` consecutive requests (by start time)
    is back to >= target; the time is that window's first start. None if it never recovers."""
    after = sorted((r for r in records if r.start_s >= fault_over_s), key=lambda r: r.start_s)
    for i in range(0, max(0, len(after) - window + 1)):
        chunk = after[i:i + window]
        if sum(r.ok for r in chunk) / window >= target:
            return max(0.0, chunk[0].start_s - fault_over_s)
    return None


def fault_report(faults: Sequence[FaultSpec], records: Sequence[RequestRecord], summary: Mapping[str, Any],
                 counters_before: Mapping[str, float | None], counters_after: Mapping[str, float | None],
                 schedule_log: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What each scenario did to clients: errors, failovers, retries vs budget refusals, recovery."""
    deltas = {name: None if counters_after.get(name) is None else
              counters_after[name] - (counters_before.get(name) or 0.0) for name in counters_after}
    return {
        "faults": [{"kind": f.kind, "target": f.target, "start_s": f.start_s, "end_s": f.end_s,
                    "recovery_s": recovery_time_s(records, f.over_s)} for f in faults],
        "client_errors": summary["errors"], "failovers": summary.get("failovers", 0),
        "retries": deltas.get("kvgate_upstream_retries_total"),
        "retry_budget_refusals": deltas.get("kvgate_retry_budget_refusals_total"),
        "schedule": list(schedule_log),
    }
