"""Where a request goes when its rule's pool cannot take it: the rule's fallbacks, in order, each for the
reasons it lists (docs/fallbacks.md).

The move is decided at arrival, from what is known then, never after a wait: the rule's pool has no
healthy worker (`unavailable`: the first fallback that takes such moves serves instead), or its
admission would refuse the request now (`overloaded`: its queue is full, the predicted wait is past
what the request is allowed, its deadline cannot be met there); then the next pool that takes
overloaded moves admits it, by its own prediction, with the tenant, priority and deadline the request
had. A prompt longer than the pool takes (`context_length_exceeded`) is known once it is tokenized, just
after admission; it moves then to the first fallback that takes such moves and is long enough. A request
whose every attempt failed before a first token moves on to the next fallback taking `unavailable` moves,
a retry spent from the retry budget. A tenant may refuse moves (tenants.<name>.fallbacks: false, or the
pools it accepts): it gets the refusal instead.

A request served by another pool is sent with that pool's model name; the answer's `model` names the
model that answered and `x-kvgate-pool` the pool. kvgate_fallbacks_total{from_pool,to_pool,reason}, the
request's log line (`fallback`) and its admission span say where it went and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import Span

from admission.tenants import TenantPolicy
from gateway.metrics import GatewayMetrics
from router.router import PoolChoice

OVERLOADED, UNAVAILABLE, CONTEXT_LENGTH_EXCEEDED = "overloaded", "unavailable", "context_length_exceeded"


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """A request's pools, decided at arrival: where it is offered first (its rule's pool, or the fallback
    that serves while that pool is unavailable), the pools that admit it instead when that one would refuse
    it now (overflow, in order), those that take it when its prompt is too long (longer_context), and those
    that take it when every attempt in its pool failed before a first token (unavailable)."""

    rule_pool: str
    first: PoolChoice
    overflow: tuple[PoolChoice, ...]
    longer_context: tuple[PoolChoice, ...]
    unavailable: tuple[PoolChoice, ...] = ()

    @property
    def first_reason(self) -> str | None:
        """Why the request starts elsewhere than its rule's pool (None: it does not)."""
        return None if self.first.pool == self.rule_pool else UNAVAILABLE

    def choice(self, pool: str) -> PoolChoice:
        """The plan's choice for pool (one the plan names)."""
        return next(c for c in (self.first, *self.overflow, *self.longer_context, *self.unavailable)
                    if c.pool == pool)


def plan(choices: Sequence[PoolChoice], tenant: TenantPolicy) -> PoolPlan | None:
    """The plan for a request whose rule offers choices (its own pool first, then its fallbacks), as far as
    its tenant accepts moves; None when no pool it may use has a healthy worker."""
    own, *fallbacks = choices
    if not fallbacks:  # most rules
        return PoolPlan(own.pool, own, (), (), ()) if own.available else None
    usable = [f for f in fallbacks if f.available and tenant.allows_fallback(f.pool)]
    first = own if own.available else next((f for f in usable if UNAVAILABLE in f.reasons), None)
    if first is None:
        return None
    after = usable[usable.index(first) + 1:] if first is not own else usable
    return PoolPlan(own.pool, first, tuple(f for f in after if OVERLOADED in f.reasons),
                    tuple(f for f in usable if CONTEXT_LENGTH_EXCEEDED in f.reasons and f is not first),
                    tuple(f for f in after if UNAVAILABLE in f.reasons))


def no_pool_message(choices: Sequence[PoolChoice], tenant: str) -> str:
    """Why a request has no pool (plan() found none): where no worker was, and which moves were not taken."""
    own, *fallbacks = choices
    message = f"pool {own.pool!r} has no healthy worker for model {own.model!r}"
    takers = [f for f in fallbacks if UNAVAILABLE in f.reasons]
    if any(f.available for f in takers):
        return message + f"; tenant {tenant!r} accepts none of its fallback pools"
    return message + "".join(f", nor fallback {f.pool!r}" for f in takers)


def after_failed_attempts(plan: PoolPlan, error_code: str | None, tried_pools: Sequence[str]) -> PoolChoice | None:
    """Where a request goes when no worker of its pool could begin its answer (every attempt failed before a
    first token: `upstream_unavailable`): the next fallback taking unavailable moves it has not tried."""
    if error_code != "upstream_unavailable":
        return None
    return next((c for c in plan.unavailable if c.pool not in tried_pools), None)


def reason_for(plan: PoolPlan, pool: str) -> str | None:
    """Why the request is in pool at admission (None: its rule's own pool)."""
    if pool == plan.rule_pool:
        return None
    return plan.first_reason if pool == plan.first.pool else OVERLOADED


def note_move(metrics: GatewayMetrics, record: dict | None, span: Span | None, from_pool: str, to_pool: str,
              reason: str) -> None:
    """A request moved from one pool to another: counted, in its log line and on its span."""
    metrics.child(metrics.fallbacks, from_pool, to_pool, reason).inc()
    if record is not None:
        record["fallback"] = {"from_pool": from_pool, "reason": reason}
    if span is not None:
        span.set_attributes({"kvgate.fallback.from_pool": from_pool, "kvgate.fallback.reason": reason})
