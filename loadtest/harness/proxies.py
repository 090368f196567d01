"""Proxies side by side in front of the fixed-response upstream (harness/fixed_upstream.py), loaded by wrk:
kvgate's gateway, the floor of a Python proxy on kvgate's HTTP stack, sglang-router and LiteLLM; each
started pinned and healthy, every cell (mode x connections) run through each in turn with the order
mirrored every second round, and the figures each proxy adds to direct. Used by the proxy-peers and
telemetry-overhead benchmarks and the instruction counter."""

from __future__ import annotations

import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from loadtest.harness.gateway import API_KEY, MODEL, gateway_config
from loadtest.harness.wrk import measured_run, run_wrk, wrk_argv
from loadtest.paths import ROOT
from loadtest.peers import LITELLM as LITELLM_PEER
from loadtest.peers import SGLANG_ROUTER, litellm, sglang
from loadtest.peers.proxy_floor import UPSTREAM_ENV
from loadtest.procs import ChildProcess, free_port, pin

DIRECT, KVGATE, FLOOR, SGLANG, LITELLM = "direct", "kvgate", "python floor", "sglang-router", "litellm"
MODES = ("non-streaming", "streaming")
CONNECTIONS = (1, 32)
NUM_ROUNDS = 2


def start_kvgate(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    """kvgate's gateway as gateway runs it: one uvicorn process, kv_aware, `tokenizer: null`; no
    request log lines, as the peers here write none (sglang-router at `--log-level warn`, LiteLLM without
    an access log). telemetry-overhead measures what the log costs."""
    config = tmp_dir / "gateway.yaml"
    config.write_text(yaml.safe_dump({**gateway_config(port, upstream_port), "logging": {"requests": False}}))
    argv = [*pin(cpus), sys.executable, "-m", "kvgate", "gateway", "--config", str(config)]
    return ChildProcess(KVGATE, argv, tmp_dir / "kvgate.log", f"http://127.0.0.1:{port}/ready",
                        env={"KVGATE_API_KEY": API_KEY})


def floor_argv(port: int) -> list[str]:
    """The floor of a proxy on kvgate's HTTP stack (loadtest/peers/proxy_floor.py): uvicorn as kvgate runs it,
    kvgate's upstream client, and nothing else; its upstream is in the environment (floor_env)."""
    return [sys.executable, "-m", "uvicorn", "--factory", "loadtest.peers.proxy_floor:create_app", "--host", "127.0.0.1",
            "--port", str(port), "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]


def floor_env(upstream_port: int, tree: Path = ROOT) -> dict[str, str]:
    return {UPSTREAM_ENV: f"http://127.0.0.1:{upstream_port}", "PYTHONPATH": str(tree)}


def start_floor(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    return ChildProcess(FLOOR, [*pin(cpus), *floor_argv(port)], tmp_dir / "floor.log",
                        f"http://127.0.0.1:{port}/health", env=floor_env(upstream_port))


def start_sglang(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    return sglang.start_fixed_upstream(SGLANG, port, upstream_port, tmp_dir, pin(cpus))


def start_litellm(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    return litellm.start(LITELLM, MODEL, port, upstream_port, tmp_dir, pin(cpus))


STARTERS = {KVGATE: start_kvgate, FLOOR: start_floor, SGLANG: start_sglang, LITELLM: start_litellm}


def versions() -> dict[str, str | None]:
    def first_line(argv: list[str]) -> str:
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        return (out.stdout + out.stderr).strip().splitlines()[0]

    return {"nginx": first_line(["nginx", "-v"]).removeprefix("nginx version: "),
            "wrk": first_line(["wrk", "-v"]).split(" [")[0],
            "sglang-router": SGLANG_ROUTER.version(), "litellm": LITELLM_PEER.version(),
            "python": sys.version.split()[0]}


def measure(targets: dict[str, tuple[int, int | None]], scripts: dict[str, Path], duration_s: int,
            warmup_s: int, load_cpus: set[int] | None, own_pids: list[int],
            rounds: int = NUM_ROUNDS) -> list[dict[str, Any]]:
    """Every cell (mode x connections) through every proxy (port, pid; no pid: direct), the proxies'
    order mirrored every second round; each measured run follows a warm-up run of the same load.
    own_pids: every process this run started (proxies, nginx), to tell other work's CPU use apart."""
    runs = []
    for index in range(rounds):
        order = list(targets) if index % 2 == 0 else list(targets)[::-1]
        for mode in MODES:
            for connections in CONNECTIONS:
                for proxy in order:
                    port, pid = targets[proxy]
                    run_wrk(wrk_argv(port, scripts[mode], connections, warmup_s, load_cpus))
                    figures = measured_run(wrk_argv(port, scripts[mode], connections, duration_s, load_cpus), pid,
                                           own_pids)
                    run = {"round": index + 1, "proxy": proxy, "mode": mode, "connections": connections,
                           "duration_s": duration_s, **figures}
                    runs.append(run)
                    print(f"round {index + 1} {mode} c={connections} {proxy}: {figures['requests_per_s']:.0f} req/s, "
                          f"p50 {figures['p50_ms']:.3f} ms, p99 {figures['p99_ms']:.3f} ms, "
                          f"other work {figures['foreign_cores']:.2f} cores", file=sys.stderr)
    return runs


def _cell(runs: list[dict[str, Any]], mode: str, connections: int, proxy: str) -> list[dict[str, Any]]:
    return sorted((r for r in runs if (r["mode"], r["connections"], r["proxy"]) == (mode, connections, proxy)),
                  key=lambda r: r["round"])


def proxy_figures(mine: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, Any]:
    """One proxy in one cell: medians over rounds; "added" = this proxy minus direct in the same round."""
    direct_by_round = {r["round"]: r for r in direct}

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    def added(key: str) -> float | None:
        return median([r[key] - direct_by_round[r["round"]][key] for r in mine if r["round"] in direct_by_round])

    cpu = [r["proxy_cpu_s"] for r in mine]
    return {"requests_per_s": median([r["requests_per_s"] for r in mine]),
            "requests_per_s_rounds": [r["requests_per_s"] for r in mine],
            "p50_ms": median([r["p50_ms"] for r in mine]), "p99_ms": median([r["p99_ms"] for r in mine]),
            "added_p50_ms": added("p50_ms"), "added_p99_ms": added("p99_ms"),
            "cpu_busy": median([c / r["duration_s"] if c is not None else None for c, r in zip(cpu, mine)]),
            "cpu_ms_per_request": median([c * 1e3 / r["requests"] if c is not None and r["requests"] else None
                                          for c, r in zip(cpu, mine)]),
            "errors": sum(r["errors"] for r in mine)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """{mode: {connections: {proxy: figures}}} for every cell and proxy the runs hold."""
    figures: dict[str, Any] = {}
    proxies = dict.fromkeys([DIRECT, *(r["proxy"] for r in runs)])
    for mode in MODES:
        for connections in CONNECTIONS:
            direct = _cell(runs, mode, connections, DIRECT)
            cell = {proxy: proxy_figures(mine, direct) for proxy in proxies
                    if (mine := _cell(runs, mode, connections, proxy))}
            if cell:
                figures.setdefault(mode, {})[str(connections)] = cell
    return figures


def interference(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Other work's CPU use during the measured runs, in cores: the median run's and the worst run's."""
    foreign = [r["foreign_cores"] for r in runs]
    return {"median_cores": statistics.median(foreign), "max_cores": max(foreign)}


def start_proxies(stack: ExitStack, names: list[str], upstream_port: int, tmp_dir: Path,
                  cpus: set[int] | None) -> dict[str, tuple[int, int | None]]:
    """Each proxy in front of the upstream, healthy: {name: (port, pid)}, direct first (no pid)."""
    targets: dict[str, tuple[int, int | None]] = {DIRECT: (upstream_port, None)}
    for name in names:
        port = free_port()
        proc = healthy(stack, STARTERS[name](port, upstream_port, tmp_dir, cpus))
        targets[name] = (port, proc.popen.pid)
    return targets


def phase_seconds(quick: bool) -> tuple[int, int]:
    """(measured, warm-up) seconds of each wrk run (wrk takes whole seconds)."""
    return (3, 1) if quick else (10, 1)


def healthy(stack: ExitStack, proc: ChildProcess) -> ChildProcess:
    """proc, stopped when the stack closes, once it answers its health URL."""
    stack.callback(proc.stop)
    proc.wait_healthy(120.0)  # LiteLLM takes ~10 s
    return proc
