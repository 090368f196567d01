"""The overload benchmark's scenarios and their arithmetic: what each tenant is offered (as a multiple
of the measured capacity C), the requests that makes, and the figures of a run (goodput in a window,
refusal latency, outcomes by status and error code, deadlines kept)."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from loadtest.arrivals import ArrivalProcess
from loadtest.recording_proxy import marker_text
from loadtest.slo import Slo, stats
from loadtest.text import seeded_text
from loadtest.types import RequestRecord, RequestSpec

REFUSAL_STATUSES = (429, 503)
NUM_DOCUMENTS = 16  # distinct prompt bodies; the marker in front makes every prompt's blocks unique


@dataclass(frozen=True, slots=True)
class Offer:
    """One tenant's open-loop load in a scenario: Poisson arrivals at load_x_c times C."""

    tenant: str
    load_x_c: float

    def __post_init__(self) -> None:
        if self.load_x_c <= 0:
            raise ValueError("an offer's load must be > 0")


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named open-loop run: each offer at once, optionally every request with a deadline header;
    duration_x stretches the run (more requests where a small loss must be told apart)."""

    name: str
    offers: tuple[Offer, ...]
    deadline_ms: float | None = None
    duration_x: float = 1.0

    def rate_rps(self, tenant: str, capacity_rps: float) -> float:
        return sum(o.load_x_c for o in self.offers if o.tenant == tenant) * capacity_rps


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The requests every scenario sends: a chat prompt of prompt_words words, max_tokens output tokens."""

    prompt_words: int = 600
    max_tokens: int = 16


def default_scenarios(levels: Sequence[float] = (2.0, 5.0, 10.0), flood_x_c: float = 5.0,
                      small_x_c: float = 0.4, light_x_c: float = 0.35, deadline_ms: float = 1000.0) -> list[Scenario]:
    """Overload levels for one standard tenant; a critical tenant beside a standard flood; a standard
    tenant within its fair share alone and beside another standard tenant's flood; a lighter one (0.7 of
    its fair half, issue #50's case) beside the same flood, long enough to tell a 1% loss apart;
    deadlines in a flood."""
    scenarios = [Scenario(f"load-{level:g}x", (Offer("std-a", level),)) for level in levels]
    return scenarios + [
        Scenario("critical-beside-flood", (Offer("crit", small_x_c), Offer("std-b", flood_x_c)), duration_x=2.0),
        Scenario("fair-alone", (Offer("std-a", small_x_c),)),
        Scenario("fair-beside-flood", (Offer("std-a", small_x_c), Offer("std-b", flood_x_c))),
        Scenario("light-beside-flood", (Offer("std-a", light_x_c), Offer("std-b", flood_x_c)), duration_x=3.0),
        Scenario("deadline-flood", (Offer("std-a", flood_x_c),), deadline_ms=deadline_ms),
    ]


def marker_name(tag: str, index: int) -> str:
    """The marker of request `index` of the run tagged `tag` (letters, digits, '-')."""
    return f"{tag}-{index}"


@functools.lru_cache(maxsize=4)
def _documents(words: int) -> tuple[str, ...]:
    return tuple(seeded_text(f"overload-doc-{i}", words) for i in range(NUM_DOCUMENTS))


def build_specs(scenario: Scenario, capacity_rps: float, duration_s: float, shape: RequestShape, tag: str,
                seed: int = 0) -> list[RequestSpec]:
    """Every tenant's Poisson arrivals over duration_s (seeded per offer), merged in time order."""
    if capacity_rps <= 0 or duration_s <= 0:
        raise ValueError("capacity_rps and duration_s must be > 0")
    arrivals: list[tuple[float, str]] = []
    for position, offer in enumerate(scenario.offers):
        rate = offer.load_x_c * capacity_rps
        count = int(rate * duration_s * 1.5) + 10  # enough to pass duration_s
        offsets = ArrivalProcess(rate).offsets_s(count, seed=seed * 1000 + position)
        arrivals.extend((t, offer.tenant) for t in offsets if t < duration_s)
    return [request_spec(index, tenant, shape, tag, offset_s) for index, (offset_s, tenant) in enumerate(sorted(arrivals))]


def closed_loop_specs(count: int, tenant: str, shape: RequestShape, tag: str) -> list[RequestSpec]:
    """`count` requests of one tenant without arrival times (a closed loop sends them as answers come)."""
    return [request_spec(index, tenant, shape, tag, None) for index in range(count)]


def request_spec(index: int, tenant: str, shape: RequestShape, tag: str, offset_s: float | None) -> RequestSpec:
    """Request `index` of a run: its marker first (so the recording proxy can tell requests apart and no
    two prompts share a cached block), then one of a few seeded documents."""
    documents = _documents(shape.prompt_words)
    content = f"{marker_text(marker_name(tag, index))} {documents[index % len(documents)]}"
    return RequestSpec(index=index, kind="chat", max_tokens=shape.max_tokens, tenant=tenant,
                       messages=({"role": "user", "content": content},), arrival_offset_s=offset_s)


def in_window(records: Iterable[RequestRecord], warmup_s: float, end_s: float, tenant: str | None = None
              ) -> list[RequestRecord]:
    """The requests scheduled within [warmup_s, end_s) (of one tenant, when given)."""
    return [r for r in records if warmup_s <= r.scheduled_s < end_s and (tenant is None or r.tenant == tenant)]


def capacity_rps(records: Iterable[RequestRecord], warmup_s: float, end_s: float) -> float:
    """Answered requests per second of a closed-loop run: successes that ended within [warmup_s, end_s)."""
    if end_s <= warmup_s:
        raise ValueError("the window must not be empty")
    return sum(1 for r in records if r.ok and warmup_s <= r.end_s < end_s) / (end_s - warmup_s)


def tenant_figures(records: Sequence[RequestRecord], codes: Mapping[int, str | None], slo: Slo,
                   window_s: float, server_ms: Mapping[int, float | None] | None = None) -> dict[str, Any]:
    """One tenant's figures over the requests of a window (already selected) lasting window_s:
    goodput, loss, TTFT of the answered, latency of the refused, outcomes by status and error code.
    codes: request index -> the refusal's `error.code` (absent for those not refused); server_ms: request
    index -> the gateway's own time for a refusal (its Server-Timing), where it gave one."""
    good = [r for r in records if slo.met_by(r)]
    refused = [r for r in records if r.status in REFUSAL_STATUSES]
    outcomes = Counter(str(r.status) if r.status is not None else (r.error or "none") for r in records)
    by_code = Counter(codes.get(r.index) or "none" for r in refused)
    return {
        "offered": len(records), "offered_rps": len(records) / window_s,
        "good": len(good), "goodput_rps": len(good) / window_s,
        "loss": 1 - len(good) / len(records) if records else None,
        "answered": sum(1 for r in records if r.ok),
        "ttft_ms": stats([r.ttft_ms for r in records if r.ok and r.ttft_ms is not None]),
        "refused": len(refused),
        "refusal_ms": stats([r.e2e_ms for r in refused if r.e2e_ms is not None]),
        "refusal_server_ms": stats([ms for r in refused if (ms := (server_ms or {}).get(r.index)) is not None]),
        "refusal_ms_by_code": {code: stats([r.e2e_ms for r in refused if (codes.get(r.index) or "none") == code
                                            and r.e2e_ms is not None]) for code in sorted(by_code)},
        "by_status": dict(sorted(outcomes.items())), "by_code": dict(sorted(by_code.items())),
        "errors": dict(sorted(Counter(r.error for r in records if r.error and r.status not in REFUSAL_STATUSES)
                              .items())),
        "send_late_ms": stats([(r.start_s - r.scheduled_s) * 1000 for r in records]),
        "output_tokens": sorted({r.output_tokens for r in records if r.ok and r.output_tokens is not None}),
    }


def deadline_figures(sent_s: Mapping[str, float], arrivals: Mapping[str, Sequence[float]], deadline_ms: float,
                     records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Which requests reached a worker after their deadline, counted from when the client sent them
    (sent_s: marker -> client send time; arrivals: marker -> arrival times at the workers, same
    clock). A retry or failover arrives again: every arrival counts. Also how many answered requests
    got their first token only after the deadline."""
    deadline_s = deadline_ms / 1000
    late, lateness_ms, reached = 0, [], 0
    for marker, sent in sent_s.items():
        times = arrivals.get(marker, ())
        reached += bool(times)
        for arrived in times:
            if arrived > sent + deadline_s:
                late += 1
                lateness_ms.append((arrived - sent - deadline_s) * 1000)
    answered = [r for r in records if r.ok and r.ttft_ms is not None]
    return {"sent": len(sent_s), "reached_worker": reached,
            "arrivals": sum(len(arrivals.get(m, ())) for m in sent_s), "late_arrivals": late,
            "max_late_ms": max(lateness_ms) if lateness_ms else None,
            "max_send_to_worker_ms": max(((t - sent_s[m]) * 1000 for m in sent_s for t in arrivals.get(m, ())),
                                         default=None),
            "answered": len(answered),
            "first_token_after_deadline": sum(1 for r in answered if r.ttft_ms > deadline_ms)}


def rss_growth(samples_kib: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """From (label, VmRSS KiB) samples in time order: first, last, peak, and the growth last - first."""
    if not samples_kib:
        raise ValueError("no RSS samples")
    first, last = samples_kib[0][1], samples_kib[-1][1]
    return {"samples": [list(s) for s in samples_kib], "first_kib": first, "last_kib": last,
            "peak_kib": max(kib for _, kib in samples_kib), "growth_kib": last - first,
            "growth_ratio": last / first if first else None}
