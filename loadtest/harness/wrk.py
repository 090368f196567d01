"""wrk as the proxy benchmarks' load: its Lua script (one POST, a `BENCH {json}` line at the end), its
command line pinned to CPUs, one measured run with the CPU the proxy and any other work on the machine
took meanwhile."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from loadtest.harness.fixed_upstream import PATH, request_body
from loadtest.harness.gateway import API_KEY
from loadtest.procs import pin, process_cpu_s, tree_cpu_s


def wrk_script(stream: bool) -> str:
    """wrk's Lua: the POST, and a done() that prints one `BENCH {json}` line (latencies in us)."""
    return f"""wrk.method = "POST"
wrk.path = "{PATH}"
wrk.body = {json.dumps(request_body(stream))}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {API_KEY}"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('BENCH {{"requests": %d, "duration_us": %d, "bytes": %d, "errors_connect": %d, '
    .. '"errors_read": %d, "errors_write": %d, "errors_status": %d, "errors_timeout": %d, '
    .. '"p50_us": %.1f, "p90_us": %.1f, "p99_us": %.1f, "max_us": %.1f, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


def parse_wrk(stdout: str) -> dict[str, Any]:
    """The figures of one wrk run, from its `BENCH` line: requests/s counts only 2xx answers."""
    lines = [line for line in stdout.splitlines() if line.startswith("BENCH ")]
    if not lines:
        raise ValueError(f"no BENCH line in wrk's output:\n{stdout[-2000:]}")
    raw = json.loads(lines[-1][len("BENCH "):])
    errors = sum(v for k, v in raw.items() if k.startswith("errors_"))
    ok = raw["requests"] - raw["errors_status"]
    return {"requests": raw["requests"], "errors": errors, "requests_per_s": ok / (raw["duration_us"] / 1e6),
            "p50_ms": raw["p50_us"] / 1e3, "p90_ms": raw["p90_us"] / 1e3, "p99_ms": raw["p99_us"] / 1e3,
            "max_ms": raw["max_us"] / 1e3, "mean_ms": raw["mean_us"] / 1e3}


def wrk_argv(port: int, script: Path, connections: int, duration_s: int, cpus: set[int] | None) -> list[str]:
    """One wrk thread with `connections` keep-alive connections, on cpus (taskset) when given."""
    return [*pin(cpus), "wrk", "-t", "1", "-c", str(connections), "-d", f"{duration_s}s", "--timeout", "10s",
            "-s", str(script), f"http://127.0.0.1:{port}{PATH}"]


def run_wrk(argv: list[str]) -> dict[str, Any]:
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{(out.stdout + out.stderr)[-2000:]}")
    return parse_wrk(out.stdout)


def machine_busy_s() -> float:
    """CPU seconds all CPUs have spent busy since boot (user, nice, system, irq, softirq; not steal)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children: each wrk run once it ends
    return usage.ru_utime + usage.ru_stime


def measured_run(argv: list[str], pid: int | None, own_pids: list[int]) -> dict[str, Any]:
    """One wrk run, with the proxy's CPU seconds (pid None: none) and what other work on the machine
    took meanwhile (foreign_cores: busy CPU time not spent by the proxies, nginx or wrk, per second)."""
    started, busy, own, wrk = time.perf_counter(), machine_busy_s(), tree_cpu_s(own_pids), _children_cpu_s()
    proxy = process_cpu_s(pid) if pid else 0.0
    figures = run_wrk(argv)
    figures["proxy_cpu_s"] = process_cpu_s(pid) - proxy if pid else None
    ours = tree_cpu_s(own_pids) - own + _children_cpu_s() - wrk
    figures["foreign_cores"] = max(0.0, machine_busy_s() - busy - ours) / (time.perf_counter() - started)
    return figures
