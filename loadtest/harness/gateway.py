"""The gateway as benchmarks run it: its config in front of one fake worker (kv_aware, no tokenizer), its
command line, the CPUs it gets apart from the load, and child processes that are healthy before use."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from loadtest.paths import ROOT
from loadtest.procs import wait_healthy

MODEL = "bench-model"

API_KEY = "bench-key"


def cpu_placement() -> tuple[set[int] | None, set[int] | None]:
    """(gateway CPUs, CPUs of the fake worker and the load generator): the gateway gets a CPU of
    its own, as a production proxy process would, so the load generator's and the fake worker's
    bursts do not preempt it; the direct baseline runs with the same placement. None, None on a
    single CPU (nothing to separate)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def _pinned(cpus: set[int] | None):
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@contextmanager
def child(argv: list[str], port: int, path: str, log_dir: Path, env: dict | None = None,
          cpus: set[int] | None = None) -> Iterator[subprocess.Popen]:
    log = open(log_dir / f"{port}.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, preexec_fn=_pinned(cpus))
    try:
        wait_healthy(f"http://127.0.0.1:{port}{path}", proc, 60.0, name=f"process on port {port}")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

# Admission out of the way: this benchmark measures what the gateway adds and holds (1,000 streams at once),
# not what its admission control would shed in front of one worker (by default it queues 256 and sheds the rest)
WIDE_ADMISSION = {"max_concurrency": 2000, "initial_concurrency": 2000, "queue_size": 2000}


def gateway_config(gateway_port: int, worker_port: int, admission: dict[str, Any] | None = None) -> dict[str, Any]:
    pool: dict[str, Any] = {"model": MODEL, "tokenizer": None, "policy": {"type": "kv_aware"},
                            "workers": [{"name": "w0", "url": f"http://127.0.0.1:{worker_port}", "block_size": 16}]}
    if admission is not None:
        pool["admission"] = admission
    return {
        "gateway": {"host": "127.0.0.1", "port": gateway_port},
        "pools": {"default": pool},
        "upstream": {"first_byte_timeout_s": 30.0, "idle_timeout_s": 30.0},
    }


def gateway_argv(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "kvgate", "gateway", "--config", str(config_path)]
