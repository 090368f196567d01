"""Child processes of load tests and tests (loadtest/procs.py): waiting until a child is healthy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtest.procs import wait_healthy
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # each test spawns a child process


def test_returns_once_the_health_url_answers_200():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/", server, timeout_s=30)
    finally:
        server.kill()
        server.wait()


def test_a_child_that_exits_first_is_reported_with_its_log_tail():
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="^w0 exited with 3:\nlast words$"):
        wait_healthy(f"http://127.0.0.1:{free_port()}/health", child, timeout_s=30, name="w0",
                     log_tail=lambda: "last words")


def test_a_child_that_never_answers_times_out():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match="not healthy at .* after 0.3 s"):
            wait_healthy(f"http://127.0.0.1:{free_port()}/health", child, timeout_s=0.3)
    finally:
        child.kill()
        child.wait()
