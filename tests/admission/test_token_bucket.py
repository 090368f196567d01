"""LocalBuckets with a fake clock: burst, refill, debt from an oversized request, adjust, wait seconds."""

import asyncio

import pytest

from admission.token_bucket import BucketSpec, LocalBuckets

SPEC = BucketSpec(rate_per_s=10, burst=5)


def take_all(buckets: LocalBuckets, spec: BucketSpec = SPEC) -> int:
    taken = 0
    while buckets.take_now("t", spec, 1) == 0.0:
        taken += 1
    return taken


def test_a_new_bucket_grants_its_burst_then_says_how_long_to_wait(clock):
    buckets = LocalBuckets(clock)
    assert take_all(buckets) == 5
    assert buckets.take_now("t", SPEC, 1) == pytest.approx(0.1)
    assert buckets.take_now("t", SPEC, 3) == pytest.approx(0.3)


def test_tokens_refill_at_the_rate(clock):
    buckets = LocalBuckets(clock)
    take_all(buckets)
    clock.advance(0.25)
    assert take_all(buckets) == 2
    assert buckets.take_now("t", SPEC, 1) == pytest.approx(0.05)  # half a token is back already


def test_refill_stops_at_the_burst(clock):
    buckets = LocalBuckets(clock)
    buckets.take_now("t", SPEC, 1)
    clock.advance(60)
    assert take_all(buckets) == 5


def test_a_denied_take_takes_nothing(clock):
    buckets = LocalBuckets(clock)
    buckets.take_now("t", SPEC, 3)
    assert buckets.take_now("t", SPEC, 4) == pytest.approx(0.2)
    assert take_all(buckets) == 2


def test_a_request_over_the_burst_is_granted_when_full_and_leaves_debt(clock):
    buckets = LocalBuckets(clock)
    assert buckets.take_now("t", SPEC, 20) == 0.0
    assert buckets.take_now("t", SPEC, 1) == pytest.approx(1.6)  # 15 owed + 1
    assert buckets.take_now("t", SPEC, 20) == pytest.approx(2.0)  # until full again
    clock.advance(2.0)
    assert buckets.take_now("t", SPEC, 20) == 0.0


def test_a_request_over_the_burst_waits_for_a_full_bucket(clock):
    buckets = LocalBuckets(clock)
    buckets.take_now("t", SPEC, 2)
    assert buckets.take_now("t", SPEC, 20) == pytest.approx(0.2)
    clock.advance(0.2)
    assert buckets.take_now("t", SPEC, 20) == 0.0


def test_adjust_gives_back_up_to_the_burst(clock):
    buckets = LocalBuckets(clock)
    buckets.take_now("t", SPEC, 5)
    buckets.adjust_now("t", SPEC, -3)
    assert take_all(buckets) == 3
    buckets.adjust_now("t", SPEC, -100)
    assert take_all(buckets) == 5


def test_adjust_takes_more_without_a_check_into_debt(clock):
    buckets = LocalBuckets(clock)
    buckets.adjust_now("t", SPEC, 8)
    assert buckets.take_now("t", SPEC, 1) == pytest.approx(0.4)


def test_buckets_are_independent_per_key(clock):
    buckets = LocalBuckets(clock)
    take_all(buckets)
    assert buckets.take_now("other", SPEC, 5) == 0.0


def test_the_async_calls_answer_like_the_sync_ones(clock):
    async def scenario() -> tuple[float, float]:
        buckets = LocalBuckets(clock)
        await buckets.adjust("t", SPEC, 5)
        return (await buckets.take("t", SPEC, 5)).wait_s, (await buckets.take("t", SPEC, 1)).wait_s

    assert asyncio.run(scenario()) == (pytest.approx(0.5), pytest.approx(0.1))


def test_a_replica_share_scales_rate_and_burst_but_keeps_one_token():
    assert SPEC.scaled(0.5) == BucketSpec(rate_per_s=5, burst=2.5)
    assert BucketSpec(rate_per_s=10, burst=2).scaled(0.25) == BucketSpec(rate_per_s=2.5, burst=1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rate_per_s": 0, "burst": 5}, "rate_per_s must be > 0"),
    ({"rate_per_s": 1, "burst": 0.5}, "burst must be >= 1"),
], ids=["zero-rate", "burst-under-one"])
def test_bad_specs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BucketSpec(**kwargs)
