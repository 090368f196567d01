"""kvgate's kv_aware beside SGLang's router on a real vLLM fleet whose caches cannot hold every hot
prefix, over several seeds (issue #17: hit rate above the static-partition bound and at least
sglang-router cache_aware's); with --engine sim, the same fleet of sim workers (seconds a seed).

One run swings by a few points of hit rate / oracle between seeds, so one run cannot tell which router
places prefixes better. This runs one `kvgate bench fleet` command per seed (2 vLLM CPU workers with 96
KV blocks of 32 tokens each, 3,072 tokens a worker, for 16 tenants with ~600-token prefixes: the
prefixes do not all fit) through kvgate
kv_aware and through sglang-router cache_aware, each on a fresh fleet, and judges the means over the
seeds. The static partition (each tenant on one worker, LRU caches of the fleet's size, simulated over
the same requests: loadtest/oracle.py) is the bound a router that only pins tenants reaches.

The sim fleet (`--engine sim`: the same command on 2 `sim` workers with vLLM's block size, timed as
an H100 serves an 8B model: a request in ~0.2 s where the CPU workers take seconds) replays the placement
decisions at the rate a GPU fleet makes them: there, a load signal that lags by a scrape interval
spans many requests, where on the CPU fleet it spans a fraction of one.

Writes results/fleet-seeds/seed-<S>/ (each run's own results and report) and the
"real-engines-fleet-seeds" section of docs/benchmarks.md (sim: results/sim-fleet-seeds/, section
"sim-fleet-seeds").
Run: kvgate bench fleet-seeds [--engine vllm|sim] [--seeds 1,2,3] [--no-doc | --doc-only]
(installs vLLM's CPU build into results/vllm-venv and needs sglang-router: loadtest/peers;
docs/loadtest.md, "Peer routers"; 6 to 16 minutes a seed on 2 cores: each run starts its vLLM workers;
sim: ~15 s a seed, 40 seeds by default.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.benchdoc import bench_command, machine_description, replace_section, save_result
from loadtest.peers import sglang
from loadtest.peers import SGLANG_ROUTER, require

SGLANG = f"sglang={sglang.external_command('cache_aware', log_level=None).command}"
RUN = ["--workers", "2", "--num-blocks", "96", "--policies", "kv_aware",
       "--external-command", SGLANG, "--workload", "multi_tenant_long_prefix", "--param", "num_tenants=16",
       "--param", "prefix_tokens=600", "--param", "output_tokens=16", "--param", "num_requests=160",
       "--param", "tenant_zipf=1.1", "--concurrency", "8", "--duration-s", "900"]


# a seed swings a router by 3-5 points: two 16-seed runs of one build differed by 1.4 points of the mean, two
# 40-seed runs (~10 minutes each on 2 cores) by 1.1 for kv_aware (its choices follow the timing) and 0.2 for
# sglang-router
SIM_SEEDS = ",".join(str(seed) for seed in range(1, 41))


@dataclass(frozen=True)
class Engine:
    """What differs between the vLLM fleet and the sim fleet: the command, where results go, the
    section, the default seeds and how the section describes the workers."""

    section: str
    out: Path
    fleet: list[str]
    seeds: str
    title: str
    workers: str


ENGINES = {
    "vllm": Engine("real-engines-fleet-seeds", Path("results/fleet-seeds"),
                   ["bench", "fleet", "--engine", "vllm", *RUN], "1,2,3", "a real vLLM fleet short of cache",
                   "2 vLLM CPU workers (SmolLM2-135M-Instruct\nfp32, 96 KV blocks of 32 tokens each: 3,072 tokens "
                   "a worker, vLLM's KV events to kvgate)"),
    "sim": Engine("sim-fleet-seeds", Path("results/sim-fleet-seeds"),
                  ["bench", "fleet", "--engine", "sim", "--worker-arg=--block-size=32", *RUN], SIM_SEEDS,
                  "a sim fleet short of cache",
                  "2 `sim` workers (timed as vLLM serves Llama-3.1-8B on an H100:\na request in ~0.2 s where the "
                  "CPU workers take seconds; 96 KV blocks of 32 tokens each: 3,072 tokens a worker, KV events\n"
                  "to kvgate)"),
}
FLEET = ENGINES["vllm"].fleet
ROUTERS = {"kv_aware": "kvgate kv_aware", "sglang": "sglang-router cache_aware"}
PREDICTION_TARGET = 0.97


def seed_figures(out: Path) -> dict[str, Any]:
    """Hit rate / oracle of each router and of the static partition, kvgate's prediction hit ratio,
    and each router's errors, TTFT p50 / p90 and requests/s, from one seed's results."""
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in ROUTERS}
    oracle = results["kv_aware"]["oracle"]
    figures: dict[str, Any] = {
        name: result["summary"]["prefix_hit_rate"] / oracle["hit_rate"] for name, result in results.items()}
    figures["static"] = oracle["static_partition_hit_rate"] / oracle["hit_rate"]
    figures["prediction"] = (results["kv_aware"].get("router") or {}).get("prediction_hit_ratio")
    figures["errors"] = {name: result["summary"]["num_errors"] for name, result in results.items()}
    figures["requests"] = {name: result["summary"]["num_requests"] for name, result in results.items()}
    figures["speed"] = {name: {"ttft_p50_ms": result["summary"]["ttft_ms"]["p50"],
                               "ttft_p90_ms": result["summary"]["ttft_ms"]["p90"],
                               "req_per_s": result["summary"]["throughput_rps"]} for name, result in results.items()}
    return figures


def speed_table(rows: list[dict[str, Any]]) -> str:
    """Each router's TTFT p50 / p90 and requests/s, means over the seeds (not judged: the target is
    the hit rate); empty for a run from before they were recorded."""
    if not all("speed" in row for row in rows):
        return ""
    lines = ["| router | TTFT p50 ms | TTFT p90 ms | req/s |", "|---|---|---|---|"]
    for name, label in ROUTERS.items():
        mean = {key: statistics.fmean(row["speed"][name][key] for row in rows)
                for key in ("ttft_p50_ms", "ttft_p90_ms", "req_per_s")}
        lines.append(f"| {label} | {mean['ttft_p50_ms']:.0f} | {mean['ttft_p90_ms']:.0f} | {mean['req_per_s']:.2f} |")
    return "Means over the seeds, not judged (8 requests in flight: requests/s follows the prefill each router\n" \
           "saves and how evenly it spreads the load):\n\n" + "\n".join(lines) + "\n\n"


def verdicts(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, bool]]:
    """(target, value, bound, pass) for the means over the seeds."""
    mean = {key: statistics.fmean(row[key] for row in rows) for key in ("kv_aware", "sglang", "static")}
    ratios = [row["prediction"] for row in rows if row["prediction"] is not None]
    prediction = min(ratios) if ratios else None
    return [
        ("kvgate kv_aware above the static partition (mean hit rate / oracle)",
         f"{mean['kv_aware']:.3f} vs {mean['static']:.3f}", "above", mean["kv_aware"] > mean["static"]),
        ("kvgate kv_aware / sglang-router cache_aware (mean hit rate / oracle)",
         f"{mean['kv_aware']:.3f} vs {mean['sglang']:.3f}", ">= 1x", mean["kv_aware"] >= mean["sglang"]),
        ("kvgate kv_aware: prediction hit ratio, lowest seed", "-" if prediction is None else f"{prediction:.3f}",
         f">= {PREDICTION_TARGET}", prediction is not None and prediction >= PREDICTION_TARGET),
    ]


def paired_gap(rows: list[dict[str, Any]]) -> str:
    """kvgate kv_aware less sglang-router cache_aware, seed by seed (both served the seed's requests):
    the mean and two standard errors of it, so a gap the seeds' spread can explain reads as such."""
    gaps = [row["kv_aware"] - row["sglang"] for row in rows]
    if len(gaps) < 2:
        return ""
    spread = 2 * statistics.stdev(gaps) / len(gaps) ** 0.5
    return (f"Seed by seed, kvgate kv_aware less sglang-router cache_aware: {statistics.fmean(gaps):+.3f} "
            f"+- {spread:.3f} (the mean over the seeds, two standard errors of it; {len(gaps)} seeds).\n\n")


def markdown(result: dict[str, Any]) -> str:
    rows, engine = result["seeds"], ENGINES[result.get("engine", "vllm")]
    table = "\n".join(
        f"| {row['seed']} | {row['kv_aware']:.3f} | {row['sglang']:.3f} | {row['static']:.3f} | "
        f"{'-' if row['prediction'] is None else format(row['prediction'], '.3f')} | "
        f"{row['errors']['kv_aware']} / {row['errors']['sglang']} |" for row in rows)
    means = " | ".join(f"{statistics.fmean(row[key] for row in rows):.3f}" for key in ("kv_aware", "sglang", "static"))
    targets = "\n".join(f"| {name} | {value} | {bound} | {'pass' if ok else 'FAIL'} |"
                        for name, value, bound, ok in verdicts(rows))
    speeds = speed_table(rows)
    return f"""## Routers on {engine.title}, over several seeds

Command: `{result['command']}`
Machine: {result['machine']}; run {result['date']}.

Each seed runs `{result['fleet_command']} --seed S`: {engine.workers}, 16 tenants
with ~600-token prefixes (zipf 1.1: ~9,600 tokens of prefixes in all), 160 requests, 8 in flight,
through kvgate kv_aware and through sglang-router cache_aware, each on a fresh fleet. Hit rate / oracle
(the oracle: every prefix computed once, an infinite cache, in full 32-token blocks, as the workers
share them), over the requests each router served.
Static partition: each tenant on one worker with LRU caches of this size, simulated over the same
requests. Errors: requests that failed (kvgate / sglang-router; a refusal is a 503).

| seed | kvgate kv_aware | sglang-router cache_aware | static partition | kvgate prediction hit ratio | errors |
|---|---|---|---|---|---|
{table}
| mean | {means} | | |

{paired_gap(rows)}{speeds}| target (issue #17) | value | target | result |
|---|---|---|---|
{targets}

Raw figures and each seed's report: `{engine.out}/seed-<S>/`."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvgate bench fleet-seeds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=ENGINES, default="vllm", help="the workers (default: vllm)")
    parser.add_argument("--seeds", help="comma-separated workload seeds (default: vllm 1,2,3; sim 1 to 40)")
    parser.add_argument("--no-doc", action="store_true", help="leave docs/benchmarks.md alone")
    parser.add_argument("--doc-only", action="store_true",
                        help="rewrite the section from the last run's result.json, running nothing")
    args = parser.parse_args(argv)
    engine = ENGINES[args.engine]
    if args.doc_only:
        replace_section(engine.section, markdown(json.loads((engine.out / "result.json").read_text())))
        return
    require(SGLANG_ROUTER)  # vLLM's CPU build installs itself on first use (peers/vllm.py)
    result: dict[str, Any] = {
        "command": bench_command("fleet-seeds", argv), "engine": args.engine,
        "fleet_command": shlex.join(["kvgate", *engine.fleet]), "machine": machine_description(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "seeds": []}
    for seed in (int(s) for s in (args.seeds or engine.seeds).split(",")):
        out = engine.out / f"seed-{seed}"
        print(f"[seed {seed}]", flush=True)
        subprocess.run([sys.executable, "-m", "kvgate", *engine.fleet, "--seed", str(seed), "--out", str(out),
                        "--no-progress"], check=True)
        result["seeds"].append({"seed": seed, **seed_figures(out)})
    save_result(engine.out / "result.json", result)
    text = markdown(result)
    print(text)
    if not args.no_doc:
        replace_section(engine.section, text)


if __name__ == "__main__":
    main()
