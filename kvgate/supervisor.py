"""Runs a set of child processes as one stack: start, wait for health, report deaths, stop cleanly.

Each child gets its own process group (so a terminal's Ctrl-C reaches only the supervisor, which
forwards it) and is asked by the kernel to die with the supervisor (PR_SET_PDEATHSIG), so no
orphan outlives a supervisor that was killed outright.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, TextIO

_PR_SET_PDEATHSIG = 1


class ChildFailed(RuntimeError):
    """A child exited or never became healthy; the message carries its last log lines."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One process of the stack. A critical child's death stops the whole stack."""

    name: str
    argv: tuple[str, ...]
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    critical: bool = False


def _die_with_parent() -> None:
    """Runs in the child before exec: new process group, SIGTERM when the parent dies."""
    os.setpgrp()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: stop() still terminates children on a normal exit


class _Child:
    def __init__(self, spec: ChildSpec, out: TextIO, log_lines: int) -> None:
        self.spec = spec
        self.recent: collections.deque[str] = collections.deque(maxlen=log_lines)
        self.process = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},
            preexec_fn=_die_with_parent,
            text=True,
            errors="replace",
        )
        self.reported = False
        self._pump = threading.Thread(target=self._pump_logs, args=(out,), daemon=True)
        self._pump.start()

    def _pump_logs(self, out: TextIO) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.recent.append(line)
            out.write(f"[{self.spec.name}] {line}\n")
            out.flush()

    def last_lines(self) -> str:
        self._pump.join(timeout=1.0)
        return "\n".join(f"    {line}" for line in self.recent) or "    (no output)"

    def close(self) -> None:
        self._pump.join(timeout=2.0)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


class Supervisor:
    """Starts children in order, waits for their /health, and stops them all on request."""

    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        health_timeout_s: float = 600.0,
        stop_timeout_s: float = 8.0,
        log_lines: int = 30,
        out: TextIO = sys.stdout,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.specs = specs
        self.health_timeout_s = health_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_lines = log_lines
        self.out = out
        self.clock = clock
        self.children: list[_Child] = []
        self._stop_requested = threading.Event()

    def start(self) -> None:
        """Start every child, then wait until each one with a health URL answers 200."""
        for spec in self.specs:
            self.children.append(_Child(spec, self.out, self.log_lines))
        deadline = self.clock() + self.health_timeout_s
        for child in self.children:
            if child.spec.health_url is not None:
                self._wait_healthy(child, deadline)

    def _wait_healthy(self, child: _Child, deadline: float) -> None:
        while not self._stop_requested.is_set():
            if child.process.poll() is not None:
                child.reported = True
                raise ChildFailed(self._death_message(child))
            if _is_healthy(child.spec.health_url):
                return
            if self.clock() > deadline:
                raise ChildFailed(
                    f"{child.spec.name} did not become healthy at {child.spec.health_url} "
                    f"within {self.health_timeout_s:.0f} s; last log lines:\n{child.last_lines()}"
                )
            time.sleep(0.2)

    def _death_message(self, child: _Child) -> str:
        code = child.process.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"{child.spec.name} {how}; last log lines:\n{child.last_lines()}"

    def request_stop(self, *_: object) -> None:
        self._stop_requested.set()

    def watch(self, poll_s: float = 0.2) -> int:
        """Block until a stop is requested (returns 0) or the stack can't go on (returns 1).

        A dead non-critical child is reported once and the rest keep serving; the death of a
        critical child, or of every child, ends the stack.
        """
        while not self._stop_requested.wait(poll_s):
            for child in self.children:
                if child.process.poll() is not None and not child.reported:
                    child.reported = True
                    self.out.write(f"kvgate: {self._death_message(child)}\n")
                    self.out.flush()
                    if child.spec.critical:
                        return 1
            if all(child.process.poll() is not None for child in self.children):
                return 1
        return 0

    def stop(self) -> None:
        """SIGTERM every child's process group; SIGKILL what is left after stop_timeout_s."""
        for child in self.children:
            if child.process.poll() is None:
                child.signal_group(signal.SIGTERM)
        deadline = self.clock() + self.stop_timeout_s
        for child in self.children:
            remaining = max(0.0, deadline - self.clock())
            try:
                child.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.out.write(f"kvgate: {child.spec.name} ignored SIGTERM; killing it\n")
            child.signal_group(signal.SIGKILL)  # also ends grandchildren left in the group
            child.process.wait()
            child.close()

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """start() + watch() + stop(), with SIGINT/SIGTERM forwarded as a clean stop."""
        previous = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.start()
            except ChildFailed as exc:
                self.out.write(f"kvgate: {exc}\n")
                return 1
            if self._stop_requested.is_set():
                return 0
            if on_ready is not None:
                on_ready()
            return self.watch()
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _is_healthy(url: str | None) -> bool:
    if url is None:
        return True
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
