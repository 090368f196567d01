"""One configuration's run turned into its figures: each phase's (figures.py) with the moves between pools
and the refusals kvgate counted meanwhile, the recovery time after each fault, and what the returning
workers took over their first slow_start_s."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from loadtest.cascade.figures import (count_shares, counter_deltas, good_share, phase_figures, recovery_s,
                                      worker_shares)
from loadtest.cascade.phases import PhasePlan
from loadtest.cascade.records import CallRecord


def analyse(run: Mapping[str, Any], plan: PhasePlan, slo_ttft_ms: float, slow_start_s: float,
            num_primary: int) -> dict[str, Any]:
    records = [CallRecord.from_json(r) for r in run["records"]]
    return {"phases": _phases(run, records, plan, slo_ttft_ms),
            "recovery": _recovery(run, records, plan, slo_ttft_ms),
            "returning": _returning(run, records, plan, slow_start_s, num_primary)}


def _phases(run: Mapping[str, Any], records: Sequence[CallRecord], plan: PhasePlan,
            slo_ttft_ms: float) -> list[dict[str, Any]]:
    scrapes = {s["label"]: s["samples"] for s in run.get("scrapes", []) if s.get("ok")}
    windows = plan.windows()
    labels = [w.name for w in windows] + ["end"]
    phases = []
    for i, window in enumerate(windows):
        figures = phase_figures(records, window, slo_ttft_ms)
        before, after = scrapes.get(labels[i]), scrapes.get(labels[i + 1])
        if before is not None and after is not None:
            figures["fallbacks"] = counter_deltas(before["kvgate_fallbacks_total"], after["kvgate_fallbacks_total"],
                                                  ("reason",))
            figures["refused"] = counter_deltas(before["kvgate_rejected_total"], after["kvgate_rejected_total"],
                                                ("reason",))
        phases.append(figures)
    return phases


def fault_events(run: Mapping[str, Any], plan: PhasePlan) -> list[dict[str, Any]]:
    """Each fault with the time it struck and the end of the phase it opens: the degrade, the kill, and the
    workers' return (when the restarted workers answered again)."""
    ends = {w.name: w.end_s for w in plan.windows()}
    events = []
    for fault in run.get("faults", []):
        if fault["action"] == "degrade":
            events.append({"event": f"{'/'.join(fault['workers'])} degraded", "at_s": fault["started_s"],
                           "until_s": ends["degraded"]})
        elif fault["action"] == "kill" and fault["at_s"] < 3 * plan.phase_s:
            events.append({"event": f"{'/'.join(fault['workers'])} killed", "at_s": fault["started_s"],
                           "until_s": ends["two-down"]})
        elif fault["action"] == "restart":
            events.append({"event": f"{'/'.join(fault['workers'])} back", "at_s": fault["done_s"],
                           "until_s": ends["recovery"]})
    return events


def _recovery(run: Mapping[str, Any], records: Sequence[CallRecord], plan: PhasePlan,
              slo_ttft_ms: float) -> list[dict[str, Any]]:
    healthy = plan.window("healthy")
    reference = good_share(records, healthy.start_s, healthy.end_s, slo_ttft_ms)
    return [{**event, "reference_good_share": reference,
             "recovery_s": None if reference is None else
             recovery_s(records, event["at_s"], event["until_s"], reference, slo_ttft_ms)}
            for event in fault_events(run, plan)]


def _returning(run: Mapping[str, Any], records: Sequence[CallRecord], plan: PhasePlan, slow_start_s: float,
               num_primary: int) -> dict[str, Any]:
    """Per returning worker: from when it was back in rotation (kvgate's /ready listing it warming; else
    when it answered again), its share of the primary pool's new requests over the first third of
    slow_start_s and the whole of it (x-kvgate-worker), beside its share in the healthy phase; and, for
    every router, the shares of the requests the primary workers finished meanwhile (their /metrics)."""
    back = [f for f in run.get("faults", []) if f["action"] == "restart"]
    if not back:
        return {}
    back_s, healthy = back[0]["done_s"], plan.window("healthy")
    steady, _ = worker_shares(records, healthy.start_s, healthy.end_s)
    out: dict[str, Any] = {"back_s": back_s, "workers": {}}
    for worker in plan.returning:
        since = run.get("warming_s", {}).get(worker, back_s)
        first, n_first = worker_shares(records, since, since + slow_start_s / 3)
        whole, n_whole = worker_shares(records, since, since + slow_start_s)
        out["workers"][worker] = {"since_s": since, "warming_seen": worker in run.get("warming_s", {}),
                                  "steady_share": steady.get(worker) if steady else None,
                                  "first_third_share": first.get(worker, 0.0) if n_first else None,
                                  "first_third_requests": n_first,
                                  "window_share": whole.get(worker, 0.0) if n_whole else None}
    marks = run.get("worker_counts", [])

    def finished_since_back(mark: int) -> dict[str, float] | None:
        return count_shares(marks[0]["finished"], marks[mark]["finished"]) if len(marks) > mark else None
    out["finished_shares"] = {"first_third": finished_since_back(1), "window": finished_since_back(2),
                              "steady": 1 / num_primary}
    return out
