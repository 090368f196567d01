"""SGLang's router (sglang-router, Rust) as a peer: its command line for a fixed upstream and as a fleet's
external router (`kvgate bench fleet --external-command`), and its start as a child process.
Installed into results/sglang-venv (peers.SGLANG_ROUTER)."""

from __future__ import annotations

from pathlib import Path

from loadtest.external_router import ExternalCommand
from loadtest.peers import SGLANG_ROUTER
from loadtest.procs import ChildProcess, free_port

LAUNCH = "-m sglang_router.launch_router"


def external_command(policy: str, *, name: str | None = None, python: str = "results/sglang-venv/bin/python",
                     log_level: str | None = "warn") -> ExternalCommand:
    """The router over a fleet's workers, as `kvgate bench fleet --external-command NAME=COMMAND` takes it:
    {worker_urls}, {port} and {metrics_port} are filled in by the fleet."""
    command = (f"{python} {LAUNCH} --host 127.0.0.1 --worker-urls {{worker_urls}} --policy {policy} "
               "--port {port} --prometheus-port {metrics_port}" + (f" --log-level {log_level}" if log_level else ""))
    return ExternalCommand(name or f"sglang-{policy}", command)


def fixed_upstream_argv(port: int, upstream_port: int, prometheus_port: int) -> list[str]:
    """The router as PEERS.md runs it in front of one fixed-response upstream: round robin, no health checks
    (a fake upstream), and no per-request log lines (kvgate writes none either)."""
    return [str(SGLANG_ROUTER.python), *LAUNCH.split(), "--worker-urls", f"http://127.0.0.1:{upstream_port}",
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(prometheus_port), "--disable-health-check", "--log-level", "warn"]


def start_fixed_upstream(name: str, port: int, upstream_port: int, log_dir: Path,
                         pin: list[str]) -> ChildProcess:
    argv = [*pin, *fixed_upstream_argv(port, upstream_port, free_port())]
    return ChildProcess(name, argv, log_dir / "sglang.log", f"http://127.0.0.1:{port}/v1/models")
