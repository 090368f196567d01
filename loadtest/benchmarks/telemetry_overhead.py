"""What the gateway's request log lines and traces cost, measured side by side in one run.

The proxy harness (loadtest/harness/proxies.py: a fixed-response nginx upstream, wrk, the gateway alone on
one CPU) runs four builds/configurations of kvgate's gateway in turn:
- "before #19": the gateway as it was before tracing and request logs existed (the tree at --baseline,
  extracted with `git archive`), on its default config;
- "log off": this tree with `logging.requests: false`, tracing off;
- "default": this tree as shipped: one JSON line per request (to a file, as a log shipper would read it),
  tracing off;
- "tracing on": the default plus `tracing.exporter: otlp`, every request sampled, spans sent in
  batches to the upstream nginx (which answers 200, as a collector would).
Reported per cell: requests/s, latency added to direct, and the gateway's CPU per request, each as a
ratio to "before #19" in the same run (CPU per request is the steadiest of the three on a shared
machine). "Tracing off costs nothing measurable" holds when "log off" is within the run's noise of
"before #19". Writes results/bench_telemetry.json and the "telemetry-overhead" section of
docs/benchmarks.md.
Run: kvgate bench telemetry-overhead [--quick] [--rounds N] [--baseline REF] [--no-doc]
Needs nginx with its echo module and wrk (loadtest/peers), and a git checkout (for the baseline tree).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import ExitStack
from io import BytesIO
from pathlib import Path
from typing import Any

import yaml

from loadtest.benchdoc import bench_command, machine_description, number, replace_section, save_result
from loadtest.harness.fixed_upstream import check_answers, start_nginx
from loadtest.harness.gateway import API_KEY, cpu_placement, gateway_config
from loadtest.harness.proxies import (CONNECTIONS, DIRECT, MODES, healthy, interference, measure, phase_seconds,
                                      summarise)
from loadtest.harness.wrk import wrk_script
from loadtest.paths import RESULTS_DIR, ROOT
from loadtest.peers import NGINX, NGINX_ECHO, WRK, require
from loadtest.procs import ChildProcess, free_port

SECTION = "telemetry-overhead"
RESULTS_PATH = RESULTS_DIR / "bench_telemetry.json"
ROUNDS = 4
DEFAULT_BASELINE = "bb1107f"  # the last commit before #19's tracing and request logs
BEFORE, LOG_OFF, DEFAULT, TRACING = "before #19", "log off", "default", "tracing on"
VARIANTS = {  # name -> config sections added to gateway's gateway config (BEFORE runs the baseline tree)
    BEFORE: {},
    LOG_OFF: {"logging": {"requests": False}},
    DEFAULT: {},
    TRACING: {"tracing": {"exporter": "otlp", "sample_ratio": 1.0}},  # endpoint: the upstream, filled in at start
}


def baseline_tree(ref: str, into: Path) -> Path:
    """The repository at ref, extracted (no checkout, no git state changed), with this tree's built
    router extensions copied in (their C sources are the same: checked)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    for built in (ROOT / "router").glob("*.so"):
        source = built.name.split(".")[0] + ".c"
        if (into / "router" / source).read_bytes() != (ROOT / "router" / source).read_bytes():
            sys.exit(f"router/{source} differs at {ref}: build the baseline's extensions first")
        shutil.copy(built, into / "router" / built.name)
    return into


def start_variant(name: str, port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None,
                  baseline: Path) -> ChildProcess:
    """One gateway variant on port in front of the upstream, pinned to cpus; request lines go to its log file."""
    config = gateway_config(port, upstream_port)
    for section, values in VARIANTS[name].items():
        config[section] = dict(values)
    if name == TRACING:
        config["tracing"]["endpoint"] = f"http://127.0.0.1:{upstream_port}"
    path = tmp_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {"KVGATE_API_KEY": API_KEY}
    cwd_tree = baseline if name == BEFORE else ROOT
    if name == BEFORE:  # its own packages ahead of the editable install of this tree
        env["PYTHONPATH"] = str(baseline)
    argv = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
    argv += [sys.executable, "-c", f"import os, sys; os.chdir({str(cwd_tree)!r}); sys.argv = ['kvgate', 'gateway', "
             f"'--config', {str(path)!r}]; from kvgate.cli import main; sys.exit(main())"]
    return ChildProcess(name, argv, tmp_dir / f"{name.replace(' ', '-').replace('#', '')}.log",
                        f"http://127.0.0.1:{port}/ready", env=env)


def ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """Per mode and connections, each variant against BEFORE: req/s, CPU per request, added p50."""
    out: dict[str, Any] = {}
    for mode, cells in figures.items():
        for connections, cell in cells.items():
            base = cell[BEFORE]
            out.setdefault(mode, {})[connections] = {
                name: {"requests_per_s": cell[name]["requests_per_s"] / base["requests_per_s"],
                       "cpu_per_request": (cell[name]["cpu_ms_per_request"] / base["cpu_ms_per_request"]
                                           if base["cpu_ms_per_request"] else None),
                       "added_p50_ms": cell[name]["added_p50_ms"] - base["added_p50_ms"]}
                for name in VARIANTS if name in cell}
    return out


def cpu_per_request_rounds(runs: list[dict[str, Any]]) -> dict[tuple[str, int, str], list[float]]:
    """(mode, connections, variant) -> the gateway's CPU ms per request in each round."""
    out: dict[tuple[str, int, str], list[float]] = {}
    for run in runs:
        if run["proxy"] != DIRECT and run["requests"]:
            out.setdefault((run["mode"], run["connections"], run["proxy"]), []).append(
                run["proxy_cpu_s"] * 1e3 / run["requests"])
    return out


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Tracing off against before #19: the mean over cells of "log off"'s CPU per request over "before
    #19"'s, beside the noise: the mean round-to-round spread (max / min - 1) of one gateway in one cell.
    "Nothing measurable" = the overhead is within that spread."""
    rounds = cpu_per_request_rounds(runs)
    cells = {(mode, connections) for mode, connections, _ in rounds}

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    off = mean([mean(rounds[(m, c, LOG_OFF)]) / mean(rounds[(m, c, BEFORE)]) for m, c in cells])
    log = mean([mean(rounds[(m, c, DEFAULT)]) / mean(rounds[(m, c, BEFORE)]) for m, c in cells])
    traced = mean([mean(rounds[(m, c, TRACING)]) / mean(rounds[(m, c, BEFORE)]) for m, c in cells])
    spread = mean([max(v) / min(v) - 1 for v in rounds.values() if len(v) > 1])
    return {"off_cpu_ratio": off, "default_cpu_ratio": log, "tracing_cpu_ratio": traced, "round_spread": spread,
            "off_pass": off - 1 <= spread}


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for mode, cells in result["figures"].items():
        for connections, cell in cells.items():
            for name in VARIANTS:
                f, r = cell[name], result["ratios"][mode][connections][name]
                rows.append(f"| {mode} | {connections} | {name} | {f['requests_per_s']:,.0f} | "
                            f"{r['requests_per_s']:.2f}x | {number(f['cpu_ms_per_request'], 3)} | "
                            f"{number(r['cpu_per_request'])}x | {number(f['added_p50_ms'], 3)} | {f['errors']} |")
    i, v = result["interference"], result["verdict"]
    return f"""## What request logs and traces cost the gateway

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; figures from one run)
Date: {result['date']}

The proxy harness of the "Proxy overhead" section (nginx answering at once, wrk, the gateway alone on CPU
{', '.join(map(str, result['cpus']['gateway'])) or '-'}), four gateways in turn: **before #19** (the tree at
`{result['baseline']}`, before tracing and request logs existed), **log off** (`logging.requests: false`, tracing
off), **default** (as shipped: one JSON line per request to a file, tracing off) and **tracing on** (the default
plus `tracing.exporter: otlp`, every request sampled, batches sent to the upstream nginx). {result['rounds']}
rounds, {result['duration_s']:g} s per run, the order mirrored every second round; medians. Ratios are to
"before #19" in the same cell; "added p50" is the latency added to direct. Other work on the machine:
{i['median_cores']:.2f} cores in the median run, {i['max_cores']:.2f} in the worst.

| mode | connections | gateway | req/s | req/s vs before | CPU ms/req | CPU/req vs before | added p50 ms | failed |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Mean over the cells of CPU per request against "before #19": log off {v['off_cpu_ratio']:.3f}x, default
{v['default_cpu_ratio']:.3f}x, tracing on {v['tracing_cpu_ratio']:.2f}x. The noise: one gateway's CPU per request
differs between rounds of the same cell by {v['round_spread'] * 100:.1f}% on average (max / min).

| target (issue #19) | value | target | result |
|---|---|---|---|
| tracing off costs nothing measurable: CPU per request, log off / before #19 | {v['off_cpu_ratio']:.3f}x | within the round-to-round spread ({1 + v['round_spread']:.3f}x) | {'pass' if v['off_pass'] else 'FAIL'} |

Raw figures: `results/bench_telemetry.json`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench telemetry-overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s runs (a smoke run; figures are noisier)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the git ref of the 'before #19' gateway")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds over every cell (default {ROUNDS})")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    require(NGINX, NGINX_ECHO, WRK)
    duration_s, warmup_s = phase_seconds(args.quick)
    gateway_cpus, load_cpus = cpu_placement()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-telemetry-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        baseline = baseline_tree(args.baseline, tmp_dir / "baseline")
        scripts = {mode: tmp_dir / f"{mode}.lua" for mode in MODES}
        for mode, path in scripts.items():
            path.write_text(wrk_script(mode == "streaming"))
        nginx_port = free_port()
        nginx = healthy(stack, start_nginx(nginx_port, tmp_dir, load_cpus))
        targets: dict[str, tuple[int, int | None]] = {DIRECT: (nginx_port, None)}
        for name in VARIANTS:
            port = free_port()
            proc = healthy(stack, start_variant(name, port, nginx_port, tmp_dir, gateway_cpus, baseline))
            targets[name] = (port, proc.popen.pid)
            check_answers(name, port)
        runs = measure(targets, scripts, duration_s, warmup_s, load_cpus,
                       [nginx.popen.pid, *(pid for _, pid in targets.values() if pid)], rounds=args.rounds)
    figures = summarise(runs)
    result = {"benchmark": SECTION, "command": bench_command("telemetry-overhead", [
                  *(["--quick"] if args.quick else []), *(["--rounds", str(args.rounds)] if args.rounds != ROUNDS else []),
                  *(["--baseline", args.baseline] if args.baseline != DEFAULT_BASELINE else [])]),
              "machine": machine_description(), "baseline": args.baseline,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "wall_s": round(time.time() - started, 1), "rounds": max(r["round"] for r in runs),
              "duration_s": duration_s, "connections": list(CONNECTIONS),
              "cpus": {"gateway": sorted(gateway_cpus or []), "load": sorted(load_cpus or [])},
              "figures": figures, "ratios": ratios(figures), "verdict": verdict(runs),
              "interference": interference(runs), "raw": runs}
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(result["verdict"], indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
