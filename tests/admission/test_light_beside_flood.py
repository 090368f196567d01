"""A tenant within its fair share beside another tenant's flood (issue #50), with a fake clock: every
refusal is decided at arrival ("overloaded"), the flood's, and the light tenant's requests are all
admitted, however its Poisson-like bursts and the clumps in which permits come back fall."""

from collections import Counter
from collections.abc import Callable

import pytest

from admission.concurrency_limit import LimitConfig
from admission.fair_queue import QueuedRequest
from admission.pool_admission import PoolAdmission, PoolAdmissionSettings
from admission.priority import Priority

TICK_S = 1 / 16
LIMIT = 10  # permits; each request holds one about a second: ten a second, five a second each tenant's share
FLOOD_PER_TICK = 4  # 64 a second: 6.4x what the pool serves

Name = tuple[str, int, int]  # (tenant, tick, index within the tick)


def pool_of(clock, **kwargs) -> PoolAdmission:
    """A pool of LIMIT permits (its floor and ceiling) with the default queue settings."""
    return PoolAdmission(PoolAdmissionSettings(LimitConfig(max_limit=LIMIT, min_limit=LIMIT), **kwargs), clock)


def every(ticks: int) -> Callable[[int], bool]:
    return lambda tick: tick % ticks == 0


def run(clock, pool: PoolAdmission, light: Callable[[int], bool], held_s: Callable[[int], float],
        seconds: float = 18.0) -> dict[Name, tuple[float, str]]:
    """Drive the pool tick by tick: FLOOD_PER_TICK of the flood's requests a tick and one of the light
    tenant's on the ticks light() picks, for `seconds`, then until the last is answered; expire() every
    tick; the n-th admitted request is released held_s(n) after its admission. Returns every request's
    arrival time and outcome ("admitted", or the reason it was refused)."""
    start_s, ends = clock(), []  # (time, held_s)
    arrived: dict[Name, float] = {}
    outcome: dict[Name, str] = {}

    def admitted(name: Name) -> None:
        outcome[name] = "admitted"
        held = held_s(sum(1 for o in outcome.values() if o == "admitted"))
        ends.append((clock() + held, held))

    for tick in range(int((seconds + 6) / TICK_S)):
        if tick * TICK_S < seconds:
            names = [("flood", tick, i) for i in range(FLOOD_PER_TICK)] + ([("light", tick, 0)] if light(tick) else [])
            for name in names:
                arrived[name] = clock() - start_s
                verdict = pool.offer(QueuedRequest(name[0], Priority.STANDARD, handle=name))
                if verdict.shed is not None:
                    outcome[verdict.shed.handle] = "shed"
                if verdict.outcome == "admitted":
                    admitted(name)
                elif verdict.outcome == "rejected":
                    outcome[name] = verdict.reason
        for request, reason in pool.expire():
            outcome[request.handle] = reason
        for end in sorted(e for e in ends if e[0] <= clock()):
            ends.remove(end)
            for request in pool.release(held_s=end[1], queue_delay_s=0.1, first_token_s=0.25):
                admitted(request.handle)
        clock.advance(TICK_S)
    assert len(pool.queue) == 0 and outcome.keys() == arrived.keys()
    return {name: (arrived[name], outcome[name]) for name in arrived}


def after(results: dict[Name, tuple[float, str]], warmup_s: float = 2.0) -> Counter[tuple[str, str]]:
    """(tenant, outcome) counts of the requests that arrived once the first permits had come back."""
    return Counter((name[0], outcome) for name, (arrived_s, outcome) in results.items() if arrived_s >= warmup_s)


def spread(n: int) -> float:
    """Held 0.75 to 1.25 s (a second on average): permits come back one or two at a time."""
    return 0.75 + ((n * 7) % 17) / 32


def burst(tick: int) -> bool:
    """One request every fourth tick (4 a second, 0.8 of its share), but every second tick (8 a second, 1.6
    of its share) from 8 s to 11 s: a burst of Poisson arrivals."""
    return tick % (2 if 8 / TICK_S <= tick < 11 / TICK_S else 4) == 0


@pytest.mark.parametrize(("held_s", "light"), [
    (lambda n: 1.0, every(4)),
    (spread, every(4)),
    (spread, burst),
    (lambda n: 1.0, burst),
], ids=["permits-in-one-clump", "permits-spread", "burst-permits-spread", "burst-permits-in-one-clump"])
def test_a_light_tenant_is_admitted_every_time_and_every_refusal_is_the_floods_at_arrival(clock, held_s, light):
    """All the refusals are the flood's and decided at arrival: the light tenant's requests go ahead of the
    flood's on the credit it banks below its share (the flood's requests admitted at once, as a clump of
    permits comes back, count as its turns too), and the flood's queued requests it goes ahead of wait
    that much longer instead of timing out."""
    results = after(run(clock, pool_of(clock), light, held_s))
    assert results[("light", "admitted")] > 0 and results[("flood", "admitted")] > 0
    assert set(results) == {("light", "admitted"), ("flood", "admitted"), ("flood", "overloaded")}, results


def test_the_light_tenants_share_is_what_it_offers_and_the_flood_takes_the_rest(clock):
    results = after(run(clock, pool_of(clock), every(4), spread), warmup_s=0.0)
    served = {tenant: results[(tenant, "admitted")] for tenant in ("light", "flood")}
    assert served["light"] == sum(n for (tenant, _), n in results.items() if tenant == "light")  # 4 a second
    assert 0.9 * 6 * 18 <= served["flood"] <= 6 * 24  # the rest of ten a second (and the drain after)


def test_a_flood_request_a_light_burst_goes_ahead_of_waits_longer_instead_of_timing_out(clock):
    """Queued on a predicted wait of two permit intervals (allowed four), a flood's request is passed by
    twelve of the light tenant's, queued after it on credit: it is admitted fourteen intervals later, past
    WAIT_SLACK times its allowed wait, because every request that went ahead moved that wait by one interval."""
    pool = pool_of(clock)
    interval_s = 0.25

    def flood() -> QueuedRequest:
        return QueuedRequest("flood", Priority.STANDARD)

    def release() -> list[QueuedRequest]:
        clock.advance(interval_s)
        admitted = pool.release(held_s=interval_s * LIMIT, queue_delay_s=0.1)
        assert pool.expire() == []
        return admitted

    for _ in range(LIMIT):
        pool.offer(flood())
    for _ in range(60):  # the flood sends one a permit interval and is served one: its credit spent
        assert pool.offer(flood()).outcome == "queued"
        release()
    late = flood()
    assert [pool.offer(r).outcome for r in (flood(), late)] == ["queued", "queued"]  # two intervals, four allowed
    assert pool.permit_interval_s() == interval_s and pool.queue.under_share("light", Priority.STANDARD)
    light = [QueuedRequest("light", Priority.STANDARD) for _ in range(12)]
    assert [pool.offer(r).outcome for r in light] == ["queued"] * 12
    waited = [clock() - late.enqueued_s for _ in range(16) if late in release()]
    assert waited == [14 * interval_s] and waited[0] > 3 * 4 * interval_s


@pytest.mark.parametrize(("gap_s", "order"), [(0.5, ["light", "flood", "flood", "flood"]),
                                              (0.25, ["flood", "flood", "flood", "light"])],
                         ids=["busy-period-over", "same-busy-period"])
def test_a_tenant_served_most_in_a_busy_period_starts_the_next_even_with_a_new_one(clock, gap_s, order):
    """"light" flooded the pool earlier; once its queue stood empty for queue_interval_s (0.5 s) that busy
    period is over: beside a new flood, which took three permits at once as the congestion built, it goes
    first (a shorter gap is the same busy period: it was served the most, the new flood goes first)."""
    pool = pool_of(clock)
    interval_s = 0.25

    def release() -> list[str]:
        clock.advance(interval_s)
        return [r.tenant for r in pool.release(held_s=interval_s * LIMIT, queue_delay_s=0.1)]

    for _ in range(LIMIT):
        pool.offer(QueuedRequest("light", Priority.STANDARD))
    for _ in range(60):
        pool.offer(QueuedRequest("light", Priority.STANDARD))
        release()
    clock.advance(gap_s)  # since the queue emptied, at the last release; now three permits come back
    assert [r for _ in range(3) for r in pool.release(held_s=interval_s * LIMIT, queue_delay_s=0.1)] == []
    offers = [QueuedRequest(t, Priority.STANDARD) for t in ["flood"] * 6 + ["light"]]
    assert [pool.offer(r).outcome for r in offers] == ["admitted"] * 3 + ["queued"] * 4
    assert [tenant for _ in range(4) for tenant in release()] == order
