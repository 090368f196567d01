"""The pools a request may use (gateway/fallbacks.py): its rule's pool, or the fallbacks that take it when
that pool is unavailable, would refuse it at arrival, or takes no prompt that long; as far as its tenant
accepts moves."""

from __future__ import annotations

import pytest

from admission.tenants import TenantPolicy
from gateway.fallbacks import (CONTEXT_LENGTH_EXCEEDED, OVERLOADED, UNAVAILABLE, after_failed_attempts, no_pool_message,
                               plan, reason_for)
from router.router import PoolChoice

ANY = TenantPolicy("anyone")


def choice(pool: str, *reasons: str, available: bool = True, model: str | None = None) -> PoolChoice:
    return PoolChoice(pool, model or f"{pool}-model", frozenset(reasons), available)


PRIMARY = choice("primary")
SMALL = choice("small", OVERLOADED, UNAVAILABLE)
SPARE = choice("spare", UNAVAILABLE)
LONG = choice("long", CONTEXT_LENGTH_EXCEEDED)


def test_a_rule_without_fallbacks_keeps_its_pool_and_has_none_when_it_is_down():
    only = plan([PRIMARY], ANY)
    assert (only.first, only.overflow, only.longer_context, only.first_reason) == (PRIMARY, (), (), None)
    assert plan([choice("primary", available=False)], ANY) is None


def test_an_available_pool_is_offered_first_with_its_overload_fallbacks_after_it_in_order():
    chosen = plan([PRIMARY, SPARE, SMALL, LONG], ANY)
    assert chosen.first is PRIMARY and chosen.first_reason is None
    assert chosen.overflow == (SMALL,)
    assert chosen.longer_context == (LONG,)
    assert reason_for(chosen, "primary") is None and reason_for(chosen, "small") == OVERLOADED


def test_an_unavailable_pool_is_replaced_by_the_first_fallback_taking_unavailable_moves():
    down = choice("primary", available=False)
    chosen = plan([down, LONG, SMALL, SPARE], ANY)
    assert chosen.first is SMALL and chosen.first_reason == UNAVAILABLE
    assert chosen.overflow == ()  # only fallbacks after the one that serves take its overflow
    assert reason_for(chosen, "small") == UNAVAILABLE


def test_fallbacks_without_a_healthy_worker_are_passed_over():
    chosen = plan([choice("primary", available=False), choice("small", UNAVAILABLE, available=False), SPARE], ANY)
    assert chosen.first is SPARE


@pytest.mark.parametrize(("fallbacks", "first", "overflow"), [
    (False, None, None),
    (frozenset({"spare"}), "spare", ()),
    (True, "small", ("spare",)),
], ids=["refuses-every-move", "accepts-only-spare", "accepts-any"])
def test_a_tenant_is_moved_only_to_the_pools_it_accepts(fallbacks, first, overflow):
    tenant = TenantPolicy("picky", fallbacks=fallbacks)
    spare = choice("spare", UNAVAILABLE, OVERLOADED)
    chosen = plan([choice("primary", available=False), SMALL, spare], tenant)
    if first is None:
        assert chosen is None
    else:
        assert chosen.first.pool == first and tuple(c.pool for c in chosen.overflow) == overflow


def test_a_tenant_that_refuses_moves_still_gets_its_own_pool():
    chosen = plan([PRIMARY, SMALL, LONG], TenantPolicy("strict", fallbacks=False))
    assert (chosen.first, chosen.overflow, chosen.longer_context) == (PRIMARY, (), ())


def test_a_request_without_a_pool_is_told_where_no_worker_was_or_which_moves_its_tenant_refused():
    down = choice("primary", available=False)
    assert no_pool_message([down, choice("small", UNAVAILABLE, available=False), SPARE], "t") == (
        "pool 'primary' has no healthy worker for model 'primary-model'; tenant 't' accepts none of its fallback pools")
    assert no_pool_message([down, choice("small", UNAVAILABLE, available=False), LONG], "t") == (
        "pool 'primary' has no healthy worker for model 'primary-model', nor fallback 'small'")


def test_a_request_whose_attempts_all_failed_moves_to_the_next_untried_unavailable_fallback():
    chosen = plan([PRIMARY, LONG, SMALL, SPARE], ANY)
    assert after_failed_attempts(chosen, "upstream_unavailable", ["primary"]) is SMALL
    assert after_failed_attempts(chosen, "upstream_unavailable", ["primary", "small"]) is SPARE
    assert after_failed_attempts(chosen, "upstream_unavailable", ["primary", "small", "spare"]) is None
    assert after_failed_attempts(chosen, "deadline_exceeded", ["primary"]) is None  # only failed attempts move
