"""A request its pool would refuse at arrival is admitted by the next pool its rule allows (gateway/admission.py
with gateway/fallbacks.py deciding which): decided at arrival, its tenant's limits counted once, its own
pool's refusal when every pool refuses; a request moved after admission (a prompt too long) holds one slot."""

from __future__ import annotations

import asyncio

import pytest

from admission.priority import Priority
from admission.token_bucket import LocalBuckets
from gateway.admission import AdmissionRequest, Refused, admission_from_config
from gateway.metrics import GatewayMetrics
from kvgate.config import KvgateConfig, build

TIGHT = {"max_concurrency": 1, "initial_concurrency": 1, "queue_size": 1}


def admission(clock, small=TIGHT, tenants=None):
    worker = lambda name, port: [{"name": name, "url": f"http://127.0.0.1:{port}"}]  # noqa: E731
    config = build(KvgateConfig, {
        "pools": {"big": {"model": "big-m", "workers": worker("b", 1), "admission": TIGHT},
                  "small": {"model": "small-m", "workers": worker("s", 2), "admission": small}},
        "tenants": tenants or {}})
    return admission_from_config(config, GatewayMetrics(), LocalBuckets(clock), clock=clock)


def request(tenant: str = "t", pool: str = "big") -> AdmissionRequest:
    return AdmissionRequest(tenant, pool, Priority.STANDARD, max_tokens=1)


async def fill(gate) -> tuple:
    """big at its limit with one more queued (its queue is then full)."""
    running = await gate.admit(request())
    waiting = asyncio.ensure_future(gate.admit(request()))
    await asyncio.sleep(0)
    assert not waiting.done()
    return running, waiting


def test_a_request_its_pool_would_refuse_at_arrival_is_admitted_by_the_overflow_pool(clock):
    async def scenario():
        gate = admission(clock)
        running, waiting = await fill(gate)
        permit = await gate.admit(request(), overflow=["small"])
        assert permit.request.pool == "small" and gate.pools["small"].in_flight == 1
        assert gate.pools["big"].in_flight == 1 and gate.pools["big"].queue.depth(Priority.STANDARD) == 1
        waiting.cancel()
    asyncio.run(scenario())


def test_a_request_its_pool_would_queue_stays_there_and_waits(clock):
    async def scenario():
        gate = admission(clock)
        running = await gate.admit(request())
        waiting = asyncio.ensure_future(gate.admit(request(), overflow=["small"]))
        await asyncio.sleep(0)
        assert not waiting.done() and gate.pools["small"].in_flight == 0  # queued in big, not moved
        running.end(queue_delay_s=None, dropped=False, usage=None)
        assert (await waiting).request.pool == "big"
    asyncio.run(scenario())


def test_when_every_pool_refuses_the_client_hears_its_own_pools_refusal(clock):
    async def scenario():
        gate = admission(clock)
        big = await fill(gate)
        await gate.admit(request(pool="small"))
        small_waiting = asyncio.ensure_future(gate.admit(request(pool="small")))
        await asyncio.sleep(0)
        with pytest.raises(Refused) as refused:
            await gate.admit(request(), overflow=["small"])
        assert refused.value.code == "queue_full" and "pool big" in refused.value.message
        for task in (big[1], small_waiting):
            task.cancel()
    asyncio.run(scenario())


def test_the_tenants_rate_limit_counts_a_moved_request_once(clock):
    async def scenario():
        gate = admission(clock, tenants={"t": {"requests_per_s": 0.001, "requests_burst": 3}})
        running, waiting = await fill(gate)  # two of the three
        moved = await gate.admit(request(), overflow=["small"])
        assert moved.request.pool == "small"
        with pytest.raises(Refused) as refused:  # the fourth: the burst was three, whichever pools served them
            await gate.admit(request(), overflow=["small"])
        assert refused.value.status == 429
        waiting.cancel()
    asyncio.run(scenario())


def test_a_moved_permit_holds_a_slot_in_its_new_pool_and_gives_the_old_one_to_the_next(clock):
    async def scenario():
        gate = admission(clock)
        running, waiting = await fill(gate)
        await gate.move(running, "small")
        assert running.request.pool == "small" and gate.pools["small"].in_flight == 1
        assert (await waiting).request.pool == "big"  # big's slot went to the request queued there
        running.end(queue_delay_s=None, dropped=False, usage=None)
        assert gate.pools["small"].in_flight == 0 and gate.pools["big"].in_flight == 1
    asyncio.run(scenario())
