"""A pool's admission with a fake clock: admitted under the limit (critical requests a little over it),
queued beyond it and admitted in fair order as permits come back, refused at arrival when its predicted
wait passes the wait it is allowed (CoDel-style: never less while the queue drains than once it stands)
or its predicted first token passes its deadline, refused fast when full, and every queued request
answered in bounded time (deadlines, WAIT_SLACK times its allowed wait)."""

from collections import Counter

import pytest

from admission.concurrency_limit import LimitConfig
from admission.fair_queue import IDLE_CREDIT_TURNS, QueuedRequest
from admission.pool_admission import WAIT_SLACK, PoolAdmission, PoolAdmissionSettings, PoolState
from admission.priority import Priority

CRITICAL, STANDARD, BATCH = Priority.CRITICAL, Priority.STANDARD, Priority.BATCH
QUEUE_TARGET_S, QUEUE_INTERVAL_S, MAX_QUEUE_WAIT_S = 0.125, 1.0, 5.0
EPSILON_S = 1 / 64  # times here are sums of binary fractions: exact in floating point


def pool_of(clock, limit: int = 1, queue_size: int = 16, **kwargs) -> PoolAdmission:
    """A pool whose limit stays at `limit` (its floor and ceiling)."""
    settings = PoolAdmissionSettings(LimitConfig(max_limit=limit, min_limit=limit), queue_size=queue_size,
                                     **{"queue_target_s": QUEUE_TARGET_S, "queue_interval_s": QUEUE_INTERVAL_S,
                                        "max_queue_wait_s": MAX_QUEUE_WAIT_S, **kwargs})
    return PoolAdmission(settings, clock)


def request(tenant: str = "t", priority: Priority = STANDARD, name: str | None = None,
            deadline_s: float | None = None, weight: float = 1.0, step: int | None = None) -> QueuedRequest:
    return QueuedRequest(tenant, priority, weight, deadline_s=deadline_s, workflow_step=step, handle=name or tenant)


def offer_all(pool: PoolAdmission, *requests: QueuedRequest) -> list[str]:
    return [pool.offer(r).outcome for r in requests]


def names(requests: list[QueuedRequest]) -> list[str]:
    return [r.handle for r in requests]


def test_requests_are_admitted_at_once_while_under_the_limit_then_queued(clock):
    pool = pool_of(clock, limit=2)
    assert offer_all(pool, request(), request(), request()) == ["admitted", "admitted", "queued"]
    assert pool.state() == PoolState(limit=2, in_flight=2, queued={CRITICAL: 0, STANDARD: 1, BATCH: 0})


def test_critical_requests_are_admitted_up_to_the_pools_ceiling_whatever_the_adaptive_limit(clock):
    """The adaptive limit shapes standard and batch work around critical work, which only the
    pool's max_limit (what its workers run) holds back."""
    pool = PoolAdmission(PoolAdmissionSettings(LimitConfig(max_limit=6, initial_limit=2)), clock)
    assert offer_all(pool, request(), request(), request(name="plain")) == ["admitted", "admitted", "queued"]
    gold = [request("gold", CRITICAL, name=f"gold{i}") for i in range(5)]
    assert offer_all(pool, *gold) == ["admitted"] * 4 + ["queued"]
    assert pool.in_flight == 6 and pool.state().queued == {CRITICAL: 1, STANDARD: 1, BATCH: 0}


def test_standard_and_batch_are_not_admitted_over_the_limit(clock):
    pool = pool_of(clock, limit=1)
    assert offer_all(pool, request("gold", CRITICAL), request("plain")) == ["admitted", "queued"]
    pool = pool_of(clock, limit=1)
    assert offer_all(pool, request("plain"), request("bulk", BATCH)) == ["admitted", "queued"]


def test_a_critical_request_is_admitted_from_the_queue_while_standard_waits_at_the_limit(clock):
    pool = PoolAdmission(PoolAdmissionSettings(LimitConfig(max_limit=2, initial_limit=1)), clock)
    assert offer_all(pool, request(name="running"), request("plain", name="plain"),
                     request("gold", CRITICAL, name="gold-running"), request("gold", CRITICAL, name="gold")) == \
        ["admitted", "queued", "admitted", "queued"]  # critical goes past the waiting standard request
    assert names(pool.release(held_s=1.0, queue_delay_s=None)) == ["gold"]  # under the pool's ceiling
    assert pool.in_flight == 2 and pool.state().queued[STANDARD] == 1
    assert pool.release(held_s=1.0, queue_delay_s=None) == []  # one in flight: plain waits at the limit
    assert names(pool.release(held_s=1.0, queue_delay_s=None)) == ["plain"]
    assert pool.in_flight == 1


def test_a_release_admits_the_next_queued_request_in_its_place(clock):
    pool = pool_of(clock, limit=1)
    offer_all(pool, request(name="first"), request(name="second"), request(name="third"))
    assert names(pool.release(held_s=1.0, queue_delay_s=0.1)) == ["second"]
    assert pool.in_flight == 1 and len(pool.queue) == 1
    assert names(pool.release(held_s=1.0, queue_delay_s=0.1)) == ["third"]
    assert pool.release(held_s=1.0, queue_delay_s=0.1) == []
    assert pool.state().in_flight == 0


def test_queued_requests_are_admitted_in_priority_then_fair_order(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request("busy", name="running"))
    for i in range(3):
        pool.offer(request("flood", name=f"flood{i}"))
    pool.offer(request("light", name="light0"))
    pool.offer(request("bulk", BATCH, name="bulk0"))
    pool.offer(request("gold", CRITICAL, name="gold0"))
    admitted = [name for _ in range(6) for name in names(pool.release(held_s=1.0, queue_delay_s=None))]
    assert admitted == ["gold0", "flood0", "light0", "flood1", "flood2", "bulk0"]


def test_a_workflows_later_step_is_admitted_before_its_tenants_new_work(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request("agent", name="running"))
    pool.offer(request("agent", name="new-task"))
    pool.offer(request("other", name="other0"))
    pool.offer(request("agent", name="step3", step=3))
    admitted = [name for _ in range(3) for name in names(pool.release(held_s=1.0, queue_delay_s=None))]
    assert admitted == ["other0", "step3", "new-task"]  # other first: agent's running request was agent's turn


def test_forget_gives_the_slot_to_the_next_request_without_a_sample(clock):
    pool = pool_of(clock, limit=1)
    offer_all(pool, request(name="first"), request(name="second"))
    assert names(pool.forget()) == ["second"]
    assert pool.mean_service_s is None and pool.in_flight == 1


def test_a_good_sample_grows_the_limit_and_admits_one_more(clock):
    settings = PoolAdmissionSettings(LimitConfig(max_limit=8, initial_limit=2, decrease_interval_s=0))
    pool = PoolAdmission(settings, clock)  # each sample is a window of its own
    offer_all(pool, *(request(name=f"r{i}") for i in range(5)))
    assert names(pool.release(held_s=1.0, queue_delay_s=0.01)) == ["r2", "r3"]
    assert pool.state().limit == 3 and pool.in_flight == 3


def test_a_full_queue_refuses_the_request_it_sheds_at_once(clock):
    pool = pool_of(clock, limit=1, queue_size=2)
    assert offer_all(pool, request(), request(), request()) == ["admitted", "queued", "queued"]
    verdict = pool.offer(request())
    assert (verdict.outcome, verdict.reason, verdict.retry_after_s) == ("rejected", "queue_full", 1.0)
    assert len(pool.queue) == 2


def test_a_full_queue_sheds_a_queued_request_for_a_more_urgent_one(clock):
    pool = pool_of(clock, limit=1, queue_size=2)
    offer_all(pool, request(name="running"), request("bulk", BATCH, name="bulk0"), request("bulk", BATCH, name="bulk1"))
    verdict = pool.offer(request("gold", CRITICAL, name="gold0"))
    assert verdict.outcome == "queued" and verdict.shed.handle == "bulk1"
    assert pool.state().queued == {CRITICAL: 1, STANDARD: 0, BATCH: 1}


def test_retry_after_follows_the_queue_length_once_a_service_time_is_known(clock):
    pool = pool_of(clock, limit=1, queue_size=2, max_queue_wait_s=20.0)
    assert offer_all(pool, *(request("gold", CRITICAL) for _ in range(3))) == ["admitted"] + ["queued"] * 2
    pool.release(held_s=4.0, queue_delay_s=None)  # one in flight (the pool's ceiling), one queued
    assert pool.in_flight == 1 and len(pool.queue) == 1
    assert pool.offer(request("gold", CRITICAL)).outcome == "queued"
    verdict = pool.offer(request("gold", CRITICAL))
    assert verdict.reason == "queue_full"
    assert verdict.retry_after_s == 12  # two queued and itself, 4 s each through one slot


@pytest.mark.parametrize(("held_s", "retry_after_s"), [(4.0, 8), (0.25, 1), (0.5, 1), (0.625, 2)],
                         ids=["two-intervals", "at-least-one-second", "exactly-one-second", "rounded-up"])
def test_retry_after_is_the_queue_length_plus_one_in_permit_intervals_rounded_up(clock, held_s, retry_after_s):
    pool = pool_of(clock, limit=1)
    offer_all(pool, request(name="running"), request(name="waiting"))
    pool.release(held_s=held_s, queue_delay_s=None)
    assert offer_all(pool, request("gold", CRITICAL)) == ["queued"]  # the pool's ceiling is its limit here
    verdict = pool.offer(request(deadline_s=clock()))
    assert verdict.outcome == "rejected" and verdict.retry_after_s == retry_after_s


# -- deadlines ---------------------------------------------------------------------------------


def test_a_queued_request_is_answered_when_its_deadline_passes(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))
    late = request(name="late", deadline_s=clock() + 0.25)
    patient = request(name="patient")
    offer_all(pool, late, patient)
    clock.advance(0.25 - EPSILON_S)
    assert pool.expire() == []
    clock.advance(EPSILON_S)
    assert pool.expire() == [(late, "deadline_exceeded")]
    assert names(pool.release(held_s=1.0, queue_delay_s=None)) == ["patient"]


def test_a_deadline_is_not_judged_before_any_permit_came_back(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))
    assert pool.predicted_wait_s(request()) is None and pool.permit_interval_s() is None
    assert pool.offer(request(deadline_s=clock() + 0.001)).outcome == "queued"


def test_a_request_whose_predicted_first_token_passes_its_deadline_is_refused_at_once(clock):
    pool = pool_of(clock, limit=1, queue_interval_s=8.0)  # waits of up to max_queue_wait_s are allowed
    offer_all(pool, request(name="a"), request(name="b"))
    pool.release(held_s=2.0, queue_delay_s=None, first_token_s=0.5)  # a ended after 2 s; b runs now
    assert pool.predicted_wait_s(request()) == pytest.approx(2.0) and pool.mean_first_token_s == 0.5
    verdict = pool.offer(request(name="hurried", deadline_s=clock() + 1.5))
    assert (verdict.outcome, verdict.reason) == ("rejected", "deadline_unmeetable")
    assert verdict.retry_after_s >= 1
    # the wait alone fits, the first token half a second after admission does not
    assert pool.offer(request(deadline_s=clock() + 2.25)).reason == "deadline_unmeetable"
    assert pool.offer(request(name="patient", deadline_s=clock() + 2.5)).outcome == "queued"
    # one more ahead now: a third request of the tenant needs 4 s and its first token
    assert pool.offer(request(deadline_s=clock() + 4.25)).reason == "deadline_unmeetable"
    assert pool.offer(request(deadline_s=clock() + 4.5)).outcome == "queued"
    assert pool.offer(request("gold", CRITICAL, deadline_s=clock() + 2.5)).outcome == "queued"


def test_the_mean_first_token_is_fed_only_by_releases_that_report_one(clock):
    pool = pool_of(clock, limit=1, service_ewma_alpha=0.5)
    pool.offer(request())
    pool.release(held_s=2.0, queue_delay_s=None)
    assert pool.mean_first_token_s is None and pool.mean_service_s == 2.0
    pool.offer(request())
    pool.release(held_s=4.0, queue_delay_s=0.1, first_token_s=1.0)
    pool.offer(request())
    pool.release(held_s=4.0, queue_delay_s=0.1, first_token_s=0.5)
    assert (pool.mean_first_token_s, pool.mean_service_s) == (0.75, 3.5)


def test_the_permit_interval_is_the_mean_time_a_permit_is_held_over_the_limit(clock):
    pool = pool_of(clock, limit=4, service_ewma_alpha=0.5)
    assert pool.permit_interval_s() is None
    offer_all(pool, request(), request())
    pool.release(held_s=2.0, queue_delay_s=None)
    assert pool.permit_interval_s() == 0.5
    pool.release(held_s=4.0, queue_delay_s=None)
    assert pool.permit_interval_s() == 0.75


def cut_pool(clock) -> PoolAdmission:
    """Limit 4, r0-r3 in flight and r4, r5 queued; r0 comes back slow: the limit halves to 2 (each
    sample is a window of its own) with 3 still in flight, and nobody is admitted in its place."""
    settings = PoolAdmissionSettings(LimitConfig(max_limit=16, initial_limit=4, queue_delay_target_s=0.5,
                                                 max_cut=0.5, decrease_interval_s=0))
    pool = PoolAdmission(settings, clock)
    offer_all(pool, *(request(name=f"r{i}") for i in range(6)))
    assert pool.release(held_s=3.0, queue_delay_s=2.0) == []
    return pool


def test_the_predicted_wait_counts_the_requests_in_flight_above_a_cut_limit(clock):
    pool = cut_pool(clock)
    assert pool.permit_interval_s() == 1.5
    # one over the limit, r4 and r5 of its tenant, and its own turn
    assert pool.predicted_wait_s(request()) == pytest.approx((1 + 2 + 1) * 1.5)
    # ahead of r4 and r5: r0-r3, admitted at once, were its tenant's turns
    assert pool.predicted_wait_s(request("other")) == pytest.approx((1 + 0 + 1) * 1.5)
    assert pool.predicted_wait_s(request("gold", CRITICAL)) == pytest.approx(1.5)  # none over its capacity, 3
    # allowed two permit intervals and the one over the limit (4.5 s): the next in line waits out the cut,
    # one more of the tenant already queued twice does not
    assert pool.offer(request("other")).outcome == "queued"
    verdict = pool.offer(request())
    assert (verdict.outcome, verdict.reason) == ("rejected", "overloaded")


def test_the_limit_learns_from_standard_and_batch_requests_not_critical_ones(clock):
    """Workers serve critical requests first: their short waits say nothing of the queueing the limit shapes."""
    settings = PoolAdmissionSettings(LimitConfig(max_limit=16, initial_limit=4, queue_delay_target_s=0.5,
                                                 decrease_interval_s=0))
    pool = PoolAdmission(settings, clock)
    offer_all(pool, request("gold", CRITICAL), request("gold", CRITICAL), request())
    pool.release(held_s=1.0, queue_delay_s=2.0, priority=CRITICAL)
    pool.release(held_s=1.0, queue_delay_s=0.0, priority=CRITICAL)
    assert pool.limit.limit == 4
    pool.release(held_s=1.0, queue_delay_s=2.0, priority=BATCH)
    assert pool.limit.limit < 4


def test_a_cut_moves_the_allowed_wait_of_those_queued_by_the_permits_it_took_back(clock):
    settings = PoolAdmissionSettings(LimitConfig(max_limit=16, initial_limit=4, queue_delay_target_s=0.5,
                                                 max_cut=0.5, decrease_interval_s=0), max_queue_wait_s=10.0)
    pool = PoolAdmission(settings, clock)
    queued = [request(name=f"r{i}") for i in range(6)]
    offer_all(pool, *queued)
    allowed = [r.max_wait_s for r in queued[4:]]
    assert pool.release(held_s=3.0, queue_delay_s=2.0) == []  # limit 4 -> 2: two permits, 1.5 s each
    assert [r.max_wait_s for r in queued[4:]] == [a + 2 * 1.5 for a in allowed]


def test_a_request_that_goes_ahead_of_queued_ones_moves_their_allowed_waits_by_a_permit_interval(clock):
    """Queued or admitted past them (critical, over the adaptive limit), a later request delays those
    waiting by the permit it takes, through no error of their predictions."""
    settings = PoolAdmissionSettings(LimitConfig(max_limit=4, initial_limit=1), max_queue_wait_s=20.0)
    pool = PoolAdmission(settings, clock)
    offer_all(pool, request(name="running"), request(name="first"))
    pool.release(held_s=1.0, queue_delay_s=None)  # first runs; a permit a second
    plain, bulk = request("plain"), request("bulk", BATCH)
    offer_all(pool, plain, bulk)
    allowed = {r.handle: r.max_wait_s for r in (plain, bulk)}
    assert pool.offer(request("gold", CRITICAL)).outcome == "admitted"  # past the limit: one permit more
    assert pool.offer(request("other")).outcome == "queued"  # after plain (same turn, queued first), before bulk
    assert pool.offer(request("plain")).outcome == "queued"  # plain's next turn: before bulk only
    assert (plain.max_wait_s, bulk.max_wait_s) == (allowed["plain"] + 1.0, allowed["bulk"] + 3.0)


def test_the_predicted_wait_counts_only_work_as_urgent_or_more_and_the_turns_before_its_tenants(clock):
    pool = pool_of(clock, limit=2)
    offer_all(pool, request(), request(), request("s"))
    offer_all(pool, *(request("bulk", BATCH) for _ in range(10)))
    pool.release(held_s=2.0, queue_delay_s=None)  # "s" takes the slot; one permit a second
    assert pool.predicted_wait_s(request("gold", CRITICAL)) == pytest.approx(1.0)
    assert pool.predicted_wait_s(request()) == pytest.approx(1.0)
    assert pool.predicted_wait_s(request("bulk", BATCH)) == pytest.approx(11.0)
    assert pool.predicted_wait_s(request("other", BATCH)) == pytest.approx(2.0)  # after bulk's next turn


# -- bounded waits, CoDel-style, decided on arrival ---------------------------------------------


def standing_pool(clock, held_s: float, **kwargs) -> PoolAdmission:
    """A pool of limit 1 whose permits are held held_s, with a request of tenant "bulk" (batch) that
    has waited past queue_interval_s, after bulk spent its credit (bulk's queue stands)."""
    pool = pool_of(clock, limit=1, **{"queue_size": 64, **kwargs})
    served = int(IDLE_CREDIT_TURNS) + 1
    offer_all(pool, request(name="running"), *(request("bulk", BATCH, name=f"bulk{i}") for i in range(served + 1)))
    for _ in range(served):
        pool.release(held_s=held_s, queue_delay_s=None)
    assert pool.state().queued[BATCH] == 1 and not pool.queue.under_share("bulk", BATCH)
    clock.advance(QUEUE_INTERVAL_S + EPSILON_S)
    return pool


def test_while_the_queue_drains_everyone_may_wait_max_queue_wait_s(clock):
    pool = pool_of(clock, limit=1, queue_interval_s=10.0)
    pool.offer(request(name="running"))  # the pool's ceiling is its limit here: critical queues too
    waiting = [request(p.label, p) for p in Priority]
    offer_all(pool, *waiting)
    clock.advance(MAX_QUEUE_WAIT_S - EPSILON_S)
    assert pool.expire() == []
    clock.advance(EPSILON_S)
    assert sorted(pool.expire(), key=lambda e: e[0].priority) == [(r, "queue_timeout") for r in waiting]
    assert len(pool.queue) == 0


def test_a_queued_request_times_out_after_wait_slack_times_the_wait_it_was_allowed(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))  # the pool's ceiling is its limit here: critical queues too
    gold, plain, bulk = request("gold", CRITICAL), request("plain", STANDARD), request("bulk", BATCH)
    offer_all(pool, gold, plain, bulk)  # a draining queue: standard and batch are allowed queue_interval_s
    assert plain.max_wait_s == bulk.max_wait_s == WAIT_SLACK * QUEUE_INTERVAL_S
    assert gold.max_wait_s == MAX_QUEUE_WAIT_S
    clock.advance(WAIT_SLACK * QUEUE_INTERVAL_S - EPSILON_S)
    assert pool.expire() == []
    clock.advance(EPSILON_S)
    assert sorted(pool.expire(), key=lambda e: e[0].priority) == [(plain, "queue_timeout"), (bulk, "queue_timeout")]
    clock.advance(MAX_QUEUE_WAIT_S - WAIT_SLACK * QUEUE_INTERVAL_S - EPSILON_S)
    assert pool.expire() == []
    clock.advance(EPSILON_S)
    assert pool.expire() == [(gold, "queue_timeout")]


def test_in_a_standing_queue_a_request_waits_at_most_wait_slack_times_queue_target_s(clock):
    pool = standing_pool(clock, held_s=1 / 32)
    newcomer = request("bulk", BATCH)
    assert pool.offer(newcomer).outcome == "queued"
    assert newcomer.max_wait_s == WAIT_SLACK * QUEUE_TARGET_S
    clock.advance(WAIT_SLACK * QUEUE_TARGET_S - EPSILON_S)
    assert pool.expire() == []
    clock.advance(EPSILON_S)
    assert pool.expire() == [(newcomer, "queue_timeout")]


@pytest.mark.parametrize(("queue_interval_s", "allowed_s"), [(QUEUE_INTERVAL_S, QUEUE_INTERVAL_S), (2.0, 2.0),
                                                             (8.0, MAX_QUEUE_WAIT_S)],
                         ids=["interval", "longer-interval", "capped-at-max-queue-wait"])
def test_while_the_queue_drains_standard_and_batch_are_allowed_queue_interval_s(clock, queue_interval_s, allowed_s):
    pool = pool_of(clock, limit=1, queue_interval_s=queue_interval_s)
    offer_all(pool, request(name="running"), request(name="first"))
    pool.release(held_s=1 / 32, queue_delay_s=None)  # the queue drained just now
    plain, bulk, gold = request("plain"), request("bulk", BATCH), request("gold", CRITICAL)
    assert offer_all(pool, gold, plain, bulk) == ["queued"] * 3  # in order of urgency: nobody goes ahead of another
    assert plain.max_wait_s == bulk.max_wait_s == min(MAX_QUEUE_WAIT_S, WAIT_SLACK * allowed_s)
    assert gold.max_wait_s == MAX_QUEUE_WAIT_S


@pytest.mark.parametrize(("held_s", "allowed_s"), [(1 / 32, QUEUE_TARGET_S), (0.25, 1.0), (2.0, MAX_QUEUE_WAIT_S)],
                         ids=["queue-target", "four-permit-intervals", "capped-at-max-queue-wait"])
def test_once_the_queue_stands_standard_and_batch_are_allowed_queue_target_s_or_four_permit_intervals(
        clock, held_s, allowed_s):
    pool = standing_pool(clock, held_s=held_s)
    bulk, gold = request("bulk", BATCH), request("gold", CRITICAL)
    assert offer_all(pool, bulk, gold) == ["queued", "queued"]
    # gold, queued after bulk, goes first: bulk waits a permit interval (held_s) more than it was allowed
    assert bulk.max_wait_s == min(MAX_QUEUE_WAIT_S, WAIT_SLACK * allowed_s + held_s)
    assert gold.max_wait_s == MAX_QUEUE_WAIT_S


def test_beside_a_tenant_whose_queue_stands_one_whose_queue_drains_keeps_the_draining_allowance(clock):
    """CoDel's standing queue is judged per tenant (as FQ-CoDel judges it per flow), and a tenant
    served less than its share is never standing: the flood's requests get queue_target_s, the other
    tenant's queue_interval_s."""
    pool = standing_pool(clock, held_s=1 / 32)
    flood, light = request("bulk", BATCH), request("light", BATCH)
    assert offer_all(pool, flood, light) == ["queued", "queued"]
    assert flood.max_wait_s == WAIT_SLACK * QUEUE_TARGET_S + 1 / 32  # and a permit interval: light goes first
    assert light.max_wait_s == WAIT_SLACK * QUEUE_INTERVAL_S
    clock.advance(QUEUE_INTERVAL_S + EPSILON_S)  # light's queue has not emptied, but it is under its share
    later = request("light", BATCH)
    assert pool.offer(later).outcome == "queued" and later.max_wait_s == WAIT_SLACK * QUEUE_INTERVAL_S
    assert pool.queue.under_share("light", BATCH) and not pool.queue.under_share("bulk", BATCH)


def test_a_tenant_under_its_share_may_queue_a_burst_its_credit_covers(clock):
    """Beside a flood that spent its credit, a tenant served less than its share goes first: it may
    queue IDLE_CREDIT_TURNS permit intervals of its own (32 x 0.25 s here, more than the flood's second)."""
    pool = standing_pool(clock, held_s=0.25, max_queue_wait_s=4 * IDLE_CREDIT_TURNS * 0.25)
    light = [request("light", BATCH, name=f"light{i}") for i in range(int(IDLE_CREDIT_TURNS) + 1)]
    verdicts = [pool.offer(r) for r in light]
    assert [v.outcome for v in verdicts] == ["queued"] * int(IDLE_CREDIT_TURNS) + ["rejected"]
    assert light[0].max_wait_s == WAIT_SLACK * IDLE_CREDIT_TURNS * 0.25
    assert pool.offer(request("bulk", BATCH)).reason == "overloaded"  # it follows all of light's
    assert names(pool.release(held_s=0.25, queue_delay_s=None)) == ["light0"]


@pytest.mark.parametrize("held_s", [0.75, 1.0, 2.0], ids=["three-quarters", "one", "two"])
def test_while_the_queue_drains_slow_permits_allow_at_least_the_standing_allowance(clock, held_s):
    """Permits slower than a quarter of queue_interval_s: a draining queue allows four permit
    intervals, as a standing one does, not the shorter queue_interval_s."""
    standing = standing_pool(clock, held_s=held_s, max_queue_wait_s=20.0)
    in_standing = request("bulk", BATCH)
    assert standing.offer(in_standing).outcome == "queued"
    draining = pool_of(clock, limit=1, max_queue_wait_s=20.0)
    offer_all(draining, request(name="running"), request(name="first"))
    draining.release(held_s=held_s, queue_delay_s=None)  # the queue drained just now
    plain = [request("plain", name=f"plain{i}") for i in range(5)]
    verdicts = [draining.offer(r) for r in plain]
    assert [v.outcome for v in verdicts] == ["queued"] * 4 + ["rejected"]  # waits of 1 to 5 intervals
    assert plain[0].max_wait_s == in_standing.max_wait_s == min(20.0, WAIT_SLACK * 4 * held_s)
    assert plain[0].max_wait_s > WAIT_SLACK * QUEUE_INTERVAL_S


def test_while_the_queue_drains_a_burst_of_what_it_drains_in_queue_interval_s_is_absorbed(clock):
    pool = pool_of(clock, limit=1)
    offer_all(pool, request(name="running"), request(name="first"))
    pool.release(held_s=0.25, queue_delay_s=None)  # a permit every quarter second; the queue is empty
    burst = [request(name=f"b{i}") for i in range(5)]
    verdicts = [pool.offer(r) for r in burst]
    assert [v.outcome for v in verdicts] == ["queued"] * 4 + ["rejected"]
    assert (verdicts[4].reason, verdicts[4].retry_after_s) == ("overloaded", 2)  # ceil(5 * 0.25)
    assert len(pool.queue) == 4


def test_in_a_standing_queue_a_request_predicted_to_wait_too_long_is_refused_at_arrival(clock):
    pool = standing_pool(clock, held_s=0.25)  # allowed: four permit intervals, a second
    # each would follow bulk1 and those before it: 0.5, 0.75 and 1 s
    assert offer_all(pool, *(request("bulk", BATCH) for _ in range(3))) == ["queued"] * 3
    verdict = pool.offer(request("bulk", BATCH))  # 1.25 s
    assert (verdict.outcome, verdict.reason, verdict.retry_after_s) == ("rejected", "overloaded", 2)
    assert pool.offer(request("plain")).outcome == "queued"  # more urgent than all that waits: 0.25 s
    assert pool.offer(request("gold", CRITICAL)).outcome == "queued"  # allowed max_queue_wait_s
    assert pool.state().queued == {CRITICAL: 1, STANDARD: 1, BATCH: 4}


def test_a_workflow_continuation_is_not_refused_for_its_tenants_own_new_work(clock):
    pool = pool_of(clock, limit=1)
    offer_all(pool, request("agent", name="running"), *(request("agent", name=f"new{i}") for i in range(5)))
    pool.release(held_s=0.25, queue_delay_s=None)  # new0 runs; four of the agent's new requests wait
    clock.advance(QUEUE_INTERVAL_S + EPSILON_S)  # the queue stands: half a second allowed
    assert pool.offer(request("agent", name="new5")).reason == "overloaded"
    step3 = request("agent", name="step3", step=3)
    assert pool.predicted_wait_s(step3) == pytest.approx(0.25)
    assert pool.offer(step3).outcome == "queued"
    assert names(pool.release(held_s=0.25, queue_delay_s=None)) == ["step3"]


def test_a_queue_that_drains_is_not_standing(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))
    for step in range(5):  # a request waits under half a second each time, then is admitted: the queue empties
        waiting = request(name=f"w{step}")
        pool.offer(waiting)
        clock.advance(0.375)
        assert pool.expire() == []
        assert pool.release(held_s=0.375, queue_delay_s=None) == [waiting]
    clock.advance(0.5)
    late = request(name="late")
    pool.offer(late)
    # allowed what a draining queue allows: at least a standing one's four permit intervals
    assert late.max_wait_s == min(MAX_QUEUE_WAIT_S, WAIT_SLACK * max(QUEUE_INTERVAL_S, 4 * 0.375))
    clock.advance(0.9)
    assert pool.expire() == []  # the queue was last empty 0.9 s ago


def test_the_deadline_is_answered_before_the_allowed_wait(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))
    both = request(deadline_s=clock() + MAX_QUEUE_WAIT_S)
    pool.offer(both)
    clock.advance(MAX_QUEUE_WAIT_S)
    assert pool.expire() == [(both, "deadline_exceeded")]


def test_every_queued_request_is_answered_within_max_queue_wait_s(clock):
    """Overload with nothing coming back: each request is admitted, refused at once, or answered
    by expire() within max_queue_wait_s of its arrival (expire runs every 62.5 ms)."""
    tick_s = 1 / 16
    pool = pool_of(clock, limit=2, queue_size=6, queue_interval_s=2.0)
    arrived: dict[int, float] = {}
    answered: dict[int, float] = {}
    reasons: Counter[str] = Counter()
    kinds = [CRITICAL, STANDARD, BATCH, STANDARD]
    for step in range(400):
        if step % 3 == 0 and step < 300:
            i = len(arrived)
            r = QueuedRequest(f"t{i % 5}", kinds[i % 4], handle=i)
            arrived[i] = clock()
            verdict = pool.offer(r)
            if verdict.outcome != "queued":
                answered[i] = clock()
                reasons[verdict.reason or verdict.outcome] += 1
            if verdict.shed is not None:
                answered[verdict.shed.handle] = clock()
                reasons["shed"] += 1
        for r, reason in pool.expire():
            answered[r.handle] = clock()
            reasons[reason] += 1
        clock.advance(tick_s)
    assert len(pool.queue) == 0
    assert answered.keys() == arrived.keys()
    assert max(answered[i] - arrived[i] for i in arrived) <= MAX_QUEUE_WAIT_S + tick_s
    assert set(reasons) == {"admitted", "queue_full", "shed", "queue_timeout"}, reasons


def test_a_cancelled_request_leaves_the_queue_and_is_never_admitted(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))
    gone, stays = request(name="gone"), request(name="stays")
    offer_all(pool, gone, stays)
    pool.cancel(gone)
    pool.cancel(gone)  # twice is harmless
    assert pool.state().queued[STANDARD] == 1
    assert names(pool.release(held_s=1.0, queue_delay_s=None)) == ["stays"]


def test_a_queue_emptied_by_cancel_counts_as_drained(clock):
    pool = pool_of(clock, limit=1)
    pool.offer(request(name="running"))
    gone = request(name="gone")
    pool.offer(gone)
    clock.advance(5 * QUEUE_INTERVAL_S - 1)
    pool.cancel(gone)
    later = request(name="later")
    pool.offer(later)
    assert later.max_wait_s == WAIT_SLACK * QUEUE_INTERVAL_S  # a draining queue's allowance, not a standing one's
    clock.advance(QUEUE_TARGET_S)
    assert pool.expire() == []


def test_state_is_a_snapshot_of_limit_in_flight_and_queue_depths(clock):
    pool = pool_of(clock, limit=2)
    offer_all(pool, request(), request(), request("g", CRITICAL), request("b", BATCH), request("b", BATCH))
    state = pool.state()
    assert state == PoolState(limit=2.0, in_flight=2, queued={CRITICAL: 1, STANDARD: 0, BATCH: 2})
    pool.release(held_s=1.0, queue_delay_s=None)
    assert state.queued[CRITICAL] == 1  # the snapshot does not move with the pool
    assert pool.state().queued == {CRITICAL: 0, STANDARD: 0, BATCH: 2} and pool.state().in_flight == 2


def test_a_slow_sample_lowers_the_limit_and_admits_nobody_in_its_place(clock):
    pool = cut_pool(clock)
    assert pool.state().limit == 2 and pool.in_flight == 3
    assert pool.release(held_s=3.0, queue_delay_s=None) == []
    assert names(pool.release(held_s=3.0, queue_delay_s=None)) == ["r4"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"queue_size": 0}, "queue_size must be >= 1"),
    ({"queue_target_s": 0}, r"queue_target_s must be in \(0, max_queue_wait_s\]"),
    ({"queue_target_s": 6, "max_queue_wait_s": 5}, r"queue_target_s must be in \(0, max_queue_wait_s\]"),
    ({"queue_interval_s": 0}, "queue_interval_s must be > 0"),
], ids=["empty-queue", "zero-target", "target-over-max-wait", "zero-interval"])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolAdmissionSettings(LimitConfig(max_limit=4), **kwargs)


def test_once_a_service_time_is_known_a_flood_is_refused_at_arrival_and_a_light_tenant_keeps_its_share(clock):
    """A flood of 16 requests a second beside a light tenant's one a second, at a pool that serves two a
    second (limit 2, each held 1 s): once the first permit has come back, every refusal is "overloaded",
    decided at arrival (none times out), and the light tenant is admitted every time: half of what is served."""
    tick_s, start_s = 1 / 16, clock()
    pool = pool_of(clock, limit=2)
    ends_s: list[float] = []
    arrived_s: dict[tuple[str, int], float] = {}
    outcome: dict[tuple[str, int], str] = {}
    admitted: list[tuple[float, str]] = []
    for step in range(16 * 23):  # arrivals for 19 s, then time for the last to be answered
        if step < 16 * 19:
            name = ("light" if step % 16 == 8 else "flood", step)
            arrived_s[name] = clock()
            verdict = pool.offer(request(name[0], name=name))
            if verdict.outcome != "queued":
                outcome[name] = verdict.reason or verdict.outcome
            if verdict.outcome == "admitted":
                admitted.append((clock(), name[0]))
                ends_s.append(clock() + 1.0)
        for r, reason in pool.expire():
            outcome[r.handle] = reason
        while ends_s and min(ends_s) <= clock():
            ends_s.remove(min(ends_s))
            for r in pool.release(held_s=1.0, queue_delay_s=0.1, first_token_s=0.25):
                outcome[r.handle] = "admitted"
                admitted.append((clock(), r.tenant))
                ends_s.append(clock() + 1.0)
        clock.advance(tick_s)
    assert len(pool.queue) == 0 and outcome.keys() == arrived_s.keys()
    after = {(tenant, outcome[tenant, step]) for (tenant, step), t in arrived_s.items() if t > start_s + 1.0}
    assert after == {("flood", "admitted"), ("flood", "overloaded"), ("light", "admitted")}
    steady = Counter(tenant for t, tenant in admitted if start_s + 4.0 <= t < start_s + 18.0)
    assert steady == {"light": 14, "flood": 14}
