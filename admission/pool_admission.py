"""Admission to one pool: the adaptive concurrency limit, and the fair queue in front of it.

A request is admitted at once while fewer than `limit` admitted requests are in flight and nobody
as urgent waits (critical ones while fewer than the pool's max_limit are: the adaptive limit shapes the other
priorities' work around theirs, and the workers, which get the admitted priority, serve them first). Otherwise its wait is predicted (the requests it would follow in the fair queue, one permit
interval each: mean time a permit is held / limit) and held against the wait it is allowed, which
depends on whether the queue drains (CoDel's idea, as "controlled delay" queues apply it): while
the queue has been empty within the last queue_interval_s, what it can drain in that interval (a
burst is absorbed; at least the standing allowance); once it has not, the queue is standing (offered load above what the pool
serves) and standard and batch requests are allowed queue_target_s (at least four permit
intervals), so the queue stays short and the answers that are given are fast. Critical requests
are allowed max_queue_wait_s. A request whose predicted wait passes what it is allowed, or whose
predicted first token (wait + the pool's mean time to first token) passes its deadline, is
refused at once: under overload nearly every refusal is decided on arrival, in microseconds. A
queued request times out at its deadline, or after WAIT_SLACK times the wait it was allowed (a
prediction that went wrong); when the queue is full, one request is shed (fair_queue.py). Every
wait is bounded by max_queue_wait_s.

Pure logic: the gateway holds the waiting clients and calls expire() a few times a second.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from admission.concurrency_limit import AimdLimit, LimitConfig
from admission.fair_queue import FairQueue, QueuedRequest
from admission.priority import Priority


@dataclass(frozen=True, slots=True)
class PoolAdmissionSettings:
    limit: LimitConfig
    queue_size: int = 256
    queue_target_s: float = 0.1
    queue_interval_s: float = 0.5
    max_queue_wait_s: float = 5.0
    service_ewma_alpha: float = 0.1

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        if not 0 < self.queue_target_s <= self.max_queue_wait_s:
            raise ValueError("queue_target_s must be in (0, max_queue_wait_s]")
        if self.queue_interval_s <= 0:
            raise ValueError("queue_interval_s must be > 0")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What offer() decided: admitted now, queued, or refused (reason, when to retry). shed: a
    queued request pushed out to make room (refuse it with reason "shed")."""

    outcome: str  # "admitted", "queued" or "rejected"
    reason: str | None = None
    retry_after_s: float | None = None
    shed: QueuedRequest | None = None


ADMITTED = Verdict("admitted")
# A request queued on a predicted wait within its bound may wait this many times the bound before it
# times out: predictions err (a fair queue lets tenants that arrive later go first; service times
# vary), and a time-out after a wait is a slow refusal where one at arrival is fast.
WAIT_SLACK = 3.0
STANDING_INTERVALS = 4  # permit intervals a standing queue allows at least


@dataclass(frozen=True, slots=True)
class PoolState:
    """A snapshot for metrics."""

    limit: float
    in_flight: int
    queued: dict[Priority, int]


class PoolAdmission:
    def __init__(self, config: PoolAdmissionSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limit = AimdLimit(config.limit)
        self.queue = FairQueue(config.queue_size)
        self.in_flight = 0
        self.mean_service_s: float | None = None  # EWMA of admission to release
        self.mean_first_token_s: float | None = None  # EWMA of admission to first token
        self._clock = clock
        self._last_empty_s = clock()

    def state(self) -> PoolState:
        return PoolState(self.limit.limit, self.in_flight, {p: self.queue.depth(p) for p in Priority})

    # -- arrivals ------------------------------------------------------------------------------

    def offer(self, request: QueuedRequest) -> Verdict:
        now = self._clock()
        request.enqueued_s = now
        most_urgent_waiting = self.queue.most_urgent()
        nobody_before = most_urgent_waiting is None or most_urgent_waiting > request.priority
        if nobody_before and self.in_flight < self._capacity(request.priority):
            self.in_flight += 1
            return ADMITTED
        allowed_s = self._allowed_wait_s(request.priority, self._standing(now))
        wait_s = self.predicted_wait_s(request)
        if wait_s is not None:
            if request.deadline_s is not None and now + wait_s + (self.mean_first_token_s or 0.0) > request.deadline_s:
                return Verdict("rejected", "deadline_unmeetable", self.retry_after_s())
            if wait_s > allowed_s:
                return Verdict("rejected", "overloaded", self.retry_after_s())
        request.max_wait_s = min(self.config.max_queue_wait_s, WAIT_SLACK * allowed_s)
        if not len(self.queue):
            self._last_empty_s = now
        shed = self.queue.push(request)
        if shed is request:
            return Verdict("rejected", "queue_full", self.retry_after_s())
        return Verdict("queued", shed=shed)

    def permit_interval_s(self) -> float | None:
        """How often a permit comes back, on average (None until one has)."""
        if self.mean_service_s is None:
            return None
        return self.mean_service_s / max(1.0, self.limit.limit)

    def predicted_wait_s(self, request: QueuedRequest) -> float | None:
        """How long request would wait if queued now: those it would follow (more urgent ones, and
        its priority's turns before its tenant's), one permit interval each."""
        interval_s = self.permit_interval_s()
        if interval_s is None:
            return None
        over_limit = max(0, self.in_flight - self._capacity(request.priority))  # after a cut
        return (over_limit + self.queue.ahead_of(request) + 1) * interval_s

    # -- departures ----------------------------------------------------------------------------

    def release(self, held_s: float, queue_delay_s: float | None, dropped: bool = False,
                first_token_s: float | None = None) -> list[QueuedRequest]:
        """An admitted request ended after held_s (its first token first_token_s after admission);
        returns the queued requests admitted in its place."""
        now = self._clock()
        self.in_flight -= 1
        self.mean_service_s = self._ewma(self.mean_service_s, held_s)
        if first_token_s is not None:
            self.mean_first_token_s = self._ewma(self.mean_first_token_s, first_token_s)
        self.limit.on_sample(now, queue_delay_s, self.in_flight + 1, dropped, admitted_s=now - held_s)
        return self._admit_waiting(now)

    def forget(self) -> list[QueuedRequest]:
        """An admitted request ended without a sample (it never reached a worker)."""
        self.in_flight -= 1
        return self._admit_waiting(self._clock())

    def cancel(self, request: QueuedRequest) -> None:
        """A queued request's client went away."""
        if self.queue.remove(request):
            self._note_if_empty(self._clock())

    def expire(self) -> list[tuple[QueuedRequest, str]]:
        """Queued requests past their deadline ("deadline_exceeded"), or past the wait allowed them
        when they were queued ("queue_timeout": the wait was predicted shorter than it turned out),
        taken out of the queue."""
        now = self._clock()
        expired = []
        for request in self.queue:
            if request.deadline_s is not None and now >= request.deadline_s:
                expired.append((request, "deadline_exceeded"))
            elif now - request.enqueued_s >= (request.max_wait_s or self.config.max_queue_wait_s):
                expired.append((request, "queue_timeout"))
        for request, _ in expired:
            self.queue.remove(request)
        if expired:
            self._note_if_empty(now)
        return expired

    def _standing(self, now: float) -> bool:
        return bool(len(self.queue)) and now - self._last_empty_s > self.config.queue_interval_s

    def _allowed_wait_s(self, priority: Priority, standing: bool) -> float:
        """Critical: max_queue_wait_s. Others: while the queue drains, what it can drain within an
        interval (a burst is absorbed); once it stands, queue_target_s, or STANDING_INTERVALS permit
        intervals when permits come back more slowly than that (a tenant within its fair share must
        be able to queue a short burst of its own: its second request follows its first and a turn
        of each other backlogged tenant),
        plus the intervals the requests in flight above a cut limit take to drain (the request that
        goes next, e.g. a light tenant's beside a flood, waits that out rather than being refused)."""
        config = self.config
        if priority == Priority.CRITICAL:
            return config.max_queue_wait_s
        interval_s = self.permit_interval_s() or 0.0
        over_limit = max(0, self.in_flight - self._capacity(priority))
        standing_s = max(config.queue_target_s, STANDING_INTERVALS * interval_s) + over_limit * interval_s
        return min(config.max_queue_wait_s, standing_s if standing else max(config.queue_interval_s, standing_s))

    def _capacity(self, priority: Priority) -> int:
        """Requests in flight a new one of this priority may join: the adaptive limit; critical ones,
        what the pool's workers run (max_limit): the limit shapes everyone else's work around theirs."""
        if priority == Priority.CRITICAL:
            return self.config.limit.max_limit
        return int(self.limit.limit)

    def _admit_waiting(self, now: float) -> list[QueuedRequest]:
        admitted = []
        while (priority := self.queue.most_urgent()) is not None and self.in_flight < self._capacity(priority):
            request = self.queue.pop()
            if request is None:
                break
            self.in_flight += 1
            admitted.append(request)
        self._note_if_empty(now)
        return admitted

    def _note_if_empty(self, now: float) -> None:
        if not len(self.queue):
            self._last_empty_s = now

    def _ewma(self, mean: float | None, sample: float) -> float:
        alpha = self.config.service_ewma_alpha
        return sample if mean is None else (1 - alpha) * mean + alpha * sample

    def retry_after_s(self) -> float:
        """When a refused request might find room: the queue's length in permit intervals (at least 1 s)."""
        interval_s = self.permit_interval_s()
        if interval_s is None:
            return 1.0
        return max(1.0, math.ceil((len(self.queue) + 1) * interval_s))
