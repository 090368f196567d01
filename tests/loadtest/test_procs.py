"""Child processes of load tests and tests (loadtest/procs.py): waiting until a child is healthy."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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


_OWNER = """
import sys, time
from pathlib import Path
from loadtest.procs import ChildProcess
child = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[1]))
try:
    print(child.popen.pid, flush=True)
    time.sleep(120)
finally:
    child.stop()
"""


def test_a_run_ended_by_sigterm_stops_the_children_it_started(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path / "sleeper.log")], stdout=subprocess.PIPE,
                             text=True)
    with owner.stdout:
        child_pid = int(owner.stdout.readline())

    owner.terminate()

    assert owner.wait(30) != 0
    deadline = time.monotonic() + 10
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child_pid)  # its own session: only the owner's unwinding could stop it


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
