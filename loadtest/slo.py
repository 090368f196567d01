"""SLOs, goodput and the summary of a run: latency percentiles, throughput, errors, hit rate, worker load.

Goodput = requests per second that succeeded AND met every SLO that is set (after DistServe).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from loadtest.stats import percentile
from loadtest.types import RequestRecord

WORKER_HEADER = "x-kvgate-worker"
FAILOVER_HEADER = "x-kvgate-failovers"


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets in ms; None means no target for that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"slo.{name} must be > 0")

    def met_by(self, record: RequestRecord) -> bool:
        """Succeeded and within every target; a target on a missing value (e.g. TPOT of 1 token) passes."""
        if not record.ok:
            return False
        pairs = ((self.ttft_ms, record.ttft_ms), (self.tpot_ms, record.tpot_ms), (self.e2e_ms, record.e2e_ms))
        return all(target is None or value is None or value <= target for target, value in pairs)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (loadtest.stats.percentile)/mean/max (None for no values)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    ordered = sorted(float(v) for v in values)
    p50, p90, p99 = (percentile(ordered, q) for q in (0.5, 0.9, 0.99))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": statistics.fmean(ordered), "max": ordered[-1]}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo(),
              workers: Sequence[str] = (), worker_header: str = WORKER_HEADER) -> dict[str, Any]:
    """Everything the report shows about one run, as plain JSON-able values."""
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    ok = [r for r in records if r.ok]
    good = [r for r in ok if slo.met_by(r)]
    prompt = sum(r.prompt_tokens or 0 for r in ok if r.cached_tokens is not None)
    cached = sum(r.cached_tokens or 0 for r in ok if r.cached_tokens is not None)
    return {
        "num_requests": len(records), "num_ok": len(ok), "num_errors": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if not r.ok)),
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s,
        "output_tokens_per_s": sum(r.output_tokens or 0 for r in ok) / duration_s,
        "goodput_rps": len(good) / duration_s,
        "slo_attainment": len(good) / len(records) if records else None,
        "ttft_ms": stats([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": stats([v for r in ok for v in r.itl_ms]),
        "tpot_ms": stats([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": stats([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "failovers": sum(_count(r.headers.get(FAILOVER_HEADER)) for r in records),
        "workers": worker_load(records, workers, worker_header),
    }


def worker_load(records: Sequence[RequestRecord], workers: Sequence[str] = (),
                header: str = WORKER_HEADER) -> dict[str, Any] | None:
    """Requests per worker (from the response header; `workers` listed with 0 if unseen), with max, mean and
    max/mean; None when no response carried the header."""
    counts = Counter(r.headers[header] for r in records if header in r.headers)
    if not counts:
        return None
    counts.update({w: 0 for w in workers})
    mean = sum(counts.values()) / len(counts)
    top = max(counts.values())
    return {"counts": dict(sorted(counts.items())), "max": top, "mean": mean, "max_over_mean": top / mean}


def _count(value: str | None) -> int:
    """The gateway's failover count for one request (header absent or unreadable: 0)."""
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0
