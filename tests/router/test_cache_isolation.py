"""Per-tenant cache salts: an isolated tenant's block keys are its own, so the router's predictions never
join its prompts with another tenant's (docs/architecture.md, "Cache isolation")."""

from __future__ import annotations

import random

import pytest

from router.block_keys import block_keys, model_seed
from router.kv_events import BlockStored
from router.kv_index import KvIndex
from router.router import Router
from router.rules import RoutingRules, rule
from router.types import RouteRequest, WorkerSpec

PROMPT = list(range(1, 65))  # 4 blocks of 16
SALTS = {"acme": "acme", "globex": "globex", "initech-a": "initech", "initech-b": "initech"}


@pytest.fixture
def index(clock) -> KvIndex:
    return KvIndex(clock=clock)


@pytest.fixture
def router(clock, index) -> Router:
    pools = {"main": [WorkerSpec(f"w{i}", "m", 16) for i in range(4)]}
    return Router(pools, RoutingRules((rule("default", "main"),)), index=index, clock=clock, rng=random.Random(0),
                  tenant_cache_salts=SALTS)


def route(router: Router, tenant: str | None):
    """The decision for tenant's request; the request then computes its prompt where it was sent
    (its first token), so what it was predicted to cache there counts for the next."""
    ticket = router.route(RouteRequest(model="m", prompt=PROMPT, tenant=tenant))
    ticket.dispatched(ticket.decision.worker_id)
    ticket.first_token()
    return ticket.decision


def test_a_salt_gives_a_chain_of_its_own() -> None:
    assert model_seed("m", "acme") not in (model_seed("m"), model_seed("m", "globex"))
    assert model_seed("m", "acme") == model_seed("m", "acme")
    assert block_keys(PROMPT, 16, "m", "acme")[0] != block_keys(PROMPT, 16, "m")[0]


@pytest.mark.parametrize(("first", "second"), [("acme", "globex"), ("acme", None), (None, "acme"), ("acme", "shared")],
                         ids=["isolated-then-isolated", "isolated-then-shared", "shared-then-isolated",
                              "isolated-then-unsalted-tenant"])
def test_another_tenant_sees_nothing_of_an_isolated_tenants_prompt(router, first, second) -> None:
    assert route(router, first).predicted_cached_tokens == 0
    decision = route(router, second)
    assert decision.predicted_cached_tokens == 0
    assert "cached_blocks=0" in decision.explain() and "cached_blocks=4" not in decision.explain()


def test_an_isolated_tenant_keeps_its_own_predicted_affinity(router) -> None:
    first = route(router, "acme")
    again = route(router, "acme")
    assert again.worker_id == first.worker_id
    assert again.predicted_cached_tokens == 48  # 4 blocks, less the last prompt token's block


def test_tenants_naming_the_same_salt_share_their_predictions(router) -> None:
    first = route(router, "initech-a")
    decision = route(router, "initech-b")
    assert (decision.worker_id, decision.predicted_cached_tokens) == (first.worker_id, 48)


def test_confirmed_blocks_match_shared_tenants_but_never_an_isolated_one(router, index) -> None:
    """Events carry no tenant: confirmed keys are the model's, which salted keys never equal."""
    index.apply("w2", [BlockStored([1, 2, 3, 4], None, PROMPT, 16, None, "GPU")])
    shared = route(router, None)
    assert (shared.worker_id, shared.predicted_cached_tokens) == ("w2", 48)
    assert route(router, "acme").predicted_cached_tokens == 0
