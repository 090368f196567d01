"""The bounded queue in front of a pool: strict order across priorities, weighted fair across tenants.

Within a priority, tenants take turns by weight (start-time fair queuing over tenants: a tenant's
turns come 1 / weight apart in virtual time, the lowest goes first), so a tenant that floods the
queue waits behind its own requests, not in front of everyone else's. A request admitted without
queueing takes its tenant's turn too. A tenant that has used less than its share lately goes ahead of
those that used more, for a bounded burst (IDLE_CREDIT_TURNS); when a busy period ends (the caller
says when), every tenant starts the next with that credit. Within a tenant, later steps of a workflow go
before new work (the work spent on their earlier steps is lost if they fail), then arrival order.
ahead_of() counts the requests a new one would follow, behind() lists those it would go before. When
the queue is full, the request shed is the newest of the tenant that holds the most of the least urgent
priority present, for its weight (possibly the request arriving; its new work before its workflow
continuations); critical requests are shed last.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from admission.priority import Priority

# How far behind the virtual time a tenant's next turn may start when it has been served less than
# its share (idle, or under it): bursts of up to this many requests (times its weight) go ahead of
# backlogged tenants. Without it, a tenant using 90% of its share beside a flood is held to exactly its
# share whenever it has two queued, and its Poisson bursts (2.5 times its mean rate over a second, a few
# times a minute) wait turns they need not wait. Linux's CFS places a waking task the same way: no further
# back than a bounded credit behind the queue's minimum. Beside a flood, the credit is a random walk: each
# of the flood's turns adds one, each of the tenant's takes one, so a tenant at a fraction f of its share
# banks 1 - f of the pool's turns and runs dry with a probability that falls as exp(-2 (1 - f) credit)
# (more slowly when permits come back in clumps). At 16, a tenant at 0.7 of its share beside a 5x flood
# ran dry about once a minute (issue #50: its burst then took turns with the flood, on the flood's short
# allowance, and was refused); 32 squares those odds.
IDLE_CREDIT_TURNS = 32.0


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """A request waiting for its pool (compared by identity). handle is the caller's (e.g. the
    future its client waits on)."""

    tenant: str
    priority: Priority
    weight: float = 1.0
    enqueued_s: float = 0.0
    deadline_s: float | None = None  # absolute, on the admission clock
    max_wait_s: float | None = None  # the longest it may wait (set when it is queued)
    workflow_step: int | None = None  # 2 and later: a continuation of a workflow
    handle: Any = None

    @property
    def continues_workflow(self) -> bool:
        return self.workflow_step is not None and self.workflow_step > 1


@dataclass(slots=True)
class _TenantQueue:
    weight: float
    continuations: deque[QueuedRequest] = field(default_factory=deque)
    new: deque[QueuedRequest] = field(default_factory=deque)
    turn: float = 0.0  # virtual time of its next turn while backlogged
    seq: int = 0  # that turn's tie-break in the heap (the lower goes first at equal turns)
    backlogged_since_s: float = 0.0  # enqueued_s of the request that found it empty

    def __len__(self) -> int:
        return len(self.continuations) + len(self.new)


class _Level:
    """One priority: start-time fair queuing over its tenants (Goyal, Vin, Cheng, "Start-time Fair
    Queueing", 1996). Each request gets a start tag: its tenant's previous finish tag, but no earlier
    than IDLE_CREDIT_TURNS before the virtual time (so idleness earns a bounded credit); finish =
    start + 1 / weight. The lowest start tag goes first, and the virtual time is the highest start tag
    served (queued or admitted at once). A tenant arriving beside a flood is served first, not after the
    flood's queued requests; two tenants that both stay backlogged take turns by weight. As SFQ resets
    its tags when its server idles, forget_finish_tags() starts a busy period afresh."""

    def __init__(self) -> None:
        self.tenants: dict[str, _TenantQueue] = {}
        self.turns: list[tuple[float, int, str]] = []  # (turn, tie-break, tenant); stale ones skipped
        self.virtual_s = 0.0
        self.size = 0
        self._finish: dict[str, float] = {}  # each tenant's last finish tag (kept while it is ahead of virtual_s)
        self._seq = itertools.count()

    def push(self, request: QueuedRequest) -> None:
        queue = self.tenants.get(request.tenant)
        if queue is None:
            queue = self.tenants[request.tenant] = _TenantQueue(request.weight)
        if not queue:
            queue.turn, queue.seq = self._start_tag(request.tenant), next(self._seq)
            queue.backlogged_since_s = request.enqueued_s
            heapq.heappush(self.turns, (queue.turn, queue.seq, request.tenant))
        (queue.continuations if request.continues_workflow else queue.new).append(request)
        self.size += 1

    def pop(self) -> QueuedRequest:
        while True:
            turn, seq, tenant = heapq.heappop(self.turns)
            queue = self.tenants.get(tenant)
            if queue is not None and queue and (queue.turn, queue.seq) == (turn, seq):
                break
        request = (queue.continuations or queue.new).popleft()
        self.size -= 1
        finish = self._take_turn(tenant, turn, queue.weight)
        if queue:
            queue.turn, queue.seq = finish, next(self._seq)
            heapq.heappush(self.turns, (queue.turn, queue.seq, tenant))
        else:
            del self.tenants[tenant]
            self._forget_idle()
        return request

    def serve(self, tenant: str, weight: float) -> None:
        """A request of tenant admitted without waiting (nothing of this level queued) takes its turn."""
        self._take_turn(tenant, self._start_tag(tenant), weight)
        self._forget_idle()

    def _take_turn(self, tenant: str, turn: float, weight: float) -> float:
        """tenant is served at turn: the virtual time moves to it (if later), its finish tag one turn on."""
        self.virtual_s = max(self.virtual_s, turn)
        finish = self._finish[tenant] = turn + 1.0 / weight
        return finish

    def ahead_of(self, request: QueuedRequest) -> int:
        """How many queued requests of this level request would follow: its own tenant's (only the
        continuations, for a continuation), and the other tenants' turns before its own. Of turns
        equal to its own, those already in the heap go first, unless request takes its tenant's turn
        that is there (exact for a new tenant; equal turns not yet in the heap are not counted)."""
        own, start, entry = self._place(request)
        return own + sum(self._turns_before(q, start, entry) for name, q in self.tenants.items()
                         if name != request.tenant)

    def behind(self, request: QueuedRequest) -> list[QueuedRequest]:
        """The queued requests of this level that request, queued now, would go before: the other
        tenants' whose turns come after its own (as ahead_of counts them), and its own tenant's new
        work when it is a continuation."""
        own, start, entry = self._place(request)
        passed = []
        for name, queue in self.tenants.items():
            if name == request.tenant:
                if request.continues_workflow:
                    passed += queue.new
                continue
            skip = self._turns_before(queue, start, entry)
            passed += itertools.islice(itertools.chain(queue.continuations, queue.new), skip, None)
        return passed

    def _place(self, request: QueuedRequest) -> tuple[int, float, tuple[float, float]]:
        """Where request would go: its own tenant's requests before it, its start tag, and its entry
        in the heap's order."""
        queue = self.tenants.get(request.tenant)
        if queue:
            own = len(queue.continuations) if request.continues_workflow else len(queue)
            start = queue.turn + own / queue.weight
            return own, start, (queue.turn, queue.seq) if own == 0 else (start, math.inf)
        start = self._start_tag(request.tenant)
        return 0, start, (start, math.inf)

    @staticmethod
    def _turns_before(queue: _TenantQueue, start: float, entry: tuple[float, float]) -> int:
        """How many of another tenant's queued requests are served before a start tag of start."""
        return min(len(queue), max(int((queue.turn, queue.seq) < entry), math.ceil((start - queue.turn) * queue.weight)))

    def requests(self) -> Iterator[QueuedRequest]:
        for queue in self.tenants.values():
            yield from queue.continuations
            yield from queue.new

    def under_share(self, tenant: str) -> bool:
        queue = self.tenants.get(tenant)
        turn = queue.turn if queue else self._start_tag(tenant)
        others = [q.turn for name, q in self.tenants.items() if name != tenant]
        return bool(others) and turn + 1.0 < min(others)

    def _start_tag(self, tenant: str) -> float:
        """The turn of a tenant that has nothing queued: its last finish tag, within the credit."""
        floor = self.virtual_s - IDLE_CREDIT_TURNS
        return max(floor, self._finish.get(tenant, floor))

    def forget_finish_tags(self) -> None:
        self._finish.clear()

    def _forget_idle(self) -> None:
        """Finish tags at or behind the credit's floor say nothing more (_start_tag picks the floor)."""
        if len(self._finish) > 2 * len(self.tenants) + 64:
            floor = self.virtual_s - IDLE_CREDIT_TURNS
            self._finish = {t: f for t, f in self._finish.items() if f > floor}

    def remove(self, request: QueuedRequest) -> bool:
        queue = self.tenants.get(request.tenant)
        if queue is None:
            return False
        for part in (queue.continuations, queue.new):
            try:
                part.remove(request)
            except ValueError:
                continue
            self.size -= 1
            if not queue:
                del self.tenants[request.tenant]  # its pending turn goes stale
            return True
        return False

    def heaviest(self, extra_tenant: str | None, extra_weight: float) -> tuple[str, float]:
        """The tenant holding the most for its weight, counting one more request of extra_tenant
        (which wins a tie: the arriving request is the newest, so no queued one is displaced for it)."""
        loads = {name: (len(q), q.weight) for name, q in self.tenants.items()}
        if extra_tenant is not None:
            held, _ = loads.get(extra_tenant, (0, extra_weight))
            loads[extra_tenant] = (held + 1, extra_weight)
        name = max(loads, key=lambda n: (loads[n][0] / loads[n][1], n == extra_tenant))
        return name, loads[name][0] / loads[name][1]


class FairQueue:
    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.max_size = max_size
        self._levels = {priority: _Level() for priority in Priority}

    def __len__(self) -> int:
        return sum(level.size for level in self._levels.values())

    def __iter__(self) -> Iterator[QueuedRequest]:
        for level in self._levels.values():
            yield from level.requests()

    def depth(self, priority: Priority) -> int:
        return self._levels[priority].size

    def serve_at_once(self, request: QueuedRequest) -> None:
        """request was admitted without queueing (nothing as urgent waited): it takes its tenant's turn
        all the same, so service counts alike however it was given (a flood admitted at once as a clump of
        permits comes back still moves the virtual time, and the credit of the others with it)."""
        self._levels[request.priority].serve(request.tenant, request.weight)

    def end_busy_period(self, priority: Priority) -> None:
        """The queue of this priority stood empty (the caller judges for how long): every tenant starts
        the next busy period with its full credit, whoever was served more in the last one (SFQ resets
        its tags when its server idles)."""
        self._levels[priority].forget_finish_tags()

    def backlogged_since_s(self, tenant: str, priority: Priority) -> float | None:
        """Since when the tenant has had requests of this priority queued without a break (by their
        enqueued_s); None while it has none."""
        queue = self._levels[priority].tenants.get(tenant)
        return queue.backlogged_since_s if queue else None

    def under_share(self, tenant: str, priority: Priority) -> bool:
        """Whether the tenant goes ahead of other tenants' waiting requests at this priority on credit:
        others wait, and its next turn comes more than a turn (of weight 1) before any of theirs (it
        has been served less than its share lately; IDLE_CREDIT_TURNS bounds how much less counts;
        tenants that take turns are not under their shares)."""
        return self._levels[priority].under_share(tenant)

    def ahead_of(self, request: QueuedRequest) -> int:
        """Queued requests a new one would follow: every more urgent one, and those of its own
        priority whose turns come before its tenant's next."""
        more_urgent = sum(self._levels[p].size for p in Priority if p < request.priority)
        return more_urgent + self._levels[request.priority].ahead_of(request)

    def behind(self, request: QueuedRequest) -> list[QueuedRequest]:
        """Queued requests a new one would go before: every less urgent one, and those of its own
        priority whose turns come after its own (ahead_of's complement)."""
        less_urgent = [r for p in Priority if p > request.priority for r in self._levels[p].requests()]
        return self._levels[request.priority].behind(request) + less_urgent

    def push(self, request: QueuedRequest) -> QueuedRequest | None:
        """Queue request; when full, shed one (see the module docstring) and return it: the request
        itself when it is the one to go."""
        if len(self) < self.max_size:
            self._levels[request.priority].push(request)
            return None
        victim = self._victim(request)
        if victim is request:
            return request
        self.remove(victim)
        self._levels[request.priority].push(request)
        return victim

    def most_urgent(self) -> Priority | None:
        """The priority of the request pop() would return next (None when empty)."""
        return next((p for p, level in self._levels.items() if level.size), None)

    def pop(self) -> QueuedRequest | None:
        """The next request to admit: the most urgent priority, that priority's next tenant in turn."""
        for level in self._levels.values():
            if level.size:
                return level.pop()
        return None

    def remove(self, request: QueuedRequest) -> bool:
        """Take a request out (its client left, or it timed out); False if it is not queued."""
        return self._levels[request.priority].remove(request)

    def _victim(self, incoming: QueuedRequest) -> QueuedRequest:
        least_urgent = max(p for p in Priority if self._levels[p].size)
        if incoming.priority > least_urgent:
            return incoming
        level = self._levels[least_urgent]
        extra = incoming.tenant if incoming.priority == least_urgent else None
        tenant, _ = level.heaviest(extra, incoming.weight)
        queue = level.tenants.get(tenant)
        if tenant == extra and (queue is None or not queue.new or not incoming.continues_workflow):
            return incoming  # the newest request of the heaviest tenant (a continuation displaces only new work)
        return (queue.new or queue.continuations)[-1]
