"""Supervisor test helpers: ChildSpecs that run fake_child.py on a free port, and a supervisor script's READY line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvgate.supervisor import ChildSpec
from tests.conftest import free_port

FAKE_CHILD = str(Path(__file__).with_name("fake_child.py"))


def fake(name: str, *flags: str, critical: bool = False) -> tuple[ChildSpec, int]:
    port = free_port()
    argv = (sys.executable, FAKE_CHILD, str(port), *flags)
    return ChildSpec(name=name, argv=argv, health_url=f"http://127.0.0.1:{port}/health", critical=critical), port


def read_ready_pid(proc: subprocess.Popen) -> int:
    for line in proc.stdout:
        if line.startswith("READY"):
            return int(line.split()[1])
    raise AssertionError(f"supervisor exited with {proc.wait()} before its children were ready")
