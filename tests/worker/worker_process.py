"""Start a real `kvgate worker` process on a loopback port for tests, and stop it afterwards."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from tests.conftest import free_port


@contextmanager
def running_worker(model: str | Path, *extra: str, startup_timeout_s: float = 120.0) -> Iterator[str]:
    """Yield the worker's base URL (http://127.0.0.1:PORT) once /health answers 200."""
    port = free_port()
    argv = [sys.executable, "-m", "kvgate", "worker", "--model", str(model), "--port", str(port), *extra]
    log = open(Path(f"/tmp/kvgate-test-worker-{port}.log"), "w+")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, startup_timeout_s, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"worker at {url} not healthy after {timeout_s} s")
