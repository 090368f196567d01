"""Admission to one pool: the adaptive concurrency limit, and the fair queue in front of it.

A request is admitted at once while fewer than `limit` admitted requests are in flight and nobody
as urgent waits (critical ones while fewer than the pool's max_limit are: the adaptive limit shapes the other
priorities' work around theirs, and the workers, which get the admitted priority, serve them first); it
takes its tenant's turn in the fair queue all the same. Otherwise its wait is predicted (the requests it
would follow in the fair queue, one permit interval each: mean time a permit is held / limit) and held
against the wait it is allowed, which depends on whether the request's tenant's queue drains (CoDel's
idea, kept per tenant as FQ-CoDel keeps it per flow): while the tenant has had nothing of this priority
queued at some moment within the last queue_interval_s, what the pool can drain in that interval (a burst
is absorbed; at least the standing allowance), and a tenant served less than its fair share as much as its
credit in the fair queue covers; otherwise its queue is standing (it offers more than the pool serves it)
and its standard and batch requests are allowed queue_target_s (at least four permit intervals), so the
queue stays short and the answers that are given are fast. A tenant sending within its share beside a
flood keeps the draining allowance: the flood's queue is the one that stands, and the flood's requests are
the ones refused. Critical requests are allowed max_queue_wait_s. A request whose predicted wait passes
what it is allowed, or whose predicted first token (wait + the pool's mean time to first token) passes its
deadline, is refused at once: under overload nearly every refusal is decided on arrival, in microseconds.

A prediction counts those queued when the request arrives; what comes later is accounted as it comes:
a request that goes ahead of queued ones (queued ahead on its tenant's credit or a workflow's, more
urgent, or critical and admitted past the limit) moves their allowed waits by one permit interval each,
and a cut of the limit by the permits it took back, so a request queued on a sound prediction is admitted,
not timed out. A queued request times out at its deadline, or after WAIT_SLACK times the wait it was
allowed (a prediction that went wrong); when the queue is full, one request is shed (fair_queue.py). Every
wait is bounded by max_queue_wait_s. A priority whose queue has stood empty for queue_interval_s ends its
fair queue's busy period: the next starts every tenant with the same credit.

Pure logic: the gateway holds the waiting clients and calls expire() a few times a second.
"""

from __future__ import annotations

import dataclasses

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from admission.concurrency_limit import AimdLimit, LimitConfig
from admission.fair_queue import IDLE_CREDIT_TURNS, FairQueue, QueuedRequest
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


@dataclass(slots=True)  # built per request: not frozen (its __init__ would cost ~3x); never changed once built
class Verdict:
    """What offer() decided: admitted now, queued, or refused (reason, when to retry). shed: a
    queued request pushed out to make room (refuse it with reason "shed")."""

    outcome: str  # "admitted", "queued" or "rejected"
    reason: str | None = None
    retry_after_s: float | None = None
    shed: QueuedRequest | None = None


ADMITTED = Verdict("admitted")
# A request queued on a predicted wait within its bound may wait this many times the bound (plus what
# requests that went ahead of it later added) before it times out: predictions err (permits come back in
# clumps; service times vary), and a time-out after a wait is a slow refusal where one at arrival is fast.
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
        self._emptied_s: dict[Priority, float] = {}  # since when each priority's queue has stood empty
        self._clock = clock

    def set_max_limit(self, max_limit: int) -> None:
        """What the pool's workers can run changed (workers joined or left): the limit's new ceiling."""
        bounds = self.config.limit
        if max_limit == bounds.max_limit:
            return
        bounds = dataclasses.replace(bounds, max_limit=max_limit, min_limit=min(bounds.min_limit, max_limit),
                                     initial_limit=None)
        self.config = dataclasses.replace(self.config, limit=bounds)
        self.limit.resize(bounds)

    def state(self) -> PoolState:
        return PoolState(self.limit.limit, self.in_flight, {p: self.queue.depth(p) for p in Priority})

    # -- arrivals ------------------------------------------------------------------------------

    def offer(self, request: QueuedRequest) -> Verdict:
        now = self._clock()
        request.enqueued_s = now
        self._end_idle_busy_period(request.priority, now)
        most_urgent_waiting = self.queue.most_urgent()
        nobody_before = most_urgent_waiting is None or most_urgent_waiting > request.priority
        if nobody_before and self.in_flight < self._capacity(request.priority):
            return self._admit_at_once(request)
        allowed_s = self._allowed_wait_s(request, now)
        wait_s = self.predicted_wait_s(request)
        if wait_s is not None:
            if request.deadline_s is not None and now + wait_s + (self.mean_first_token_s or 0.0) > request.deadline_s:
                return Verdict("rejected", "deadline_unmeetable", self.retry_after_s())
            if wait_s > allowed_s:
                return Verdict("rejected", "overloaded", self.retry_after_s())
        return self._enqueue(request, allowed_s, now)

    def _admit_at_once(self, request: QueuedRequest) -> Verdict:
        """In flight now, as its tenant's turn; a critical request past the limit delays those waiting by a permit."""
        self.in_flight += 1
        self.queue.serve_at_once(request)
        if self.in_flight > self._capacity(Priority.STANDARD) and len(self.queue):
            self._extend_waits(self.queue, self.permit_interval_s() or 0.0)
        return ADMITTED

    def _enqueue(self, request: QueuedRequest, allowed_s: float, now: float) -> Verdict:
        """Queued, allowed WAIT_SLACK times allowed_s; those it goes ahead of wait a permit interval longer."""
        request.max_wait_s = min(self.config.max_queue_wait_s, WAIT_SLACK * allowed_s)
        passed = self.queue.behind(request)
        shed = self.queue.push(request)
        if shed is request:
            return Verdict("rejected", "queue_full", self.retry_after_s())
        self._emptied_s.pop(request.priority, None)
        if shed is not None:
            self._note_emptied(now)
        self._extend_waits(passed, self.permit_interval_s() or 0.0)
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
                first_token_s: float | None = None, priority: Priority = Priority.STANDARD) -> list[QueuedRequest]:
        """An admitted request of this priority ended after held_s (its first token first_token_s after
        admission); returns the queued requests admitted in its place. The limit learns from the
        queueing delay of standard and batch requests only: it holds them, and critical ones, which the
        workers serve first, wait less than the work the limit shapes (a drop counts whoever saw it)."""
        now = self._clock()
        self.in_flight -= 1
        self.mean_service_s = self._ewma(self.mean_service_s, held_s)
        if first_token_s is not None:
            self.mean_first_token_s = self._ewma(self.mean_first_token_s, first_token_s)
        limit_before = int(self.limit.limit)
        if priority == Priority.CRITICAL:
            queue_delay_s = None
        self.limit.on_sample(now, queue_delay_s, self.in_flight + 1, dropped, admitted_s=now - held_s)
        cut = limit_before - int(self.limit.limit)
        if cut > 0:
            waiting = [r for r in self.queue if r.priority != Priority.CRITICAL]  # critical: max_limit holds it
            self._extend_waits(waiting, cut * (self.permit_interval_s() or 0.0))
        return self._admit_waiting(now)

    def forget(self) -> list[QueuedRequest]:
        """An admitted request ended without a sample (it never reached a worker)."""
        self.in_flight -= 1
        return self._admit_waiting(self._clock())

    def cancel(self, request: QueuedRequest) -> None:
        """A queued request's client went away."""
        if self.queue.remove(request):
            self._note_emptied(self._clock())

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
            self._note_emptied(now)
        return expired

    def _allowed_wait_s(self, request: QueuedRequest, now: float) -> float:
        """Critical: max_queue_wait_s. Others, plus the intervals the requests in flight above a cut
        limit take to drain (the request that goes next waits that out rather than being refused):
        - a tenant served less than its fair share: what the pool drains in queue_interval_s, or its
          credit's worth of permit intervals if longer (IDLE_CREDIT_TURNS x its weight: it goes first,
          so it waits only for its own burst and for permits that come back in clumps; the credit
          bounds the burst);
        - a tenant whose queue drains (it had nothing queued at some moment within the last
          queue_interval_s): what the pool drains in that interval (a burst is absorbed);
        - a tenant whose queue stands: queue_target_s, or STANDING_INTERVALS permit intervals when
          permits come back more slowly than that (its next request follows its last and a turn of
          each other backlogged tenant)."""
        config = self.config
        if request.priority == Priority.CRITICAL:
            return config.max_queue_wait_s
        interval_s = self.permit_interval_s() or 0.0
        over_limit = max(0, self.in_flight - self._capacity(request.priority))
        standing_s = max(config.queue_target_s, STANDING_INTERVALS * interval_s)
        if self.queue.under_share(request.tenant, request.priority):
            base_s = max(config.queue_interval_s, standing_s, IDLE_CREDIT_TURNS * request.weight * interval_s)
        elif self._queue_stands(request, now):
            base_s = standing_s
        else:
            base_s = max(config.queue_interval_s, standing_s)
        return min(config.max_queue_wait_s, base_s + over_limit * interval_s)

    def _queue_stands(self, request: QueuedRequest, now: float) -> bool:
        """Whether request's tenant has had requests of its priority queued, without a break, for
        longer than queue_interval_s."""
        since_s = self.queue.backlogged_since_s(request.tenant, request.priority)
        return since_s is not None and now - since_s > self.config.queue_interval_s

    def _capacity(self, priority: Priority) -> int:
        """Requests in flight a new one of this priority may join: the adaptive limit; critical ones,
        what the pool's workers run (max_limit): the limit shapes everyone else's work around theirs."""
        if priority == Priority.CRITICAL:
            return self.config.limit.max_limit
        return int(self.limit.limit)

    def _extend_waits(self, requests: Iterable[QueuedRequest], delay_s: float) -> None:
        """These queued requests wait delay_s longer than they were predicted to, through no error of
        the prediction (a cut took permits back; a request queued after them goes first), so their
        allowed waits move by as much (within max_queue_wait_s) rather than ending in a queue_timeout."""
        for request in requests:
            if request.max_wait_s is not None:
                request.max_wait_s = min(self.config.max_queue_wait_s, request.max_wait_s + delay_s)

    def _admit_waiting(self, now: float) -> list[QueuedRequest]:
        admitted = []
        while (priority := self.queue.most_urgent()) is not None and self.in_flight < self._capacity(priority):
            request = self.queue.pop()
            if request is None:
                break
            self.in_flight += 1
            admitted.append(request)
        if admitted:
            self._note_emptied(now)
        return admitted

    def _note_emptied(self, now: float) -> None:
        """Requests left the queue: note since when each priority's queue has been empty."""
        for priority in Priority:
            if not self.queue.depth(priority):
                self._emptied_s.setdefault(priority, now)

    def _end_idle_busy_period(self, priority: Priority, now: float) -> None:
        """Each queue_interval_s a priority's queue stands empty ends a busy period: its fair queue forgets
        who was served more in the last one, from this arrival on (those admitted at once as the next
        congestion builds count in it; a short gap, as a clump of permits comes back under steady
        overload, does not end it)."""
        if self.queue.depth(priority):
            return
        if now - self._emptied_s.setdefault(priority, now) >= self.config.queue_interval_s:
            self.queue.end_busy_period(priority)
            self._emptied_s[priority] = now

    def _ewma(self, mean: float | None, sample: float) -> float:
        alpha = self.config.service_ewma_alpha
        return sample if mean is None else (1 - alpha) * mean + alpha * sample

    def retry_after_s(self) -> float:
        """When a refused request might find room: the queue's length in permit intervals (at least 1 s)."""
        interval_s = self.permit_interval_s()
        if interval_s is None:
            return 1.0
        return max(1.0, math.ceil((len(self.queue) + 1) * interval_s))
