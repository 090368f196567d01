"""Real kvgate processes on loopback ports for tests: workers, gateways, fake workers."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from loadtest.procs import wait_healthy
from tests.conftest import free_port


class Process:
    """A child process with its log file; `url` is its base URL."""

    def __init__(self, argv: list[str], url: str, env: dict | None = None) -> None:
        self.url = url
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvgate-test-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, path: str = "/health", timeout_s: float = 120.0) -> None:
        wait_healthy(f"{self.url}{path}", self.proc, timeout_s, name=self.url, log_tail=lambda: self.output()[-3000:])

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


@contextmanager
def running(process: Process, health_path: str = "/health") -> Iterator[Process]:
    try:
        process.wait_healthy(health_path)
        yield process
    finally:
        process.stop()


def worker_process(model: str | Path, *extra: str, port: int | None = None,
                   kv_events_port: int | None = None) -> Process:
    port = port or free_port()
    argv = [sys.executable, "-m", "kvgate", "worker", "--model", str(model), "--port", str(port), *extra]
    if kv_events_port is not None:
        argv += ["--kv-events-endpoint", f"tcp://127.0.0.1:{kv_events_port}"]
    return Process(argv, f"http://127.0.0.1:{port}")


@contextmanager
def running_worker(model: str | Path, *extra: str) -> Iterator[str]:
    """Yield the base URL of a real `kvgate worker` once /health answers 200."""
    with running(worker_process(model, *extra)) as process:
        yield process.url


def fake_worker_process(mode: str) -> Process:
    port = free_port()
    script = Path(__file__).parent / "gateway" / "fake_worker.py"
    return Process([sys.executable, str(script), str(port), mode], f"http://127.0.0.1:{port}")


def gateway_process(config: dict, tmp_dir: Path, api_key: str = "test-key", env: dict | None = None) -> Process:
    """`kvgate gateway` with config (a dict written as YAML); KVGATE_API_KEY=api_key; env: more variables."""
    import os

    port = free_port()
    config = {**config, "gateway": {**config.get("gateway", {}), "host": "127.0.0.1", "port": port}}
    path = tmp_dir / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "KVGATE_API_KEY": api_key, **(env or {})}
    return Process([sys.executable, "-m", "kvgate", "gateway", "--config", str(path)],
                   f"http://127.0.0.1:{port}", env=env)


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]
