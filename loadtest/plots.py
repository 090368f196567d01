"""PNG plots of one or more runs (matplotlib, Agg backend): latency CDFs, throughput over time, load, hit rate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.slo import Slo  # noqa: E402
from loadtest.types import RequestRecord  # noqa: E402


def write_plots(results: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """All plots for these results into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [(r["name"], [RequestRecord.from_json(x) for x in r["records"]], r) for r in results]
    written = [
        _cdf(runs, lambda recs: [x.ttft_ms for x in recs if x.ok and x.ttft_ms is not None], "TTFT (ms)",
             out_dir / "ttft_cdf.png"),
        _cdf(runs, lambda recs: [v for x in recs if x.ok for v in x.itl_ms], "inter-token latency (ms)",
             out_dir / "itl_cdf.png"),
        _over_time(runs, out_dir / "throughput_over_time.png"),
        _hit_rate(results, out_dir / "prefix_hit_rate.png"),
    ]
    if any(r["summary"].get("workers") for r in results):
        written.append(_worker_load(results, out_dir / "worker_load.png"))
    return written


def section_plot(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """The picture beside a docs/benchmarks.md section: per run, hit rate over the oracle's and TTFT
    p50 / p90 (ms), side by side."""
    fig, (hits, ttfts) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [r["name"] for r in results]
    ratios = []
    for r in results:
        hit, oracle = r["summary"].get("prefix_hit_rate"), (r.get("oracle") or {}).get("hit_rate")
        ratios.append(hit / oracle if hit is not None and oracle else 0)
    hits.bar(names, ratios)
    hits.set_ylim(0, 1.05)
    hits.set_ylabel("hit rate / oracle")
    width = 0.4
    for i, key in enumerate(("p50", "p90")):
        values = [((r["summary"].get("ttft_ms") or {}).get(key) or 0) for r in results]
        ttfts.bar([j + i * width for j in range(len(names))], values, width, label=f"TTFT {key}")
    ttfts.set_xticks([j + width / 2 for j in range(len(names))], names)
    ttfts.set_ylabel("ms")
    ttfts.legend(fontsize="small")
    for ax in (hits, ttfts):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdf(runs: Sequence[tuple], values_of: Any, label: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, records, _ in runs:
        values = sorted(values_of(records))
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.set_xlabel(label)
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def _over_time(runs: Sequence[tuple], path: Path) -> Path:
    """Completed and good (SLO-meeting) requests per 1-second bin of their end time."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, records, result in runs:
        slo = Slo(**result["config"].get("slo", {}))
        ends = [r.end_s for r in records if r.ok]
        good = [r.end_s for r in records if slo.met_by(r)]
        bins = max(1, math.ceil(max(ends, default=0)))
        line = ax.plot(*_per_second(ends, bins), label=f"{name} throughput")[0]
        ax.plot(*_per_second(good, bins), linestyle="--", color=line.get_color(), label=f"{name} goodput")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _per_second(times_s: Sequence[float], bins: int) -> tuple[list[int], list[int]]:
    counts = [0] * bins
    for t in times_s:
        counts[min(bins - 1, int(t))] += 1
    return list(range(bins)), counts


def _hit_rate(results: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["name"] for r in results]
    ax.bar(names, [r["summary"].get("prefix_hit_rate") or 0 for r in results], label="measured")
    oracle = [(r.get("oracle") or {}).get("hit_rate") for r in results]
    if any(o is not None for o in oracle):
        ax.scatter(names, [o or 0 for o in oracle], color="black", marker="_", s=400, label="oracle", zorder=3)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix hit rate (cached / prompt tokens)")
    ax.legend(fontsize="small")
    return _save(fig, path)


def _worker_load(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """Requests served per worker, one bar group per worker and one bar per run."""
    fig, ax = plt.subplots(figsize=(6, 4))
    counts = [(r["summary"].get("workers") or {}).get("counts") or {} for r in results]
    workers = sorted({w for c in counts for w in c})
    width = 0.8 / len(results)
    for i, (result, by_worker) in enumerate(zip(results, counts)):
        ax.bar([j + i * width for j in range(len(workers))], [by_worker.get(w, 0) for w in workers],
               width=width, label=result["name"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workers))], workers)
    ax.set_ylabel("requests served")
    ax.legend(fontsize="small")
    return _save(fig, path)
