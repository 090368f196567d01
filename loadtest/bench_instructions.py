"""The gateway's instructions per request, this checkout against another commit, under callgrind: a
comparison the machine's speed cannot move.

On this shared machine the gateway's CPU time per request drifts by 10-20% between runs minutes
apart (and 2-3x between hosts), so a change worth a few percent cannot be seen in req/s or CPU
seconds. Valgrind's callgrind counts the instructions the process executes in user space: two runs of
one build agree within about 1%. Kernel time (system calls, the loopback TCP stack) is not counted:
a change that saves a system call shows in strace, not here.

Each tree's gateway (its own code: the command runs in the tree, so `python -m` imports it) runs
under callgrind in front of bench_proxy's fixed-response nginx, as bench_proxy configures it; after a
warm-up, instrumentation is switched on for N sequential requests through one keep-alive connection,
then off, and the counts are dumped. The baseline is `git archive REV` unpacked in a temp folder, its C
extensions built there. Trees alternate (A B A B): a figure that differs between two runs of one tree
by more than the difference between trees is noise.

With --floor, each tree's floor proxy (bench_proxy's: uvicorn and kvgate's upstream client alone) is
counted once too, and the gateway's own work above it is compared: the part of the count a change to
the gateway's logic can move.

Run: .venv/bin/python -m loadtest.bench_instructions [--baseline REV] [--requests 300] [--stream] [--runs 2] [--floor]
Needs: valgrind (apt-get install -y valgrind), and nginx as bench_proxy does.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from loadtest.bench_gateway import API_KEY, MODEL, gateway_config
from loadtest.bench_proxy import PATH, floor_argv, floor_env, request_body, start_nginx
from loadtest.procs import ChildProcess, free_port
from loadtest.side_by_side import baseline_tree

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "results" / "bench_instructions.json"
WARMUP_REQUESTS = 50
_TOTALS = re.compile(r"^([\d,]+) \(100\.0+%\)\s+PROGRAM TOTALS", re.M)


def program_totals(annotated: str) -> int:
    """The instruction count of a callgrind dump, from callgrind_annotate's output."""
    found = _TOTALS.search(annotated)
    if found is None:
        raise ValueError("no PROGRAM TOTALS line in callgrind_annotate's output")
    return int(found.group(1).replace(",", ""))


def count(tree: Path, upstream_port: int, tmp_dir: Path, requests: int, stream: bool, tag: str,
          floor: bool = False) -> int:
    """Instructions per request of tree's gateway (floor: of bench_proxy's floor proxy instead, uvicorn and
    the upstream client alone) over `requests` sequential completions."""
    port = free_port()
    if floor:
        argv, env, ready = floor_argv(port), floor_env(upstream_port, tree), f"http://127.0.0.1:{port}/health"
    else:
        config = tmp_dir / f"gateway-{tag}.yaml"
        config.write_text(yaml.safe_dump({**gateway_config(port, upstream_port), "logging": {"requests": False}}))
        argv = [sys.executable, "-m", "kvgate", "gateway", "--config", str(config)]
        env, ready = {"KVGATE_API_KEY": API_KEY, "PYTHONPATH": str(tree)}, f"http://127.0.0.1:{port}/ready"
    out = tmp_dir / f"callgrind-{tag}.out"
    proxy = ChildProcess(f"proxy {tag}", [
        "env", "-C", str(tree), "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        *argv], tmp_dir / f"proxy-{tag}.log", ready, env=env)
    try:
        proxy.wait_healthy(600)
        pid = str(proxy.popen.pid)
        body = request_body(stream)
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120) as client:
            for n in range(WARMUP_REQUESTS + requests):
                if n == WARMUP_REQUESTS:
                    subprocess.run(["callgrind_control", "--instr=on", pid], capture_output=True, check=True)
                response = client.post(PATH, content=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{tag}: {response.status_code} {response.text[:300]}")
        subprocess.run(["callgrind_control", "--instr=off", pid], capture_output=True, check=True)
        subprocess.run(["callgrind_control", "--dump", pid], capture_output=True, check=True)
    finally:
        proxy.stop(timeout_s=30)
    dump = out.with_name(out.name + ".1")  # --dump's; `out` itself, written at exit, counts nothing instrumented
    annotated = subprocess.run(["callgrind_annotate", str(dump)], capture_output=True, text=True, check=True).stdout
    return round(program_totals(annotated) / requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="the commit to compare with (default: HEAD)")
    parser.add_argument("--requests", type=int, default=300, help="measured requests per run (default 300)")
    parser.add_argument("--runs", type=int, default=2, help="runs per tree, alternating (default 2)")
    parser.add_argument("--stream", action="store_true", help="streaming clients (default: non-streaming)")
    parser.add_argument("--floor", action="store_true",
                        help="also count each tree's floor proxy once (uvicorn and the upstream client alone: "
                             "bench_proxy's), and each gateway's own work above it")
    args = parser.parse_args()
    missing = [tool for tool in ("valgrind", "callgrind_control", "callgrind_annotate", "nginx") if not shutil.which(tool)]
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)} (apt-get install -y valgrind nginx-light libnginx-mod-http-echo)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        tmp_dir = Path(tmp)
        trees = {"baseline": baseline_tree(args.baseline, Path(tempfile.mkdtemp(dir=tmp_dir))), "this checkout": ROOT}
        upstream_port = free_port()
        nginx = start_nginx(upstream_port, tmp_dir, None)
        try:
            nginx.wait_healthy(10)
            runs: dict[str, list[int]] = {name: [] for name in trees}
            for index in range(args.runs):
                for name, tree in trees.items():
                    runs[name].append(count(tree, upstream_port, tmp_dir, args.requests, args.stream,
                                            f"{index}-{len(runs[name])}-{name.replace(' ', '-')}"))
                    print(f"{name}: {runs[name][-1]:,} instructions per request", file=sys.stderr, flush=True)
            floors = {name: count(tree, upstream_port, tmp_dir, args.requests, args.stream,
                                  f"floor-{name.replace(' ', '-')}", floor=True)
                      for name, tree in trees.items()} if args.floor else {}
        finally:
            nginx.stop()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {"baseline": args.baseline, "mode": "streaming" if args.stream else "non-streaming", "model": MODEL,
              "requests": args.requests, "runs": runs, "median": medians,
              "ratio": medians["this checkout"] / medians["baseline"], "wall_s": round(time.perf_counter() - started)}
    if floors:
        own = {name: medians[name] - floors[name] for name in trees}
        result.update(floor=floors, own_work=own, own_work_ratio=own["this checkout"] / own["baseline"])
    RESULTS_PATH.parent.mkdir(exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(result, indent=2))
    print(f"instructions per {result['mode']} request: baseline ({args.baseline}) {medians['baseline']:,.0f}, "
          f"this checkout {medians['this checkout']:,.0f} ({result['ratio']:.3f}x); runs: {runs}")
    if floors:
        print(f"the floor: baseline {floors['baseline']:,}, this checkout {floors['this checkout']:,}; the gateway's own "
              f"work above it: {own['baseline']:,.0f} -> {own['this checkout']:,.0f} ({result['own_work_ratio']:.3f}x)")


if __name__ == "__main__":
    main()
