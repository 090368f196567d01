"""Router facade: rule -> pool -> tokens -> keys -> index -> policy, predicted entries, closed loop."""

from __future__ import annotations

import random

import pytest

from router.block_keys import block_keys
from router.kv_events import BlockStored
from router.policy_config import load_policies
from router.router import NoRouteError, Router, WorkerSpec
from router.tokenization import RoutingTokenizer
from router.types import RouteRequest

POLICIES = """
rules:
  - name: sticky
    match: {header: {x-mode: sticky}}
    pool: main
    policy: {type: session_affinity}
  - name: default
    pool: main
    fallback_pool: spare
"""
PROMPT = list(range(1, 65))  # 4 blocks of 16


def make_router(clock) -> Router:
    pools = {
        "main": [WorkerSpec(f"w{i}", "m", 16) for i in range(4)],
        "spare": [WorkerSpec("s0", "m", 16)],
    }
    return Router(pools, load_policies(POLICIES), clock=clock, rng=random.Random(0))


def test_routes_to_the_worker_holding_the_prefix(clock) -> None:
    router = make_router(clock)
    router.index.apply("w2", [BlockStored([1, 2, 3], None, PROMPT[:48], 16, None, "GPU")])
    decision = router.route(RouteRequest(model="m", prompt=PROMPT))
    assert decision.worker_id == "w2"
    assert (decision.rule, decision.pool, decision.policy) == ("default", "main", "kv_aware")
    assert decision.predicted_cached_tokens == 48
    assert decision.tokenizer_mode == "approximate"  # no tokenizer configured for "m"
    assert "policy=kv_aware rule=default pool=main" in decision.explain()


def test_chosen_worker_gets_predicted_entries_until_they_expire(clock) -> None:
    router = make_router(clock)
    first = router.route(RouteRequest(model="m", prompt=PROMPT))
    keys = block_keys(PROMPT, 16, "m")
    assert router.index.match(keys) == {first.worker_id: (0, 4)}
    assert router.route(RouteRequest(model="m", prompt=PROMPT)).worker_id == first.worker_id
    clock.advance(11.0)  # kv_aware's prediction_ttl_s is 10 s
    assert router.index.match(keys) == {}


def test_a_worker_that_did_not_serve_the_request_loses_what_its_routing_predicted(clock) -> None:
    """Refused (a 4xx), failed before the first token, or left by its client: the blocks are not
    coming. What an earlier request predicted there (the shared head) stays."""
    router = make_router(clock)
    head = router.route(RouteRequest(model="m", prompt=PROMPT[:32], request_id="head"))
    decision = router.route(RouteRequest(model="m", prompt=PROMPT, request_id="r1"))
    assert decision.worker_id == head.worker_id
    keys = block_keys(PROMPT, 16, "m")
    router.withdraw_prediction("r1", "w-other")  # not the worker it predicted: nothing to withdraw
    assert router.index.match(keys) == {head.worker_id: (0, 4)}
    router.withdraw_prediction("r1", decision.worker_id)
    assert router.index.match(keys) == {head.worker_id: (0, 2)}


def test_a_prediction_made_again_since_is_not_withdrawn(clock) -> None:
    router = make_router(clock)
    first = router.route(RouteRequest(model="m", prompt=PROMPT, request_id="r1"))
    clock.advance(1.0)
    assert router.route(RouteRequest(model="m", prompt=PROMPT, request_id="r2")).worker_id == first.worker_id
    router.withdraw_prediction("r1", first.worker_id)  # r2, in flight, predicts the same blocks
    assert router.index.match(block_keys(PROMPT, 16, "m")) == {first.worker_id: (0, 4)}


def test_unhealthy_pool_falls_back(clock) -> None:
    router = make_router(clock)
    for i in range(4):
        router.set_healthy(f"w{i}", False)
    decision = router.route(RouteRequest(model="m", prompt=PROMPT))
    assert (decision.worker_ids, decision.pool) == (("s0",), "spare")


def test_no_worker_for_the_model_is_a_no_route_error(clock) -> None:
    with pytest.raises(NoRouteError, match="no healthy worker for model 'other'"):
        make_router(clock).route(RouteRequest(model="other", prompt=PROMPT))


def test_header_rule_selects_its_policy(clock) -> None:
    decision = make_router(clock).route(
        RouteRequest(model="m", prompt=PROMPT, session_id="abc", headers={"x-mode": "sticky"})
    )
    assert (decision.rule, decision.policy) == ("sticky", "session_affinity")


def test_dispatch_and_finish_move_load(clock) -> None:
    router = make_router(clock)
    router.on_dispatch("w1", "r1", prefill_tokens=64)
    assert router.load.get("w1").in_flight_requests == 1
    router.on_first_token("r1")
    router.on_finish("r1", output_tokens=5)
    assert router.load.get("w1").in_flight_requests == 0


def test_first_token_returns_the_expected_time_at_the_pools_median_prefill_rate(clock) -> None:
    router = make_router(clock)
    for worker, rate in (("w0", 1000.0), ("w1", 2000.0), ("w2", 4000.0), ("w3", 4000.0), ("s0", 10.0)):
        router.load.get(worker).prefill_tokens_per_s = rate
    router.on_dispatch("w1", "ahead", prefill_tokens=2000)
    router.on_dispatch("w1", "r1", prefill_tokens=1000)
    clock.advance(1.0)
    # r1 waited for 2000 queued tokens plus its own 1000, at main's median rate (3000/s; s0 is another pool)
    assert router.on_first_token("r1") == pytest.approx(1.0)
    assert router.on_first_token("r1") is None  # only the first call samples
    assert router.on_first_token("unknown") is None


@pytest.mark.parametrize(
    ("attempt_key", "worker", "queued"),
    [("r1", "w2", 64 - 48), ("r1#1", "w2", 64 - 48), ("r1#2", "w0", 64), ("other", "w2", 64)],
    ids=["routed-id", "first-attempt-key", "retry-on-a-worker-without-the-prefix", "unknown-request"],
)
def test_dispatch_queues_only_the_prefill_the_worker_must_compute(clock, attempt_key, worker, queued) -> None:
    router = make_router(clock)
    router.index.apply("w2", [BlockStored([1, 2, 3], None, PROMPT[:48], 16, None, "GPU")])
    assert router.route(RouteRequest(model="m", prompt=PROMPT, request_id="r1")).worker_id == "w2"
    router.on_dispatch(worker, attempt_key, prefill_tokens=len(PROMPT))
    assert router.load.get(worker).prefill_tokens_queued == queued


def test_closed_loop_counts_predicted_and_reported(clock) -> None:
    router = make_router(clock)
    router.record_outcome(predicted_cached_tokens=64, reported_cached_tokens=32)
    router.record_outcome(predicted_cached_tokens=0, reported_cached_tokens=16)
    stats = router.closed_loop
    assert (stats.outcomes, stats.predicted_cached_tokens, stats.reported_cached_tokens) == (2, 64, 48)
    assert stats.prediction_hit_ratio == 0.5


def test_removed_worker_is_gone_from_routing_and_index(clock) -> None:
    router = make_router(clock)
    router.index.apply("w2", [BlockStored([1], None, PROMPT[:16], 16, None, "GPU")])
    router.remove_worker("w2")
    decisions = {router.route(RouteRequest(model="m", prompt=PROMPT, request_id=str(i))).worker_id for i in range(8)}
    assert "w2" not in decisions


def test_exact_tokenizer_is_used_when_configured(clock, tmp_path) -> None:
    from conftest import CHATML_TEMPLATE, write_model_dir

    tokenizer = RoutingTokenizer.from_dir(write_model_dir(tmp_path / "m", "byte_level", CHATML_TEMPLATE))
    router = Router({"main": [WorkerSpec("w0", "m", 4)]}, load_policies("rules: [{name: d, pool: main}]"),
                    tokenizers={"m": tokenizer}, clock=clock)
    decision = router.route(RouteRequest(model="m", messages=[{"role": "user", "content": "Hello there"}]))
    assert decision.tokenizer_mode == "exact"
    assert decision.num_prompt_tokens == len(tokenizer.encode_chat([{"role": "user", "content": "Hello there"}]))


def test_with_prompt_copies_every_field_of_the_request() -> None:
    """_with_prompt is a hand-written dataclasses.replace: it must keep up with RouteRequest's fields."""
    import dataclasses

    from router.router import _with_prompt

    values = {f.name: f"value of {f.name}" for f in dataclasses.fields(RouteRequest) if f.name != "messages"}
    req = RouteRequest(**values)  # every field set to something other than its default
    assert _with_prompt(req, 7, (1, 2)) == dataclasses.replace(req, num_prompt_tokens=7, block_keys=(1, 2))
