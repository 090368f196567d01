"""A tenant's own limits over local buckets with a fake clock: requests per second with its burst,
tokens per minute reserved, recounted and settled, requests in flight per replica."""

import asyncio

import pytest

from admission.priority import Priority
from admission.tenants import OverLimit, TenantGrant, TenantLimits, TenantPolicy
from admission.token_bucket import LocalBuckets


def run(scenario):
    return asyncio.run(scenario())


def granted(verdict) -> TenantGrant:
    assert isinstance(verdict, TenantGrant), verdict
    return verdict


def test_requests_per_s_grants_its_burst_then_refuses_with_the_wait_for_the_next_token(clock):
    tenant = TenantPolicy("acme", requests_per_s=2)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        granted(await limits.acquire(tenant, 0))
        granted(await limits.acquire(tenant, 0))
        refused = await limits.acquire(tenant, 0)
        assert refused == OverLimit("requests_per_s", pytest.approx(0.5))
        clock.advance(0.5)
        granted(await limits.acquire(tenant, 0))
        assert await limits.acquire(tenant, 0) == OverLimit("requests_per_s", pytest.approx(0.5))

    run(scenario)


def test_a_request_that_does_not_count_takes_tokens_and_a_place_in_flight_but_no_request(clock):
    """A batch's prompts after its first: requests_per_s counts the batch once; tokens_per_min and
    max_concurrency count every prompt."""
    tenant = TenantPolicy("acme", requests_per_s=1, tokens_per_min=600, tokens_burst=250, max_concurrency=3)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        granted(await limits.acquire(tenant, 100))
        granted(await limits.acquire(tenant, 100, counts_request=False))
        assert await limits.acquire(tenant, 100, counts_request=False) == OverLimit("tokens_per_min",
                                                                                    pytest.approx(5.0))
        clock.advance(5.0)
        granted(await limits.acquire(tenant, 10, counts_request=False))
        assert (await limits.acquire(tenant, 10, counts_request=False)).reason == "max_concurrency"
        assert limits.allowed_in_flight(tenant) == 3

    run(scenario)


def test_requests_burst_lets_a_burst_through_above_the_rate(clock):
    tenant = TenantPolicy("acme", requests_per_s=1, requests_burst=5)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        for _ in range(5):
            granted(await limits.acquire(tenant, 0))
        assert await limits.acquire(tenant, 0) == OverLimit("requests_per_s", pytest.approx(1.0))

    run(scenario)


def test_a_rate_under_one_a_second_still_grants_one_request(clock):
    tenant = TenantPolicy("acme", requests_per_s=0.5)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        granted(await limits.acquire(tenant, 0))
        assert await limits.acquire(tenant, 0) == OverLimit("requests_per_s", pytest.approx(2.0))

    run(scenario)


def test_tokens_per_min_reserves_prompt_and_completion_and_refuses_what_does_not_fit(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)  # 10 tokens a second, 600 at once
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 300 + 100))
        assert grant.reserved_tokens == 400
        assert await limits.acquire(tenant, 300) == OverLimit("tokens_per_min", pytest.approx(10.0))
        clock.advance(10.0)
        granted(await limits.acquire(tenant, 300))

    run(scenario)


def test_a_request_refused_for_tokens_gives_its_request_token_back(clock):
    tenant = TenantPolicy("acme", requests_per_s=1, requests_burst=2, tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        granted(await limits.acquire(tenant, 500))
        assert (await limits.acquire(tenant, 200)).reason == "tokens_per_min"
        granted(await limits.acquire(tenant, 100))  # the refused request did not spend the last request token
        assert (await limits.acquire(tenant, 0)).reason == "requests_per_s"

    run(scenario)


def test_recount_after_routing_charges_the_prompt_routing_counted(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 100))  # an estimate before tokenization
        limits.recount(grant, 300)
        await limits.settled()
        assert grant.reserved_tokens == 300
        granted(await limits.acquire(tenant, 300))
        assert (await limits.acquire(tenant, 1)).reason == "tokens_per_min"

    run(scenario)


def test_recount_below_the_estimate_gives_tokens_back(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 500))
        limits.recount(grant, 200)
        await limits.settled()
        granted(await limits.acquire(tenant, 400))

    run(scenario)


def test_settle_with_less_usage_than_reserved_gives_tokens_back(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 400))
        limits.settle(grant, 100)
        await limits.settled()
        granted(await limits.acquire(tenant, 500))
        assert (await limits.acquire(tenant, 1)).reason == "tokens_per_min"

    run(scenario)


def test_settle_with_more_usage_than_reserved_charges_the_difference(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 100))
        limits.settle(grant, 400)
        await limits.settled()
        assert await limits.acquire(tenant, 201) == OverLimit("tokens_per_min", pytest.approx(0.1))
        granted(await limits.acquire(tenant, 200))

    run(scenario)


def test_settle_without_usage_keeps_the_reservation_as_the_charge(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 400))
        limits.settle(grant, None)
        await limits.settled()
        assert limits.in_flight("acme") == 0
        assert (await limits.acquire(tenant, 201)).reason == "tokens_per_min"
        granted(await limits.acquire(tenant, 200))

    run(scenario)


def test_settle_twice_settles_once(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600, max_concurrency=2)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        first = granted(await limits.acquire(tenant, 400))
        granted(await limits.acquire(tenant, 100))
        limits.settle(first, 0)
        limits.settle(first, 0)
        await limits.settled()
        assert limits.in_flight("acme") == 1
        granted(await limits.acquire(tenant, 500))  # 400 came back once, not twice
        limits.settle(first, 0)
        assert (await limits.acquire(tenant, 1)).reason == "max_concurrency"

    run(scenario)


def test_recount_after_settle_changes_nothing(clock):
    tenant = TenantPolicy("acme", tokens_per_min=600)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grant = granted(await limits.acquire(tenant, 100))
        limits.settle(grant, 100)
        limits.recount(grant, 600)
        await limits.settled()
        granted(await limits.acquire(tenant, 500))

    run(scenario)


@pytest.mark.parametrize(("max_concurrency", "replicas", "allowed"), [
    (4, 1, 4),
    (4, 2, 2),
    (10, 2, 5),
    (1, 2, 1),
    (2, 8, 1),
], ids=["one-replica", "two-replicas-halve-it", "ten-over-two", "at-least-one", "more-replicas-than-slots"])
def test_max_concurrency_is_counted_by_each_replica_for_its_share(clock, max_concurrency, replicas, allowed):
    tenant = TenantPolicy("acme", max_concurrency=max_concurrency)
    limits = TenantLimits(LocalBuckets(clock), replicas=replicas)

    async def scenario():
        grants = [granted(await limits.acquire(tenant, 0)) for _ in range(allowed)]
        assert await limits.acquire(tenant, 0) == OverLimit("max_concurrency", 1.0)
        assert limits.in_flight("acme") == allowed
        limits.settle(grants[0], 0)
        granted(await limits.acquire(tenant, 0))

    run(scenario)


def test_a_request_refused_for_concurrency_spends_no_request_token(clock):
    tenant = TenantPolicy("acme", requests_per_s=1, requests_burst=2, max_concurrency=1)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        first = granted(await limits.acquire(tenant, 0))
        assert (await limits.acquire(tenant, 0)).reason == "max_concurrency"
        limits.settle(first, None)
        granted(await limits.acquire(tenant, 0))

    run(scenario)


def test_tenants_have_limits_of_their_own(clock):
    busy = TenantPolicy("busy", requests_per_s=1, tokens_per_min=100, max_concurrency=1)
    calm = TenantPolicy("calm", requests_per_s=1, tokens_per_min=100, max_concurrency=1)
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        granted(await limits.acquire(busy, 100))
        assert isinstance(await limits.acquire(busy, 1), OverLimit)
        granted(await limits.acquire(calm, 100))
        assert (limits.in_flight("busy"), limits.in_flight("calm"), limits.in_flight("other")) == (1, 1, 0)

    run(scenario)


def test_a_tenant_without_limits_is_always_granted_and_reserves_nothing(clock):
    tenant = TenantPolicy("free")
    limits = TenantLimits(LocalBuckets(clock))

    async def scenario():
        grants = [granted(await limits.acquire(tenant, 10_000)) for _ in range(100)]
        assert {g.reserved_tokens for g in grants} == {0.0}
        assert limits.in_flight("free") == 100

    run(scenario)


def test_a_policy_defaults_to_standard_weight_one_and_buckets_of_one_second_and_one_minute():
    tenant = TenantPolicy("acme", requests_per_s=20, tokens_per_min=6000)
    assert (tenant.priority, tenant.weight) == (Priority.STANDARD, 1.0)
    assert (tenant.request_bucket.rate_per_s, tenant.request_bucket.burst) == (20, 20)
    assert (tenant.token_bucket.rate_per_s, tenant.token_bucket.burst) == (100, 6000)
    assert TenantPolicy("none").request_bucket is None and TenantPolicy("none").token_bucket is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"weight": 0}, "weight must be > 0"),
    ({"requests_per_s": 0}, "requests_per_s must be > 0"),
    ({"requests_burst": -1}, "requests_burst must be > 0"),
    ({"tokens_per_min": 0}, "tokens_per_min must be > 0"),
    ({"tokens_burst": 0}, "tokens_burst must be > 0"),
    ({"max_concurrency": 0}, "max_concurrency must be > 0"),
    ({"deadline_ms": -5}, "deadline_ms must be > 0"),
], ids=["zero-weight", "zero-rate", "negative-burst", "zero-tokens", "zero-token-burst", "zero-concurrency",
        "negative-deadline"])
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TenantPolicy("acme", **kwargs)
