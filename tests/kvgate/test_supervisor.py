"""The supervisor on real child processes: health wait, crashes, clean shutdown, no orphans."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvgate.supervisor import ChildFailed, Supervisor
from tests.conftest import free_port
from tests.kvgate.fake_children import FAKE_CHILD, fake, read_ready_pid

pytestmark = pytest.mark.slow  # every test supervises real child processes


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is gone for our purposes once its state is Z
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_start_waits_until_every_child_is_healthy_then_stop_ends_them():
    slow, _ = fake("slow", "--health-after", "1.0")
    quick, _ = fake("quick")
    sup = Supervisor([slow, quick], out=io.StringIO())
    started = time.monotonic()
    try:
        sup.start()
        assert time.monotonic() - started >= 1.0
        assert all(c.process.poll() is None for c in sup.children)
    finally:
        sup.stop()
    assert all(c.process.returncode is not None for c in sup.children)


def test_child_that_crashes_during_startup_is_reported_with_its_last_log_lines():
    good, _ = fake("good")
    bad, _ = fake("bad", "--health-after", "60", "--crash-after", "0.5")
    sup = Supervisor([good, bad], out=io.StringIO())
    try:
        with pytest.raises(ChildFailed) as info:
            sup.start()
    finally:
        sup.stop()
    message = str(info.value)
    assert message.startswith("bad exited with code 3")
    assert "fake child: simulated crash" in message


def test_child_that_never_gets_healthy_times_out_with_a_clear_message():
    never, _ = fake("never", "--health-after", "600")
    sup = Supervisor([never], health_timeout_s=1.0, out=io.StringIO())
    try:
        with pytest.raises(ChildFailed, match=r"never did not become healthy at http://127\.0\.0\.1:\d+/health within 1 s"):
            sup.start()
    finally:
        sup.stop()


def test_worker_death_after_startup_is_reported_and_the_rest_keep_running():
    steady, _ = fake("steady")
    flaky, _ = fake("flaky", "--crash-after", "1.0")
    out = io.StringIO()
    sup = Supervisor([steady, flaky], out=out)
    sup.start()
    stopper = threading.Timer(2.5, sup.request_stop)
    stopper.start()
    try:
        assert sup.watch() == 0
    finally:
        sup.stop()
    assert "kvgate: flaky exited with code 3; last log lines:" in out.getvalue()


def test_critical_child_death_ends_the_stack_with_status_1():
    worker, _ = fake("worker")
    gateway, _ = fake("gateway", "--crash-after", "0.5", critical=True)
    sup = Supervisor([worker, gateway], out=io.StringIO())
    try:
        sup.start()
        assert sup.watch() == 1
    finally:
        sup.stop()
    assert sup.children[0].process.returncode is not None


def test_stop_kills_a_child_that_ignores_sigterm_and_its_grandchildren(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    stubborn, _ = fake("stubborn", "--ignore-term", "--grandchild", str(pidfile))
    sup = Supervisor([stubborn], stop_timeout_s=1.0, out=io.StringIO())
    sup.start()
    grandchild = int(pidfile.read_text())
    started = time.monotonic()
    sup.stop()
    assert time.monotonic() - started < 5
    assert wait_gone(grandchild)


def supervisor_script(run: str) -> str:
    """A Python program that supervises one fake child as `sup`, then runs `run`."""
    port = free_port()
    return f"""
import sys
from kvgate.supervisor import ChildSpec, Supervisor
spec = ChildSpec("c", ({sys.executable!r}, {FAKE_CHILD!r}, "{port}"), health_url="http://127.0.0.1:{port}/health")
sup = Supervisor([spec])
""" + run


def test_supervisor_killed_outright_leaves_no_orphan_children():
    """SIGKILL on the supervisor: the kernel's parent-death signal still ends every child."""
    script = supervisor_script("""
sup.start()
print("READY", sup.children[0].process.pid, flush=True)
sup.watch()
""")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        child_pid = read_ready_pid(proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_gone(child_pid)


def test_sigterm_to_supervisor_run_stops_all_children_cleanly():
    script = supervisor_script("""
code = sup.run(on_ready=lambda: print("READY", sup.children[0].process.pid, flush=True))
print("EXIT", code, flush=True)
sys.exit(code)
""")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        child_pid = read_ready_pid(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert wait_gone(child_pid)
