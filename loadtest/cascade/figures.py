"""The arithmetic of a cascading-failure run, over CallRecords: a phase's goodput, errors, retries and TTFT;
the time from a fault until goodput is back; the moves between pools between two scrapes of kvgate's
/metrics; the share of new requests a returning worker took; the capacity a phase leaves."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from loadtest.cascade.fleet import PRIMARY, PRIMARY_MODEL
from loadtest.cascade.phases import PhasePlan, PhaseWindow
from loadtest.cascade.records import CallRecord
from loadtest.stats import percentile

Samples = Sequence[tuple[Mapping[str, str], float]]  # (labels, value) of one metric, as scraped


def scheduled_in(records: Iterable[CallRecord], start_s: float, end_s: float) -> list[CallRecord]:
    """The calls whose arrival time falls in [start_s, end_s)."""
    return [r for r in records if start_s <= r.scheduled_s < end_s]


def is_good(record: CallRecord, slo_ttft_ms: float) -> bool:
    """Answered, its first token within the SLO (counted from the call's start: retries included)."""
    return record.ok and record.ttft_ms is not None and record.ttft_ms <= slo_ttft_ms


def served_by_primary(record: CallRecord) -> bool:
    """Answered by the primary pool: x-kvgate-pool says so, or (routers that send none) the answer's model."""
    return record.pool == PRIMARY if record.pool is not None else record.model == PRIMARY_MODEL


def _p(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


def phase_figures(records: Sequence[CallRecord], window: PhaseWindow, slo_ttft_ms: float) -> dict[str, Any]:
    """One phase: offered and good calls (and per second), client-visible errors by class, the retries the
    SDK sent (and as a share of the calls offered), TTFT p50/p99 of the answered and of those the primary
    pool answered, and which pool (or model) answered how many."""
    calls = scheduled_in(records, window.start_s, window.end_s)
    answered = [r for r in calls if r.ok and r.ttft_ms is not None]
    primary = [r.ttft_ms for r in answered if served_by_primary(r)]
    good = sum(is_good(r, slo_ttft_ms) for r in calls)
    retries = sum(r.retries for r in calls)
    ttft = [r.ttft_ms for r in answered]
    return {"phase": window.name, "offered": len(calls), "offered_rps": len(calls) / window.duration_s,
            "good": good, "goodput_rps": good / window.duration_s,
            "errors": sum(not r.ok for r in calls), "errors_by_class": dict(Counter(r.error for r in calls if r.error)),
            "retries": retries, "retry_share": retries / len(calls) if calls else None,
            "ttft_p50_ms": _p(ttft, 0.5), "ttft_p99_ms": _p(ttft, 0.99),
            "primary_ttft_p50_ms": _p(primary, 0.5), "primary_ttft_p99_ms": _p(primary, 0.99),
            "served_by": dict(Counter(r.pool or r.model or "?" for r in answered))}


def good_share(records: Sequence[CallRecord], start_s: float, end_s: float, slo_ttft_ms: float) -> float | None:
    """Good calls over calls offered in [start_s, end_s) (None for none offered): goodput as a share of the
    load, which Poisson arrivals do not move the way they move a count."""
    calls = scheduled_in(records, start_s, end_s)
    return sum(is_good(r, slo_ttft_ms) for r in calls) / len(calls) if calls else None


def recovery_s(records: Sequence[CallRecord], event_s: float, until_s: float, reference: float, slo_ttft_ms: float,
               window_s: float = 5.0, step_s: float = 1.0, threshold: float = 0.9) -> float | None:
    """Seconds from event_s to the start of the first window_s window (sliding by step_s, ending by until_s)
    whose good share is >= threshold x reference (the pre-fault share); 0 when goodput never fell below it,
    None when it is not back by until_s."""
    start = event_s
    while start + window_s <= until_s + 1e-9:
        share = good_share(records, start, start + window_s, slo_ttft_ms)
        if share is not None and share >= threshold * reference:
            return start - event_s
        start += step_s
    return None


def counter_deltas(before: Samples, after: Samples, keys: Sequence[str]) -> dict[str, float]:
    """A counter's growth between two scrapes, per the labels named by keys joined with '/'; nothing that
    did not grow."""
    def totals(samples: Samples) -> Counter[str]:
        out: Counter[str] = Counter()
        for labels, value in samples:
            out["/".join(labels.get(k, "") for k in keys)] += value
        return out
    grown = totals(after)
    grown.subtract(totals(before))
    return {key: value for key, value in sorted(grown.items()) if value > 0}


def worker_shares(records: Sequence[CallRecord], start_s: float, end_s: float) -> tuple[dict[str, float], int]:
    """Of the calls started in [start_s, end_s) that the primary pool answered, each worker's share (by
    x-kvgate-worker), and how many there were."""
    served = [r.worker for r in records if start_s <= r.start_s < end_s and r.ok and r.worker
              and served_by_primary(r)]
    counts = Counter(served)
    return {w: n / len(served) for w, n in sorted(counts.items())}, len(served)


def count_shares(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float] | None:
    """Each worker's share of the requests the workers finished between two readings of their counters
    (a worker restarted since reads from 0); None when a reading is missing or nothing finished."""
    if any(v is None for v in (*before.values(), *after.values())):
        return None
    grown = {w: after[w] - before.get(w, 0.0) if after[w] >= before.get(w, 0.0) else after[w] for w in after}
    total = sum(grown.values())
    return {w: n / total for w, n in grown.items()} if total > 0 else None


def capacity_left_rps(phase: str, plan: PhasePlan, worker_rps: Mapping[str, float], small_rps: float) -> float:
    """Req/s both pools can still serve in a phase: every worker's measured capacity, the degraded one at
    1/slow_factor of it from the degraded phase on, the killed one at nothing in the two-down phase."""
    primary = dict(worker_rps)
    if phase in ("degraded", "two-down"):
        primary[plan.degraded] /= plan.slow_factor
    if phase == "two-down":
        primary[plan.killed] = 0.0
    return sum(primary.values()) + small_rps
