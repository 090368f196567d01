"""The gateway's instructions per request, this checkout against another commit, under callgrind: a
comparison the machine's speed cannot move.

On this shared machine the gateway's CPU time per request drifts by 10-20% between runs minutes
apart (and 2-3x between hosts), so a change worth a few percent cannot be seen in req/s or CPU
seconds. Valgrind's callgrind counts the instructions the process executes in user space: two runs of
one build agree within about 1%. Kernel time (system calls, the loopback TCP stack) is not counted:
a change that saves a system call shows in strace, not here.

Each tree's gateway (its own code: the command runs in the tree, so `python -m` imports it) runs
under callgrind in front of proxy-peers's fixed-response nginx, as proxy-peers configures it; after a
warm-up, instrumentation is switched on for N sequential requests through one keep-alive connection,
then off, and the counts are dumped. The baseline is `git archive REV` unpacked in a temp folder, its C
extensions built there. Trees alternate (A B A B): a figure that differs between two runs of one tree
by more than the difference between trees is noise.

With --floor, each tree's floor proxy (proxy-peers's: uvicorn and kvgate's upstream client alone) is
counted once too, and the gateway's own work above it is compared: the part of the count a change to
the gateway's logic can move.

With --paced, the proxy harness's nginx gives way to a live stream: each tree's gateway, as
prompt-cpu runs it, in front of one sim worker streaming a token a read at its pace (stream-pace's
cell), counts streamed completions of SHORT and LONG tokens; a token = the difference / (LONG - SHORT), the
time-bound work that runs meanwhile (health checks, scrapes) included; KV events not (the worker has every
prompt cached before the first count).

Run: kvgate bench instructions [--baseline REV] [--requests N] [--stream] [--runs 2] [--floor | --paced]
Needs valgrind, and (but with --paced) nginx with its echo module: loadtest/peers names what is missing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from loadtest.benchdoc import save_result
from loadtest.harness.fixed_upstream import PATH, request_body, start_nginx
from loadtest.harness.gateway import API_KEY, MODEL, gateway_config
from loadtest.harness.prompt_cells import CELL, CELLS, LONG, SHORT, request_bodies, send, start_worker
from loadtest.harness.prompt_cells import gateway_config as prompt_cells_gateway_config
from loadtest.harness.proxies import floor_argv, floor_env
from loadtest.harness.side_by_side import baseline_tree
from loadtest.paths import RESULTS_DIR, ROOT
from loadtest.peers import NGINX, NGINX_ECHO, VALGRIND, require
from loadtest.procs import ChildProcess, free_port

RESULTS_PATH = RESULTS_DIR / "bench_instructions.json"
WARMUP_REQUESTS = 50
REQUESTS = 300  # measured on the proxy harness, a run
PACED_REQUESTS = 20  # of each length with --paced (~30 s a run under callgrind)
_TOTALS = re.compile(r"^([\d,]+) \(100\.0+%\)\s+PROGRAM TOTALS", re.M)


def program_totals(annotated: str) -> int:
    """The instruction count of a callgrind dump, from callgrind_annotate's output."""
    found = _TOTALS.search(annotated)
    if found is None:
        raise ValueError("no PROGRAM TOTALS line in callgrind_annotate's output")
    return int(found.group(1).replace(",", ""))


class CallgrindChild:
    """A proxy process under callgrind, instrumentation off until on(); dump() returns the instructions
    counted since on(), and switches it off again."""

    def __init__(self, tree: Path, argv: list[str], env: dict[str, str], ready_url: str, tmp_dir: Path,
                 tag: str) -> None:
        self.out = tmp_dir / f"callgrind-{tag}.out"
        self.dumps = 0
        self.proc = ChildProcess(f"proxy {tag}", [
            "env", "-C", str(tree), "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={self.out}", *argv], tmp_dir / f"proxy-{tag}.log", ready_url, env=env)
        try:
            self.proc.wait_healthy(600)
        except BaseException:
            self.proc.stop(timeout_s=30)
            raise

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.proc.popen.pid)], capture_output=True, check=True)

    def on(self) -> None:
        self._control("--instr=on")

    def dump(self) -> int:
        self._control("--instr=off")
        self._control("--dump")
        self.dumps += 1
        dump = self.out.with_name(f"{self.out.name}.{self.dumps}")  # `out` itself, written at exit, counts nothing
        annotated = subprocess.run(["callgrind_annotate", str(dump)], capture_output=True, text=True,
                                   check=True).stdout
        return program_totals(annotated)

    def stop(self) -> None:
        self.proc.stop(timeout_s=30)


def gateway_argv(tree: Path, config: dict, tmp_dir: Path, tag: str) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, ready URL) of tree's gateway with config."""
    path = tmp_dir / f"gateway-{tag}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "kvgate", "gateway", "--config", str(path)]
    port = config["gateway"]["port"]
    return argv, {"KVGATE_API_KEY": API_KEY, "PYTHONPATH": str(tree)}, f"http://127.0.0.1:{port}/ready"


def count(tree: Path, upstream_port: int, tmp_dir: Path, requests: int, stream: bool, tag: str,
          floor: bool = False) -> int:
    """Instructions per request of tree's gateway (floor: of proxy-peers's floor proxy instead, uvicorn and
    the upstream client alone) over `requests` sequential completions."""
    port = free_port()
    if floor:
        argv, env, ready = floor_argv(port), floor_env(upstream_port, tree), f"http://127.0.0.1:{port}/health"
    else:
        argv, env, ready = gateway_argv(tree, {**gateway_config(port, upstream_port), "logging": {"requests": False}},
                                        tmp_dir, tag)
    proxy = CallgrindChild(tree, argv, env, ready, tmp_dir, tag)
    try:
        body = request_body(stream)
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=120) as client:
            for n in range(WARMUP_REQUESTS + requests):
                if n == WARMUP_REQUESTS:
                    proxy.on()
                response = client.post(PATH, content=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{tag}: {response.status_code} {response.text[:300]}")
            return round(proxy.dump() / requests)
    finally:
        proxy.stop()


def count_paced(tree: Path, worker_port: int, kv_port: int, tmp_dir: Path, requests: int, tag: str) -> dict[str, float]:
    """Instructions of tree's gateway (as prompt-cpu runs it: kv_aware, SmolLM2's tokenizer, KV events)
    a streamed completion of SHORT and of LONG tokens from a sim worker at its pace (stream-pace's
    cell), `requests` of each, and a token's: (LONG's - SHORT's) / (LONG - SHORT), the time-bound work that
    runs meanwhile (health checks, scrapes) included, as stream-pace counts CPU. The worker holds every
    prompt and answer in its cache already (paced_bodies), so no run counts KV events: each run sees the same
    worker, where new prompts would fill its cache a little more each run (eviction events in later runs)."""
    port = free_port()
    argv, env, ready = gateway_argv(tree, prompt_cells_gateway_config(port, worker_port, kv_port), tmp_dir, tag)
    proxy = CallgrindChild(tree, argv, env, ready, tmp_dir, tag)
    try:
        figures = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=300) as client:
            for tokens in (SHORT, LONG):
                first, *bodies = paced_bodies(tokens, requests)
                send(client, first)  # warms the tokenizer's prefix cache
                proxy.on()
                for body in bodies:
                    if send(client, body) != tokens:
                        raise RuntimeError(f"{tag}: an answer of other than {tokens} tokens")
                figures[tokens] = proxy.dump() / requests
        return {"short": figures[SHORT], "long": figures[LONG],
                "token": (figures[LONG] - figures[SHORT]) / (LONG - SHORT)}
    finally:
        proxy.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench instructions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="the commit to compare with (default: HEAD)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"measured requests per run (default {REQUESTS}; --paced: {PACED_REQUESTS} of each length)")
    parser.add_argument("--runs", type=int, default=2, help="runs per tree, alternating (default 2)")
    parser.add_argument("--stream", action="store_true", help="streaming clients (default: non-streaming)")
    parser.add_argument("--floor", action="store_true",
                        help="also count each tree's floor proxy once (uvicorn and the upstream client alone: "
                             "proxy-peers's), and each gateway's own work above it")
    parser.add_argument("--paced", action="store_true",
                        help=f"streamed completions from a sim worker at its pace, {SHORT} and {LONG} tokens "
                             "(stream-pace's cell): instructions a request and a token")
    args = parser.parse_args(argv)
    require(VALGRIND, *(() if args.paced else (NGINX, NGINX_ECHO)))  # valgrind brings callgrind_control and _annotate
    if args.paced and args.floor:
        parser.error("--floor counts the proxy harness's floor; not with --paced")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        tmp_dir = Path(tmp)
        trees = {"baseline": baseline_tree(args.baseline, Path(tempfile.mkdtemp(dir=tmp_dir))), "this checkout": ROOT}
        if args.paced:
            result = paced_runs(trees, tmp_dir, args.runs, args.requests or PACED_REQUESTS)
        else:
            result = harness_runs(trees, tmp_dir, args.runs, args.requests or REQUESTS, args.stream, args.floor)
    result.update(baseline=args.baseline, wall_s=round(time.perf_counter() - started))
    save_result(RESULTS_PATH, result)
    medians, runs = result["median"], result["runs"]
    if args.paced:
        for unit in ("token", "short", "long"):
            what = "a token" if unit == "token" else f"a {SHORT if unit == 'short' else LONG}-token request"
            base, mine = medians["baseline"][unit], medians["this checkout"][unit]
            print(f"instructions {what} at a live pace: baseline ({args.baseline}) {base:,.0f}, this checkout "
                  f"{mine:,.0f} ({mine / base:.3f}x)")
        print(f"runs: {runs}")
        return
    print(f"instructions per {result['mode']} request: baseline ({args.baseline}) {medians['baseline']:,.0f}, "
          f"this checkout {medians['this checkout']:,.0f} ({result['ratio']:.3f}x); runs: {runs}")
    if "floor" in result:
        floors, own = result["floor"], result["own_work"]
        print(f"the floor: baseline {floors['baseline']:,}, this checkout {floors['this checkout']:,}; the gateway's own "
              f"work above it: {own['baseline']:,.0f} -> {own['this checkout']:,.0f} ({result['own_work_ratio']:.3f}x)")


def harness_runs(trees: dict[str, Path], tmp_dir: Path, num_runs: int, requests: int, stream: bool,
                 floor: bool) -> dict:
    """Each tree's gateway on the proxy harness (nginx answering at once), num_runs times alternating."""
    upstream_port = free_port()
    nginx = start_nginx(upstream_port, tmp_dir, None)
    try:
        nginx.wait_healthy(10)
        runs: dict[str, list[int]] = {name: [] for name in trees}
        for index in range(num_runs):
            for name, tree in trees.items():
                runs[name].append(count(tree, upstream_port, tmp_dir, requests, stream,
                                        f"{index}-{len(runs[name])}-{name.replace(' ', '-')}"))
                print(f"{name}: {runs[name][-1]:,} instructions per request", file=sys.stderr, flush=True)
        floors = {name: count(tree, upstream_port, tmp_dir, requests, stream, f"floor-{name.replace(' ', '-')}",
                              floor=True) for name, tree in trees.items()} if floor else {}
    finally:
        nginx.stop()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {"mode": "streaming" if stream else "non-streaming", "model": MODEL, "requests": requests, "runs": runs,
              "median": medians, "ratio": medians["this checkout"] / medians["baseline"]}
    if floors:
        own = {name: medians[name] - floors[name] for name in trees}
        result.update(floor=floors, own_work=own, own_work_ratio=own["this checkout"] / own["baseline"])
    return result


def paced_bodies(tokens: int, requests: int) -> list[dict]:
    """The streamed completions of each --paced run of `tokens` (the same every run): a warm-up and `requests`."""
    kind, shared_words, own_words = CELLS[CELL]
    return request_bodies(kind, shared_words, own_words, tokens, tokens, requests)


def paced_runs(trees: dict[str, Path], tmp_dir: Path, num_runs: int, requests: int) -> dict:
    """Each tree's gateway in front of one sim worker at its pace, num_runs times alternating."""
    worker, worker_port, kv_port = start_worker(tmp_dir, None)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{worker_port}", timeout=300) as client:
            for tokens in (SHORT, LONG):  # every prompt and answer into the worker's cache, before any count
                for body in paced_bodies(tokens, requests):
                    send(client, body)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for index in range(num_runs):
            for name, tree in trees.items():
                figures = count_paced(tree, worker_port, kv_port, tmp_dir, requests,
                                      f"paced-{index}-{name.replace(' ', '-')}")
                runs[name].append(figures)
                print(f"{name}: {figures['token']:,.0f} instructions a token ({figures['short']:,.0f} a "
                      f"{SHORT}-token request)", file=sys.stderr, flush=True)
    finally:
        worker.stop()
    medians = {name: {unit: statistics.median(run[unit] for run in tree_runs) for unit in ("short", "long", "token")}
               for name, tree_runs in runs.items()}
    return {"mode": "paced", "cell": CELL, "tokens": [SHORT, LONG], "requests": requests, "runs": runs,
            "median": medians}


if __name__ == "__main__":
    main()
