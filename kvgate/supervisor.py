"""Runs a set of child processes as one stack: start, wait for health, restart or report deaths, stop cleanly.

Each child gets its own process group (so a terminal's Ctrl-C reaches only the supervisor, which
forwards it) and is asked by the kernel to die with the supervisor (PR_SET_PDEATHSIG), so no
orphan outlives a supervisor that was killed outright. SIGHUP is passed on to the children that
reload on it (they start with SIGHUP ignored, so one that arrives before a child has installed its
handler is dropped, not fatal: the child reads the current file as it starts anyway).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import ssl
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
    """One process of the stack. A critical child's death stops the whole stack; any other is restarted.

    It is up once health_url answers 200, or, for a child with no URL of its own (processes sharing one
    port), once ready_check() returns True; with neither, as soon as it runs.
    """

    name: str
    argv: tuple[str, ...]
    health_url: str | None = None
    ready_check: Callable[[], bool] | None = None
    env: dict[str, str] = field(default_factory=dict)
    critical: bool = False
    reloads_on_sighup: bool = False


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When a non-critical child that died starts again: exponential backoff (tenacity's wait_exponential).

    The n-th death in a row waits min(max_delay_s, initial_delay_s * 2**(n - 1)); a child that had
    been healthy for reset_after_s before it died starts again from initial_delay_s. After
    max_failed_starts restarts in a row that never became healthy, the stack gives up.
    """

    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    reset_after_s: float = 60.0
    max_failed_starts: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError("restart delays must satisfy 0 < initial_delay_s <= max_delay_s")
        if self.reset_after_s < 0:
            raise ValueError("restart reset_after_s must be >= 0")
        if self.max_failed_starts < 1:
            raise ValueError("restart max_failed_starts must be >= 1")

    def delay_s(self, deaths: int) -> float:
        """Seconds to wait before the restart that follows the `deaths`-th death in a row (>= 1)."""
        return min(self.max_delay_s, self.initial_delay_s * 2.0 ** min(deaths - 1, 62))


def _die_with_parent() -> None:
    """Runs in the child before exec: new process group, SIGTERM when the parent dies."""
    os.setpgrp()
    _set_death_signal()


def _die_with_parent_ignoring_sighup() -> None:
    """_die_with_parent, and SIGHUP ignored (kept across exec) until the child installs its own handler."""
    os.setpgrp()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _set_death_signal()


def _set_death_signal() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: stop() still terminates children on a normal exit


class _Child:
    """One child's process (replaced on each restart), its recent log lines and its restart record."""

    def __init__(self, spec: ChildSpec, out: TextIO, log_lines: int, now: float) -> None:
        self.spec = spec
        self.out = out
        self.recent: collections.deque[str] = collections.deque(maxlen=log_lines)
        self.deaths = 0  # deaths in a row (see RestartPolicy): sets the backoff
        self.failed_starts = 0  # restarts in a row that died before they became healthy
        self.healthy_since: float | None = None
        self.restart_at: float | None = None  # set while it is dead and waiting for its restart
        self.launch(now)

    def launch(self, now: float) -> None:
        self.recent.clear()
        self.process = subprocess.Popen(
            self.spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env},
            preexec_fn=_die_with_parent_ignoring_sighup if self.spec.reloads_on_sighup else _die_with_parent,
            text=True,
            errors="replace",
        )
        self.started_at = now
        self.healthy_since = None
        self.restart_at = None
        self._pump = threading.Thread(target=self._pump_logs, args=(self.process.stdout,), daemon=True)
        self._pump.start()

    def _pump_logs(self, stdout: TextIO) -> None:
        for line in stdout:
            line = line.rstrip("\n")
            self.recent.append(line)
            self.out.write(f"[{self.spec.name}] {line}\n")
            self.out.flush()

    def record_death(self, now: float, reset_after_s: float) -> None:
        """Count a death: a failed start if it never became healthy; a fresh run of deaths after a long healthy one."""
        if self.healthy_since is None:
            self.failed_starts += 1
        elif now - self.healthy_since >= reset_after_s:
            self.deaths = 0
        self.deaths += 1

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
    """Starts children, waits for their /health, restarts the ones that die, and stops them all on request."""

    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        health_timeout_s: float = 600.0,
        stop_timeout_s: float = 8.0,
        restart: RestartPolicy = RestartPolicy(),
        log_lines: int = 30,
        out: TextIO = sys.stdout,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.specs = specs
        self.health_timeout_s = health_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.restart = restart
        self.log_lines = log_lines
        self.out = out
        self.clock = clock
        self.children: list[_Child] = []
        self._stop_requested = threading.Event()
        self._reload_requested = False  # a plain flag: set from a signal handler

    def start(self) -> None:
        """Start every child, then wait until each one with a health URL answers 200.

        Every child is watched while any is still starting: the first to die fails the start at once.
        """
        now = self.clock()
        for spec in self.specs:
            self.children.append(_Child(spec, self.out, self.log_lines, now))
        deadline = now + self.health_timeout_s
        starting = list(self.children)
        while starting and not self._stop_requested.is_set():
            for child in self.children:
                if child.process.poll() is not None:
                    raise ChildFailed(self._death_message(child))
            starting = [child for child in starting if not self._became_healthy(child)]
            if starting and self.clock() > deadline:
                raise ChildFailed(self._timeout_message(starting[0]))
            if starting:
                self._stop_requested.wait(0.2)

    def _became_healthy(self, child: _Child) -> bool:
        check = child.spec.ready_check
        if not (check() if check is not None else _is_healthy(child.spec.health_url)):
            return False
        child.healthy_since = self.clock()
        return True

    def _timeout_message(self, child: _Child) -> str:
        where = f"healthy at {child.spec.health_url}" if child.spec.ready_check is None else "ready"
        return (f"{child.spec.name} did not become {where} "
                f"within {self.health_timeout_s:.0f} s; last log lines:\n{child.last_lines()}")

    def _death_message(self, child: _Child) -> str:
        code = child.process.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"{child.spec.name} {how}; last log lines:\n{child.last_lines()}"

    def request_stop(self, *_: object) -> None:
        self._stop_requested.set()

    def request_reload(self, *_: object) -> None:
        """Signal handler for SIGHUP: watch() passes it on to the children that reload on it."""
        self._reload_requested = True

    def watch(self, poll_s: float = 0.2) -> int:
        """Block until a stop is requested (returns 0) or the stack can't go on (returns 1).

        A non-critical child that dies is reported and restarted after a backoff (see RestartPolicy);
        the death of a critical child, or a child that keeps failing to start, ends the stack. Call it
        on the thread that lives as long as the stack: PR_SET_PDEATHSIG fires when the thread that
        started a child ends.
        """
        try:
            while not self._stop_requested.wait(poll_s):
                self._forward_reload()
                for child in self.children:
                    self._tend(child, self.clock())
        except ChildFailed as exc:
            self._say(str(exc))
            return 1
        return 0

    def _forward_reload(self) -> None:
        if not self._reload_requested:
            return
        self._reload_requested = False
        targets = [c for c in self.children if c.spec.reloads_on_sighup and c.process.poll() is None]
        for child in targets:
            self._say(f"SIGHUP: forwarded to {child.spec.name} to reload")
            child.process.send_signal(signal.SIGHUP)
        if not targets:
            self._say("SIGHUP ignored: no running child reloads on it")

    def _tend(self, child: _Child, now: float) -> None:
        """One look at a child: restart it once its backoff is over, or notice its death or its recovery."""
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.close()
                child.launch(now)
        elif child.process.poll() is not None:
            self._on_death(child, now)
        elif child.healthy_since is None:
            self._check_restarted(child, now)

    def _on_death(self, child: _Child, now: float) -> None:
        child.signal_group(signal.SIGKILL)  # whatever it left behind in its group
        message = self._death_message(child)
        if child.spec.critical:
            raise ChildFailed(message)
        self._say(message)
        child.record_death(now, self.restart.reset_after_s)
        if child.failed_starts >= self.restart.max_failed_starts:
            raise ChildFailed(f"{child.spec.name} failed to become healthy {child.failed_starts} times in a row; "
                              "giving up")
        delay_s = self.restart.delay_s(child.deaths)
        child.restart_at = now + delay_s
        self._say(f"restarting {child.spec.name} in {delay_s:g} s (death {child.deaths} in a row)")

    def _check_restarted(self, child: _Child, now: float) -> None:
        if self._became_healthy(child):
            child.failed_starts = 0
            self._say(f"{child.spec.name} is healthy again")
        elif now - child.started_at > self.health_timeout_s:
            self._say(f"{child.spec.name} did not become healthy within {self.health_timeout_s:.0f} s "
                      "of its restart; killing it")
            child.signal_group(signal.SIGKILL)  # the next look counts the death as a failed start

    def _say(self, message: str) -> None:
        self.out.write(f"kvgate: {message}\n")
        self.out.flush()

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
                self._say(f"{child.spec.name} ignored SIGTERM; killing it")
            if child.restart_at is None:  # a child waiting for its restart had its group killed at its death
                child.signal_group(signal.SIGKILL)  # also ends grandchildren left in the group
            child.process.wait()
            child.close()

    def run(self, on_ready: Callable[[], None] | None = None) -> int:
        """start() + watch() + stop(), with SIGINT/SIGTERM forwarded as a clean stop and SIGHUP passed on."""
        handlers = {signal.SIGINT: self.request_stop, signal.SIGTERM: self.request_stop,
                    signal.SIGHUP: self.request_reload}
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            try:
                self.start()
            except ChildFailed as exc:
                self._say(str(exc))
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


# A child's own HTTPS health URL (a gateway with gateway.tls_certfile) is probed without checking its
# certificate: the supervisor started that process itself, on this machine; the certificate names the
# address clients use, maybe not the one probed.
_OWN_CHILD_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no CA certificates loaded: none are checked
_OWN_CHILD_TLS.check_hostname = False
_OWN_CHILD_TLS.verify_mode = ssl.CERT_NONE


def _is_healthy(url: str | None) -> bool:
    if url is None:
        return True
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=_OWN_CHILD_TLS) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
