"""Token buckets in a real redis-server: LocalBuckets' semantics, one bucket across replicas, and
SharedBuckets on local shares while Redis is down (stopped or hung), back on Redis when it returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import redis
import redis.asyncio

from admission.redis_buckets import RedisBuckets, SharedBuckets
from admission.token_bucket import BucketSpec, LocalBuckets, TokenBuckets
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

SPEC = BucketSpec(rate_per_s=10, burst=5)
WAIT_S = 0.03  # tolerance on a wait: real time passes between calls (and sleeps overshoot)


def gateway_client(server: RedisServer) -> redis.asyncio.Redis:
    """The client as the gateway builds it (gateway/core.py _redis_client)."""
    return redis.asyncio.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)


Scenario = Callable[[TokenBuckets], Awaitable[None]]


@pytest.fixture(params=["local", "redis"])
def run_on_buckets(request: pytest.FixtureRequest) -> Callable[[Scenario], None]:
    """Runs one call sequence on LocalBuckets or on RedisBuckets: both must answer it alike."""
    def run(scenario: Scenario) -> None:
        if request.param == "local":
            asyncio.run(scenario(LocalBuckets()))
            return
        server = request.getfixturevalue("redis_server")

        async def on_redis() -> None:
            async with gateway_client(server) as client:
                await scenario(RedisBuckets(client))

        asyncio.run(on_redis())
    return run


async def state_within(shared: SharedBuckets, within_s: float) -> str:
    """shared.state once it is "redis", or at the deadline (the probe needs the loop to run)."""
    deadline_s = time.monotonic() + within_s
    while shared.state != "redis" and time.monotonic() < deadline_s:
        await asyncio.sleep(0.01)
    return shared.state


async def take_all(buckets: TokenBuckets, spec: BucketSpec = SPEC) -> int:
    taken = 0
    while (await buckets.take("t", spec, 1)).wait_s == 0.0:
        taken += 1
    return taken


def test_a_new_bucket_grants_its_burst_then_says_how_long_to_wait(run_on_buckets):
    async def scenario(buckets: TokenBuckets) -> None:
        assert await take_all(buckets) == 5
        wait_s = (await buckets.take("t", SPEC, 3)).wait_s
        assert isinstance(wait_s, float)
        assert wait_s == pytest.approx(0.3, abs=WAIT_S)
    run_on_buckets(scenario)


def test_a_take_says_what_the_bucket_holds_after_it(run_on_buckets):
    """What a response's x-ratelimit-remaining-* reports: the tokens left after a grant, the tokens there
    after a refusal (nothing taken), below zero in debt."""
    async def scenario(buckets: TokenBuckets) -> None:
        granted = await buckets.take("t", SPEC, 3)
        assert granted.wait_s == 0.0 and granted.left == pytest.approx(2, abs=0.2)
        refused = await buckets.take("t", SPEC, 4)
        assert refused.wait_s > 0 and refused.left == pytest.approx(2, abs=0.2)
        assert (await buckets.take("debt", SPEC, 20)).left == pytest.approx(-15, abs=0.2)
    run_on_buckets(scenario)


def test_tokens_refill_at_the_rate(run_on_buckets):
    """Empty at the first take; 0.25 s later 2.5 tokens are back, so after taking 2 the next one is due in
    0.05 s. On a busy machine more time passes between the calls than the sleep: the expected wait is
    bounded by the time measured around the first and the last call, not taken as exactly 0.05 s."""
    async def scenario(buckets: TokenBuckets) -> None:
        before_empty_s = time.monotonic()
        (await buckets.take("t", SPEC, 5)).wait_s
        after_empty_s = time.monotonic()
        await asyncio.sleep(0.25)
        assert (await buckets.take("t", SPEC, 2)).wait_s == 0.0
        before_last_s = time.monotonic()
        wait_s = (await buckets.take("t", SPEC, 1)).wait_s
        after_last_s = time.monotonic()
        # 3 tokens short at the first take, refilled at 10/s: the last one is due 0.3 s after it.
        shortest_s = max(0.0, 0.3 - (after_last_s - before_empty_s))
        longest_s = max(0.0, 0.3 - (before_last_s - after_empty_s))
        assert shortest_s - 0.005 <= wait_s <= longest_s + 0.005
        assert wait_s <= 0.05 + 0.005  # never longer than the rate allows
    run_on_buckets(scenario)


def test_refill_stops_at_the_burst(run_on_buckets):
    async def scenario(buckets: TokenBuckets) -> None:
        (await buckets.take("t", SPEC, 1)).wait_s
        await asyncio.sleep(0.3)
        assert await take_all(buckets) == 5
    run_on_buckets(scenario)


def test_a_request_over_the_burst_is_granted_when_full_and_leaves_debt(run_on_buckets):
    async def scenario(buckets: TokenBuckets) -> None:
        assert (await buckets.take("t", SPEC, 20)).wait_s == 0.0
        assert (await buckets.take("t", SPEC, 1)).wait_s == pytest.approx(1.6, abs=WAIT_S)  # 15 owed + 1
        assert (await buckets.take("t", SPEC, 20)).wait_s == pytest.approx(2.0, abs=WAIT_S)  # until full again
    run_on_buckets(scenario)


def test_a_request_over_the_burst_waits_for_a_full_bucket(run_on_buckets):
    async def scenario(buckets: TokenBuckets) -> None:
        (await buckets.take("t", SPEC, 2)).wait_s
        assert (await buckets.take("t", SPEC, 20)).wait_s == pytest.approx(0.2, abs=WAIT_S)
        await asyncio.sleep(0.21)
        assert (await buckets.take("t", SPEC, 20)).wait_s == 0.0
    run_on_buckets(scenario)


def test_adjust_gives_back_up_to_the_burst(run_on_buckets):
    async def scenario(buckets: TokenBuckets) -> None:
        (await buckets.take("t", SPEC, 5)).wait_s
        await buckets.adjust("t", SPEC, -3)
        assert await take_all(buckets) == 3
        await buckets.adjust("t", SPEC, -100)
        assert await take_all(buckets) == 5
    run_on_buckets(scenario)


def test_adjust_takes_more_without_a_check_into_debt(run_on_buckets):
    async def scenario(buckets: TokenBuckets) -> None:
        await buckets.adjust("t", SPEC, 8)
        assert (await buckets.take("t", SPEC, 1)).wait_s == pytest.approx(0.4, abs=WAIT_S)
    run_on_buckets(scenario)


def test_two_replicas_share_one_bucket(redis_server):
    async def scenario() -> None:
        async with gateway_client(redis_server) as one, gateway_client(redis_server) as two:
            replica_a, replica_b = RedisBuckets(one), RedisBuckets(two)
            assert (await replica_a.take("t", SPEC, 3)).wait_s == 0.0
            assert (await replica_b.take("t", SPEC, 2)).wait_s == 0.0
            assert (await replica_a.take("t", SPEC, 1)).wait_s > 0.0
            assert (await replica_b.take("t", SPEC, 1)).wait_s > 0.0
    asyncio.run(scenario())


def test_a_bucket_key_expires_once_the_bucket_would_be_full(redis_server):
    async def scenario() -> None:
        async with gateway_client(redis_server) as client:
            await RedisBuckets(client, prefix="p:").take("t", SPEC, 1)
    asyncio.run(scenario())
    with redis_server.client() as client:
        assert 0 < client.pttl("p:t") <= 100  # one token at 10/s
        time.sleep(0.15)
        assert not client.exists("p:t")


def test_the_script_is_loaded_again_after_a_script_flush(redis_server):
    async def scenario() -> None:
        async with gateway_client(redis_server) as client:
            buckets = RedisBuckets(client)
            (await buckets.take("t", SPEC, 4)).wait_s
            await client.script_flush()
            assert (await buckets.take("t", SPEC, 1)).wait_s == 0.0
            assert (await buckets.take("t", SPEC, 1)).wait_s > 0.0
    asyncio.run(scenario())


def test_shared_buckets_use_redis_while_it_answers(redis_server):
    async def scenario() -> None:
        async with gateway_client(redis_server) as one, gateway_client(redis_server) as two:
            replica_a = SharedBuckets(RedisBuckets(one), replicas=2)
            replica_b = SharedBuckets(RedisBuckets(two), replicas=2)
            assert (await replica_a.take("t", SPEC, 5)).wait_s == 0.0
            assert (await replica_b.take("t", SPEC, 1)).wait_s > 0.0
            assert replica_a.state == replica_b.state == "redis"
    asyncio.run(scenario())


def test_redis_stopped_means_local_buckets_with_each_replicas_share(redis_server):
    changes: list[str] = []

    async def scenario() -> None:
        async with gateway_client(redis_server) as client:
            shared = SharedBuckets(RedisBuckets(client), replicas=2, on_change=changes.append)
            await shared.take("warm", SPEC, 1)
            redis_server.stop()
            assert await take_all(shared) == 2  # half of 5, burst 2.5: the first answer came from local buckets
            await shared.adjust("t", SPEC, -1)  # never raises either
            assert shared.state == "local"
            await shared.aclose()
    asyncio.run(scenario())
    assert changes == ["local"]


def test_a_hung_redis_costs_one_timeout_then_no_redis_call_per_request(redis_server):
    async def scenario() -> None:
        async with gateway_client(redis_server) as client:
            shared = SharedBuckets(RedisBuckets(client), replicas=1, retry_interval_s=0.1)
            await shared.take("warm", SPEC, 1)
            redis_server.hang()
            started_s = time.monotonic()
            assert (await shared.take("t", SPEC, 1)).wait_s == 0.0
            assert time.monotonic() - started_s < 1.0  # the client's 0.5 s timeout, once
            started_s = time.monotonic()
            for _ in range(20):
                await shared.take("t", SPEC, 1)
                await shared.adjust("t", SPEC, -1)
            assert time.monotonic() - started_s < 0.1  # where one Redis call would take 0.5 s
            assert shared.state == "local"
            redis_server.resume()
            assert await state_within(shared, 0.25) == "redis"
            await shared.aclose()
    asyncio.run(scenario())


def test_back_to_redis_within_a_couple_of_retry_intervals_when_it_returns(redis_server):
    changes: list[str] = []

    async def scenario() -> None:
        async with gateway_client(redis_server) as client:
            shared = SharedBuckets(RedisBuckets(client), replicas=2, retry_interval_s=0.1, on_change=changes.append)
            redis_server.stop()
            await shared.take("t", SPEC, 1)
            redis_server.start()
            assert await state_within(shared, 0.25) == "redis"  # probes every 0.1 s
            await shared.take("t", SPEC, 1)
            await shared.aclose()
    asyncio.run(scenario())
    assert changes == ["local", "redis"]
    with redis_server.client() as client:
        assert client.exists("kvgate:bucket:t")  # the take after recovery went to Redis
