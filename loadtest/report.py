"""Result files (JSON) and reports (Markdown + PNGs), the comparison table, and docs/benchmarks.md sections.

A docs/benchmarks.md section (between `<!-- bench:NAME:start/end -->` markers, see loadtest.benchdoc)
is only ever written by `write_benchmarks_section` from result files.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from loadtest import benchdoc
from loadtest.plots import section_plot

RESULT_KIND = "kvgate-loadtest-result"


def build_result(name: str, config: dict[str, Any], records: Sequence[Any], summary: dict[str, Any],
                 oracle: dict[str, Any] | None = None, command: str = "", machine: str | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run as a JSON-able dict: config, per-request records, summary (+ oracle, command, machine)."""
    return {"kind": RESULT_KIND, "version": 1, "name": name, "created_at": _now(), "command": command,
            "machine": machine or machine_description(), "config": config, "oracle": oracle,
            "summary": summary, "records": [r.to_json() for r in records], **(extra or {})}


def write_result(path: Path, result: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_result(path: Path) -> dict[str, Any]:
    result = json.loads(Path(path).read_text())
    if result.get("kind") != RESULT_KIND:
        raise ValueError(f"{path}: not a kvgate load-test result file")
    return result


def machine_description() -> str:
    """CPU, cores and memory (and the GPU when there is one), for reports and docs/benchmarks.md."""
    gpu = benchdoc.gpu_description()
    return benchdoc.machine_description() + (f", GPU: {gpu}" if gpu else "") + f", Python {platform.python_version()}"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def comparison_table(results: Sequence[dict[str, Any]]) -> str:
    """One Markdown row per run: hit rate (and vs oracle), TTFT percentiles, throughput, goodput, load."""
    head = ("| run | hit rate | hit rate / oracle | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | "
            "throughput (req/s) | goodput (req/s) | max/mean worker load | errors |")
    rows = [head, "|" + "---|" * 10]
    for r in results:
        s = r["summary"]
        hit = s.get("prefix_hit_rate")
        oracle = (r.get("oracle") or {}).get("hit_rate")
        vs_oracle = hit / oracle if hit is not None and oracle else None
        load = (s.get("workers") or {}).get("max_over_mean")
        ttft = s["ttft_ms"]
        rows.append(f"| {r['name']} | {_fmt(hit, 3)} | {_fmt(vs_oracle, 2)} | {_fmt(ttft['p50'])} | "
                    f"{_fmt(ttft['p90'])} | {_fmt(ttft['p99'])} | {_fmt(s['throughput_rps'], 2)} | "
                    f"{_fmt(s['goodput_rps'], 2)} | {_fmt(load, 2)} | {s['num_errors']} |")
    return "\n".join(rows)


def run_summary_table(result: dict[str, Any]) -> str:
    """Latency percentiles of one run as a Markdown table."""
    s = result["summary"]
    rows = ["| metric | p50 | p90 | p99 | mean |", "|---|---|---|---|---|"]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        st = s[key]
        rows.append(f"| {key} | {_fmt(st['p50'])} | {_fmt(st['p90'])} | {_fmt(st['p99'])} | {_fmt(st['mean'])} |")
    return "\n".join(rows)


def write_report(results: Sequence[dict[str, Any]], out_dir: Path, title: str = "kvgate load test") -> Path:
    """report.md and its PNGs in out_dir, for one or several runs (several: with the comparison table)."""
    from loadtest.plots import write_plots

    out_dir = Path(out_dir)
    plots = write_plots(results, out_dir)
    first = results[0]
    lines = [f"# {title}", "", f"- command: `{first.get('command') or '-'}`", f"- machine: {first['machine']}",
             f"- date: {first['created_at']}", *([f"- {executor_line(first)}"] if executor_line(first) else []),
             "", "## Comparison", "", comparison_table(results), "", *_partition_lines(results)]
    for result in results:
        lines += [f"## {result['name']}", "", _run_facts(result), "", run_summary_table(result), ""]
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _run_facts(result: dict[str, Any]) -> str:
    s = result["summary"]
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    return (f"{s['num_requests']} requests, {s['num_ok']} ok, errors: {errors}; "
            f"{_fmt(s['output_tokens_per_s'])} output tokens/s; SLO attainment {_fmt(s['slo_attainment'], 3)}; "
            f"failovers {s.get('failovers', 0)}{router_facts(result.get('router'))}")


def router_facts(router: dict[str, Any] | None) -> str:
    """'; router prediction hit ratio R (P predicted / Q reported cached tokens)' for kvgate gateway runs."""
    if not router or router.get("predicted_cached_tokens") is None:
        return ""
    return (f"; router prediction hit ratio {_fmt(router.get('prediction_hit_ratio'), 3)} "
            f"({router['predicted_cached_tokens']} predicted / {router.get('reported_cached_tokens')} reported "
            f"cached tokens)")


def executor_line(result: dict[str, Any]) -> str | None:
    """What a fleet run's workers were: 'Figures from the sim executor, timing: NAME', or the real engine
    and its model (None for runs against a URL)."""
    fleet = (result.get("config") or {}).get("fleet") or {}
    executor = fleet.get("executor")
    if executor == "sim":
        return (f"Figures from the `sim` executor (timing model, no model math), timing: "
                f"{sim_timing_name(fleet.get('worker_args') or [])}.")
    if executor in REAL_ENGINES:
        return (f"Figures from real engines: {fleet.get('num_workers')} x {REAL_ENGINES[executor]}, model "
                f"`{fleet.get('worker_model')}`, each pinned to a CPU (round robin over this machine's).")
    return None


REAL_ENGINES = {"torch": "the bundled worker (`kvgate worker`, torch executor)", "vllm": "vLLM (CPU build)"}


def sim_timing_name(worker_args: Sequence[str]) -> str:
    """The `name=` of a `--sim-timing` worker argument; the default timing's name when there is none."""
    spec = None
    for i, arg in enumerate(worker_args):
        if arg.startswith("--sim-timing="):
            spec = arg.split("=", 1)[1]
        elif arg == "--sim-timing" and i + 1 < len(worker_args):
            spec = worker_args[i + 1]
    if spec is None:
        return f"default ({DEFAULT_SIM_TIMING_NAME}, docs/sim-calibration.md)"
    named = [pair.split("=", 1)[1] for pair in spec.split(",") if pair.strip().startswith("name=")]
    return named[0] if named else f"default with overrides `{spec}`"


DEFAULT_SIM_TIMING_NAME = "Llama-3.1-8B-Instruct bf16 on 1x H100 SXM 80GB under vLLM (estimated from public figures)"


def _partition_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """The static-partition reference (loadtest/oracle.py), where the run knew the fleet's KV capacity."""
    oracle = results[0].get("oracle") or {}
    partition, best = oracle.get("static_partition_hit_rate"), oracle.get("hit_rate")
    if partition is None or not best:
        return []
    return [f"Static partition with caches of this size (each prefix group on one worker, LRU, simulated over "
            f"the same requests): hit rate {partition:.3f}, {partition / best:.2f} of the oracle.", ""]


def write_benchmarks_section(doc_path: Path, name: str, results: Sequence[dict[str, Any]],
                             command: str, machine: str | None = None) -> None:
    """Replace (or append) the section between the bench:NAME markers with a table built from results,
    and write its plot beside the document (bench-NAME.png: hit rate / oracle and TTFT per run)."""
    executor = executor_line(results[0])
    plot = section_plot(results, doc_path.parent / f"bench-{name}.png")
    markdown = "\n".join([f"### {name}", "", f"Command: `{command}`", "",
                          f"Machine: {machine or results[0]['machine']}; run {results[0]['created_at']}.", "",
                          *([executor, ""] if executor else []),
                          comparison_table(results), "", *_partition_lines(results),
                          f"![hit rate / oracle and TTFT per run]({plot.name})"])
    benchdoc.replace_section(name, markdown, doc_path)
