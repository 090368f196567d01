"""Per-worker circuit breakers (pybreaker's state machine), usable around async attempts.

pybreaker wraps synchronous calls; an upstream attempt here is an async stream, so the adapter
records each attempt's outcome into the breaker after the fact and asks it, before an attempt,
whether the worker may be tried (closed; or open long enough that one half-open trial is due).
"""

from __future__ import annotations

import datetime
from typing import Callable

import pybreaker

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class _Recorded(Exception):
    """The failure being recorded (pybreaker counts exceptions raised by the wrapped call)."""


def _succeed() -> None:
    return None


def _fail() -> None:
    raise _Recorded()


class _StateListener(pybreaker.CircuitBreakerListener):
    def __init__(self, on_change: Callable[[str, str, str], None]) -> None:
        self._on_change = on_change

    def state_change(self, cb: pybreaker.CircuitBreaker, old_state, new_state) -> None:
        self._on_change(cb.name, old_state.name if old_state else CLOSED, new_state.name)


class WorkerBreaker:
    """Opens after fail_max consecutive failures; after reset_timeout_s one trial request is let
    through (half-open); its success closes the breaker, its failure opens it again."""

    def __init__(self, worker_id: str, fail_max: int, reset_timeout_s: float,
                 on_change: Callable[[str, str, str], None] | None = None) -> None:
        listeners = [_StateListener(on_change)] if on_change else []
        self._breaker = pybreaker.CircuitBreaker(fail_max=fail_max, reset_timeout=reset_timeout_s, name=worker_id,
                                                 listeners=listeners, throw_new_error_on_trip=False)
        self._trial_in_flight = False
        self.applying_peer_state = False  # set while follow_peer changes the state (not to be told back)

    @property
    def state(self) -> str:
        return self._breaker.current_state

    def available(self) -> bool:
        """May an attempt go to this worker now?"""
        state = self.state
        if state == CLOSED:
            return True
        if self._trial_in_flight:
            return False
        if state == HALF_OPEN:
            return True
        opened_at = self._breaker._state_storage.opened_at  # pybreaker keeps it only here
        now = datetime.datetime.now(datetime.UTC)
        return opened_at is None or now >= opened_at + datetime.timedelta(seconds=self._breaker.reset_timeout)

    def begin_attempt(self) -> None:
        if self.state != CLOSED:
            self._trial_in_flight = True

    def end_attempt(self) -> None:
        """An attempt ended with no outcome to judge the worker by (e.g. the client went away)."""
        self._trial_in_flight = False

    def record_success(self) -> None:
        self._trial_in_flight = False
        if self._breaker.fail_counter == 0 and self.state == CLOSED:
            return  # nothing to reset (the common case: skip pybreaker's locked state machine)
        try:
            self._breaker.call(_succeed)
        except pybreaker.CircuitBreakerError:
            pass  # still open: a success from an attempt begun before it opened

    def follow_peer(self, state: str) -> None:
        """Another replica's breaker for this worker opened or closed: take the same state. An open one
        waits reset_timeout_s from now before its own half-open trial."""
        if state not in (OPEN, CLOSED) or (state == CLOSED and self.state == CLOSED):
            return
        self.applying_peer_state = True
        try:
            if state == OPEN:
                self._breaker.open()
            else:
                self._breaker.close()
        finally:
            self.applying_peer_state = False
            self._trial_in_flight = False

    def record_failure(self) -> None:
        self._trial_in_flight = False
        try:
            self._breaker.call(_fail)
        except (_Recorded, pybreaker.CircuitBreakerError):
            pass
