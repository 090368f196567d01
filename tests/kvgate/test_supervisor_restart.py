"""The supervisor keeps a stack alive: fail-fast startup, worker restarts with backoff, SIGHUP passed on."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from kvgate.supervisor import ChildFailed, RestartPolicy, Supervisor
from tests.conftest import free_port
from tests.kvgate.fake_children import FAKE_CHILD, fake, read_ready_pid

pytestmark = pytest.mark.slow  # every test supervises real child processes

QUICK = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.4, reset_after_s=60.0, max_failed_starts=3)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@contextmanager
def watching(sup: Supervisor) -> Iterator[dict[str, int]]:
    """sup.watch() on a thread; the yielded dict gets its return code under "code"."""
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.update(code=sup.watch(poll_s=0.05)), daemon=True)
    thread.start()
    try:
        yield result
    finally:
        sup.request_stop()
        thread.join(timeout=10)
        sup.stop()


def test_start_fails_fast_when_a_child_dies_while_another_is_still_starting():
    slow_worker, _ = fake("w0", "--health-after", "60")
    gateway, _ = fake("gateway", "--crash-after", "0.2", critical=True)
    sup = Supervisor([slow_worker, gateway], out=io.StringIO())
    started = time.monotonic()
    try:
        with pytest.raises(ChildFailed) as info:
            sup.start()
    finally:
        sup.stop()
    assert time.monotonic() - started < 10
    assert str(info.value).startswith("gateway exited with code 3; last log lines:")
    assert "fake child: simulated crash" in str(info.value)
    assert all(child.process.returncode is not None for child in sup.children)


def test_worker_killed_outright_is_restarted_and_answers_health_again():
    worker, port = fake("w0")
    out = io.StringIO()
    sup = Supervisor([worker], restart=QUICK, out=out)
    sup.start()
    first_pid = sup.children[0].process.pid
    with watching(sup) as result:
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: "kvgate: w0 is healthy again" in out.getvalue())
        assert sup.children[0].process.pid != first_pid
        assert sup.children[0].process.poll() is None
        assert "code" not in result  # still watching
    log = out.getvalue()
    assert "kvgate: w0 was killed by signal 9; last log lines:" in log
    assert "kvgate: restarting w0 in 0.1 s (death 1 in a row)" in log
    assert result["code"] == 0


def exit_code_after_killing_the_child(sup: Supervisor) -> int:
    """SIGKILL the (only) child while sup watches; the code sup.watch() returns once it gives up."""
    with watching(sup) as result:
        os.kill(sup.children[0].process.pid, signal.SIGKILL)
        wait_until(lambda: "code" in result)
    return result["code"]


def test_restarts_back_off_exponentially_then_the_stack_gives_up(tmp_path):
    broken = tmp_path / "broken"
    worker, _ = fake("w0", "--crash-if-exists", str(broken))
    out = io.StringIO()
    sup = Supervisor([worker], restart=QUICK, out=out)
    sup.start()
    broken.touch()
    assert exit_code_after_killing_the_child(sup) == 1
    restarts = [line for line in out.getvalue().splitlines() if line.startswith("kvgate: restarting")]
    assert restarts == [
        "kvgate: restarting w0 in 0.1 s (death 1 in a row)",
        "kvgate: restarting w0 in 0.2 s (death 2 in a row)",
        "kvgate: restarting w0 in 0.4 s (death 3 in a row)",
    ]
    assert "kvgate: w0 exited with code 4; last log lines:\n    fake child: broken on purpose" in out.getvalue()
    assert out.getvalue().endswith("kvgate: w0 failed to become healthy 3 times in a row; giving up\n")


def test_a_restart_that_never_gets_healthy_is_killed_after_the_health_timeout(tmp_path):
    stalled = tmp_path / "stalled"
    worker, _ = fake("w0", "--stall-if-exists", str(stalled))
    out = io.StringIO()
    policy = RestartPolicy(initial_delay_s=0.1, max_failed_starts=1)
    sup = Supervisor([worker], health_timeout_s=2.0, restart=policy, out=out)
    sup.start()
    stalled.touch()
    assert exit_code_after_killing_the_child(sup) == 1
    log = out.getvalue()
    assert "kvgate: w0 did not become healthy within 2 s of its restart; killing it" in log
    assert log.endswith("kvgate: w0 failed to become healthy 1 times in a row; giving up\n")


def test_backoff_starts_over_once_a_worker_stayed_healthy_for_reset_after_s():
    worker, _ = fake("w0")
    out = io.StringIO()
    policy = RestartPolicy(initial_delay_s=0.1, reset_after_s=1.5)
    sup = Supervisor([worker], restart=policy, out=out)
    sup.start()

    def kill_and_wait_healthy(times_healthy: int) -> None:
        os.kill(sup.children[0].process.pid, signal.SIGKILL)
        wait_until(lambda: out.getvalue().count("kvgate: w0 is healthy again") == times_healthy)

    with watching(sup):
        time.sleep(1.6)  # healthy since start for longer than reset_after_s
        kill_and_wait_healthy(1)
        kill_and_wait_healthy(2)  # at once: a second death in a row
        time.sleep(1.6)
        kill_and_wait_healthy(3)
    restarts = [line for line in out.getvalue().splitlines() if line.startswith("kvgate: restarting")]
    assert restarts == [
        "kvgate: restarting w0 in 0.1 s (death 1 in a row)",
        "kvgate: restarting w0 in 0.2 s (death 2 in a row)",
        "kvgate: restarting w0 in 0.1 s (death 1 in a row)",
    ]


def test_other_children_keep_running_while_a_worker_restarts():
    steady, _ = fake("steady")
    flaky, _ = fake("flaky")
    out = io.StringIO()
    sup = Supervisor([steady, flaky], restart=RestartPolicy(initial_delay_s=1.0), out=out)
    sup.start()
    steady_pid = sup.children[0].process.pid
    with watching(sup):
        os.kill(sup.children[1].process.pid, signal.SIGKILL)
        wait_until(lambda: "restarting flaky in 1 s" in out.getvalue())
        assert sup.children[0].process.poll() is None
        wait_until(lambda: "flaky is healthy again" in out.getvalue())
    assert sup.children[0].process.pid == steady_pid


@pytest.mark.parametrize(
    ("deaths", "delay_s"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (1000, 30.0)],
    ids=["first", "second", "third", "fifth", "capped", "far-past-the-cap"],
)
def test_restart_delay_doubles_from_one_second_up_to_a_thirty_second_cap(deaths, delay_s):
    assert RestartPolicy().delay_s(deaths) == delay_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_delay_s": 0}, "0 < initial_delay_s <= max_delay_s"),
        ({"initial_delay_s": 5, "max_delay_s": 1}, "0 < initial_delay_s <= max_delay_s"),
        ({"reset_after_s": -1}, "reset_after_s must be >= 0"),
        ({"max_failed_starts": 0}, "max_failed_starts must be >= 1"),
    ],
    ids=["zero-delay", "cap-below-initial", "negative-reset", "no-attempts"],
)
def test_restart_policy_rejects_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**kwargs)


@contextmanager
def supervisor_script(port: int, reloads: bool) -> Iterator[subprocess.Popen]:
    """Supervisor.run() over one fake child in a process of its own; killed if a test leaves it running."""
    script = f"""
import sys
from kvgate.supervisor import ChildSpec, Supervisor
spec = ChildSpec("c", ({sys.executable!r}, {FAKE_CHILD!r}, "{port}", "--on-hup"),
                 health_url="http://127.0.0.1:{port}/health", reloads_on_sighup={reloads})
sup = Supervisor([spec])
sys.exit(sup.run(on_ready=lambda: print("READY", sup.children[0].process.pid, flush=True)))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()  # its child gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
        proc.wait()
        proc.stdout.close()


def read_until(proc: subprocess.Popen, *texts: str) -> None:
    """Read output lines until each of `texts` has been in one, in any order."""
    missing = set(texts)
    for line in proc.stdout:
        missing -= {text for text in missing if text in line}
        if not missing:
            return
    raise AssertionError(f"{sorted(missing)} never came; exit status {proc.wait()}")


def test_sighup_to_the_supervisor_is_passed_on_to_a_child_that_reloads_on_it():
    with supervisor_script(free_port(), reloads=True) as proc:
        child_pid = read_ready_pid(proc)
        proc.send_signal(signal.SIGHUP)
        read_until(proc, "kvgate: SIGHUP: forwarded to c to reload", "[c] fake child: got SIGHUP")
        assert proc.poll() is None
        os.kill(child_pid, 0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_sighup_is_ignored_with_a_message_when_no_child_reloads_on_it():
    with supervisor_script(free_port(), reloads=False) as proc:
        read_ready_pid(proc)
        proc.send_signal(signal.SIGHUP)
        read_until(proc, "kvgate: SIGHUP ignored: no running child reloads on it")
        proc.send_signal(signal.SIGTERM)
        remaining = proc.stdout.read()
        assert proc.wait(timeout=10) == 0
    assert "got SIGHUP" not in remaining
