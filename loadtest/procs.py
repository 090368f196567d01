"""Child processes for fleet runs: start in their own session, log to a file, wait for /health, stop; the
loopback ports they listen on and the CPU time they use."""

from __future__ import annotations

import abc
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

import httpx

from kvgate.kv_endpoints import replay_port
from loadtest.paths import ROOT


class ChildProcess:
    """One child (worker, gateway, proxy, redis) that this run started; stop() ends it and its group.
    cpus pins it (and every process it starts) to those CPUs."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, health_url: str | None = None,
                 env: Mapping[str, str] | None = None, cpus: Collection[int] | None = None) -> None:
        self.name, self.argv, self.log_path, self.health_url = name, list(argv), log_path, health_url
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        exit_on_sigterm()
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, set(cpus)))
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env={**os.environ, **(env or {})}, preexec_fn=pin)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_healthy(self, timeout_s: float, any_answer: bool = False) -> None:
        """Poll health_url until it answers 200 (any_answer: any status below 500; no URL: the child
        only has to be alive); raise with the log's tail if the child dies or time runs out."""
        wait_healthy(self.health_url, self.popen, timeout_s, name=self.name, log_tail=self.log_tail,
                     any_answer=any_answer)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send sig to this child only (e.g. SIGKILL for a crash)."""
        if self.alive:
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the child's own process group, then SIGKILL it if it lingers; once the child is gone,
        what is left of its group (e.g. a vLLM engine process whose API server was killed) is killed too."""
        if self.alive:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout_s)
        self._signal_group(signal.SIGKILL)
        self._log.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, num_lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


def exit_on_sigterm() -> None:
    """Make SIGTERM end this run as Ctrl-C does (KeyboardInterrupt), so the with-blocks and exit stacks
    that own its children unwind and stop them: each child runs in its own session, out of reach of a
    signal to this process (`timeout`, a CI cancel, `kill`), and SIGTERM's default would leave them all
    running. Installed from the main thread, and only over the default (a handler someone set is kept)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def wait_healthy(url: str | None, popen: subprocess.Popen, timeout_s: float, *, name: str | None = None,
                 log_tail: Callable[[], str] | None = None, any_answer: bool = False) -> None:
    """Poll url every 0.1 s until it answers 200 (any_answer: any status below 500, e.g. a 401 from a
    server that wants a key; url None: return while the process lives); raise RuntimeError, with
    log_tail() when given, if the process exits first or timeout_s runs out."""
    name = name or url or "process"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited with {popen.returncode}{_tail(log_tail)}")
        if url is None or _answers(url, any_answer):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} not healthy at {url} after {timeout_s:g} s{_tail(log_tail)}")


def _tail(log_tail: Callable[[], str] | None) -> str:
    return f":\n{log_tail()}" if log_tail is not None else ""


def _answers(url: str, any_answer: bool = False) -> bool:
    try:
        status = httpx.get(url, timeout=1.0).status_code
        return status < 500 if any_answer else status == 200
    except httpx.HTTPError:
        return False


class Started(abc.ABC):
    """A context manager over processes it starts: `with X(...) as x:` runs x.start(), and x.stop()
    always follows, also when starting failed half-way (what was started is stopped)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_LISTEN_PORTS_FLOOR = 10_000
_handed_out: set[int] = set()  # ports this process gave a server that may not have bound them yet


def free_port(pair: bool = False) -> int:
    """A free TCP port on 127.0.0.1 for a server about to start; with pair=True, one whose next port
    is free too (ZMQ PUB + replay).

    Drawn below the kernel's ephemeral range (ip_local_port_range), never from it: a port the kernel
    hands out for bind(0) may also be taken, before the server binds it, as the local end of an
    outgoing connection (a health poll, a Redis client), and the server then fails with EADDRINUSE.
    A port already handed out by this process is not given again."""
    low, _ = _ephemeral_range()
    if low - _LISTEN_PORTS_FLOOR < 1_000:  # an unusual range: fall back on the kernel's choice
        return _kernel_free_port(pair)
    rng = random.SystemRandom()  # parallel test processes draw apart
    for _ in range(200):
        port = rng.randrange(_LISTEN_PORTS_FLOOR, low - 1)
        ports = (port, replay_port(port)) if pair else (port,)
        if _handed_out.isdisjoint(ports) and all(port_is_free(p) for p in ports):
            _handed_out.update(ports)
            return port
    raise RuntimeError(f"no free port{' pair' if pair else ''} in {_LISTEN_PORTS_FLOOR}-{low - 1}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _kernel_free_port(pair: bool) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair or port_is_free(replay_port(port)):
            return port
    raise RuntimeError("no free port pair found")


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port: a bind there succeeds with SO_REUSEADDR, as the servers
    themselves bind (connections of an earlier run still in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds used by these processes and their descendants (e.g. nginx's worker), all live."""
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu_s(pid)
            kids = [int(kid) for task in Path(f"/proc/{pid}/task").iterdir()
                    for kid in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        total += tree_cpu_s(kids)
    return total


def default_model_dir() -> Path:
    """The default model's folder (an HF Llama folder: tokenizer.json, chat template), converted once
    by the worker's own command: load tests meet the worker package only as a program."""
    argv = [sys.executable, "-m", "worker.model.default_model"]
    out = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def pin(cpus: set[int] | None) -> list[str]:
    """`taskset -c CPUS` to put before a command line; nothing when cpus is None."""
    return ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []
