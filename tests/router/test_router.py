"""Router facade: rule -> pool -> tokens -> keys -> index -> policy -> a ticket; predicted entries,
load and the closed loop, moved by the ticket as the request goes."""

from __future__ import annotations

import random

import pytest

from router.block_keys import block_keys
from router.kv_events import BlockStored
from router.kv_index import KvIndex
from router.load_view import LoadView
from router.router import NoRouteError, PoolChoice, Router
from router.rules import Fallback, RoutingRules, RuleMatch, rule
from router.tokenization import RoutingTokenizer
from router.types import RouteRequest, WorkerSpec

RULES = RoutingRules((
    rule("sticky", "main", policy_type="session_affinity", match=RuleMatch(headers=(("x-mode", "sticky"),))),
    rule("default", "main", fallback_pool="spare"),
))
PROMPT = list(range(1, 65))  # 4 blocks of 16


class Parts:
    """A router with its index and load view in the test's hands."""

    def __init__(self, clock) -> None:
        pools = {
            "main": [WorkerSpec(f"w{i}", "m", 16) for i in range(4)],
            "spare": [WorkerSpec("s0", "m", 16)],
        }
        self.index = KvIndex(clock=clock)
        self.load = LoadView(clock=clock)
        self.router = Router(pools, RULES, index=self.index, load=self.load, clock=clock, rng=random.Random(0))


@pytest.fixture
def parts(clock) -> Parts:
    return Parts(clock)


def test_routes_to_the_worker_holding_the_prefix(parts) -> None:
    parts.index.apply("w2", [BlockStored([1, 2, 3], None, PROMPT[:48], 16, None, "GPU")])
    decision = parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision
    assert decision.worker_id == "w2"
    assert (decision.rule, decision.pool, decision.policy) == ("default", "main", "kv_aware")
    assert decision.predicted_cached_tokens == 48
    assert decision.tokenizer_mode == "approximate"  # no tokenizer configured for "m"
    assert "policy=kv_aware rule=default pool=main" in decision.explain()


def test_chosen_worker_gets_predicted_entries_until_they_expire(parts, clock) -> None:
    first = parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision
    keys = block_keys(PROMPT, 16, "m")
    assert parts.index.match(keys) == {first.worker_id: (0, 4)}
    assert parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision.worker_id == first.worker_id
    clock.advance(11.0)  # kv_aware's prediction_ttl_s is 10 s
    assert parts.index.match(keys) == {}


def test_a_worker_that_did_not_serve_the_request_loses_what_its_routing_predicted(parts) -> None:
    """Refused (a 4xx), failed before the first token, or left by its client: the blocks are not
    coming. What an earlier request predicted there (the shared head) stays."""
    head = parts.router.route(RouteRequest(model="m", prompt=PROMPT[:32])).decision
    ticket = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    assert ticket.decision.worker_id == head.worker_id
    keys = block_keys(PROMPT, 16, "m")
    other = next(w for w in ticket.candidates if w != ticket.decision.worker_id)
    ticket.dispatched(other)  # not the worker it predicted: nothing to withdraw
    ticket.attempt_failed()
    assert parts.index.match(keys) == {head.worker_id: (0, 4)}
    ticket.dispatched(ticket.decision.worker_id)
    ticket.failed("refused")
    assert parts.index.match(keys) == {head.worker_id: (0, 2)}


def test_a_worker_that_computed_the_prompt_keeps_the_prediction(parts) -> None:
    """A failure after the first token (a mid-stream failover) leaves the cache it built."""
    ticket = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    ticket.dispatched(ticket.decision.worker_id)
    ticket.first_token()
    ticket.attempt_failed()
    ticket.failed("failover_failed")
    assert parts.index.match(block_keys(PROMPT, 16, "m")) == {ticket.decision.worker_id: (0, 4)}


def test_a_prediction_made_again_since_is_not_withdrawn(parts, clock) -> None:
    first = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    clock.advance(1.0)
    assert parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision.worker_id == first.decision.worker_id
    first.dispatched(first.decision.worker_id)
    first.failed("refused")  # the second request, in flight, predicts the same blocks
    assert parts.index.match(block_keys(PROMPT, 16, "m")) == {first.decision.worker_id: (0, 4)}


def test_unhealthy_pool_falls_back(parts) -> None:
    for i in range(4):
        parts.router.set_in_rotation(f"w{i}", False)
    decision = parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision
    assert (decision.worker_ids, decision.pool) == (("s0",), "spare")


def test_a_rules_pool_choices_name_each_fallbacks_model_reasons_and_health(clock) -> None:
    rules = RoutingRules((rule("default", "big", fallbacks=(
        Fallback("small", frozenset({"overloaded", "unavailable"})), Fallback("long", frozenset({"context_length_exceeded"})))),))
    pools = {"big": [WorkerSpec("b0", "big-m", 16)], "small": [WorkerSpec("s0", "small-m", 16)], "long": []}
    router = Router(pools, rules, clock=clock, rng=random.Random(0), pool_models={"long": "long-m"})
    big, small, long = router.pool_choices(RouteRequest(model="big-m", prompt=PROMPT))
    assert big == PoolChoice("big", "big-m", frozenset(), True)
    assert small == PoolChoice("small", "small-m", frozenset({"overloaded", "unavailable"}), True)
    assert long == PoolChoice("long", "long-m", frozenset({"context_length_exceeded"}), False)  # no worker yet
    router.set_in_rotation("s0", False)
    assert not router.pool_choices(RouteRequest(model="big-m", prompt=PROMPT))[1].available  # fleet changes show


def test_a_request_placed_in_a_fallback_pool_is_routed_there_with_that_pools_model(clock) -> None:
    rules = RoutingRules((rule("default", "big", fallbacks=(Fallback("small", frozenset({"overloaded"})),)),))
    router = Router({"big": [WorkerSpec("b0", "big-m", 16)], "small": [WorkerSpec("s0", "small-m", 16)]}, rules,
                    clock=clock, rng=random.Random(0))
    decision = router.route(RouteRequest(model="small-m", prompt=PROMPT), pool="small").decision
    assert (decision.pool, decision.worker_ids, decision.rule) == ("small", ("s0",), "default")
    assert router.pool_for(RouteRequest(model="big-m", prompt=PROMPT)) == "big"
    router.set_in_rotation("b0", False)  # an overload-only fallback does not take an unavailable pool's requests
    with pytest.raises(NoRouteError, match="no healthy worker for model 'big-m' in pool 'big'"):
        router.pool_for(RouteRequest(model="big-m", prompt=PROMPT))


def test_no_worker_for_the_model_is_a_no_route_error(parts) -> None:
    with pytest.raises(NoRouteError, match="no healthy worker for model 'other'"):
        parts.router.route(RouteRequest(model="other", prompt=PROMPT))


def test_header_rule_selects_its_policy(parts) -> None:
    decision = parts.router.route(
        RouteRequest(model="m", prompt=PROMPT, session_id="abc", headers={"x-mode": "sticky"})
    ).decision
    assert (decision.rule, decision.policy) == ("sticky", "session_affinity")


def test_a_model_or_path_matches_a_pattern_equal_to_it_and_wildcards_still_match() -> None:
    def req(model: str, path: str = "/v1/completions") -> RouteRequest:
        return RouteRequest(model=model, prompt=PROMPT, path=path)

    literal = RuleMatch(model="llama[8b]")  # a pool's model name as configured: brackets are part of it
    assert literal.matches(req("llama[8b]")) and literal.matches(req("llama8")) and not literal.matches(req("llama9"))
    wildcard = RuleMatch(model="llama-*", path="/v1/*")
    assert wildcard.matches(req("llama-8b")) and not wildcard.matches(req("qwen-7b"))
    assert not wildcard.matches(req("llama-8b", path="/v2/completions"))


def test_new_rules_take_effect_for_the_next_request(parts) -> None:
    parts.router.set_rules(RoutingRules((rule("rr", "main", policy_type="round_robin"),)))
    decision = parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision
    assert (decision.rule, decision.policy) == ("rr", "round_robin")


def test_dispatch_and_finish_move_load(parts) -> None:
    ticket = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    ticket.dispatched("w1")
    assert parts.load.get("w1").in_flight_requests == 1
    ticket.first_token()
    ticket.finished({"completion_tokens": 5})
    assert parts.load.get("w1").in_flight_requests == 0


def test_a_ticket_ends_exactly_once(parts) -> None:
    """Whatever calls follow the first terminal one, the load is released once and the closed
    loop counts the request once."""
    ticket = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    ticket.dispatched(ticket.decision.worker_id)
    ticket.first_token()
    ticket.finished({"completion_tokens": 3})
    ticket.finished({"completion_tokens": 3})
    ticket.failed("client_gone")
    ticket.dispatched("w3")  # nothing starts on an ended ticket
    assert (ticket.state, ticket.outcome) == ("ended", "finished")
    assert all(parts.load.get(f"w{i}").in_flight_requests == 0 for i in range(4))
    assert parts.router.stats().closed_loop["main"].outcomes == 1


def test_first_token_returns_the_expected_time_at_the_pools_median_prefill_rate(parts, clock) -> None:
    for worker, rate in (("w0", 1000.0), ("w1", 2000.0), ("w2", 4000.0), ("w3", 4000.0), ("s0", 10.0)):
        parts.load.get(worker).prefill_tokens_per_s = rate
    ahead = parts.router.route(RouteRequest(model="m", prompt=list(range(10_000, 12_000))))
    ahead.dispatched("w1")
    ticket = parts.router.route(RouteRequest(model="m", prompt=list(range(20_000, 21_000))))
    ticket.dispatched("w1")
    clock.advance(1.0)
    # it waited for 2000 queued tokens plus its own 1000, at main's median rate (3000/s; s0 is another pool)
    assert ticket.first_token() == pytest.approx(1.0)
    assert ticket.first_token() is None  # only the first call samples
    never_sent = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    assert never_sent.first_token() is None


@pytest.mark.parametrize(
    ("prompt", "attempts", "worker", "queued"),
    [(PROMPT, ["w2"], "w2", 64 - 48), (PROMPT, ["w2", "w0"], "w0", 64), (list(range(100, 164)), ["w2"], "w2", 64)],
    ids=["the-worker-holding-the-prefix", "retry-on-a-worker-without-the-prefix", "a-prompt-the-worker-does-not-hold"],
)
def test_dispatch_queues_only_the_prefill_the_worker_must_compute(parts, prompt, attempts, worker, queued) -> None:
    parts.index.apply("w2", [BlockStored([1, 2, 3], None, PROMPT[:48], 16, None, "GPU")])
    ticket = parts.router.route(RouteRequest(model="m", prompt=prompt))
    for attempt in attempts:
        ticket.attempt_failed()
        ticket.dispatched(attempt)
    assert parts.load.get(worker).prefill_tokens_queued == queued
    assert sum(parts.load.get(f"w{i}").in_flight_requests for i in range(4)) == 1  # a retry released the first


def test_closed_loop_counts_predicted_and_reported(parts) -> None:
    long_prompt = list(range(1, 81))  # 5 blocks, 4 of them held by w2: 64 tokens predicted cached
    parts.index.apply("w2", [BlockStored([1, 2, 3, 4], None, long_prompt[:64], 16, None, "GPU")])
    for prompt, reported in ((long_prompt, 32), (list(range(500, 580)), 16)):
        ticket = parts.router.route(RouteRequest(model="m", prompt=prompt))
        ticket.dispatched(ticket.decision.worker_id)
        ticket.first_token()
        ticket.finished({"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": reported}})
    stats = parts.router.stats()
    main = stats.closed_loop["main"]
    assert (main.outcomes, main.predicted_cached_tokens, main.reported_cached_tokens) == (2, 64, 48)
    assert main.prediction_hit_ratio == stats.prediction_hit_ratio == 0.5


@pytest.mark.parametrize("served", ["after-a-retry", "by-another-worker"])
def test_closed_loop_skips_requests_not_served_where_they_were_routed(parts, served) -> None:
    """The prediction is about the routed worker, for one attempt: anything else would compare
    it with another worker's cache."""
    ticket = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    other = next(w for w in ticket.candidates if w != ticket.decision.worker_id)
    if served == "after-a-retry":
        ticket.dispatched(other)
        ticket.attempt_failed()
        ticket.dispatched(ticket.decision.worker_id)
    else:
        ticket.dispatched(other)
    ticket.first_token()
    ticket.finished({"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 16}})
    assert "main" not in parts.router.stats().closed_loop


def test_removed_worker_is_gone_from_routing_and_index(parts) -> None:
    parts.index.apply("w2", [BlockStored([1], None, PROMPT[:16], 16, None, "GPU")])
    parts.router.worker_left("w2")
    decisions = {parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision.worker_id for _ in range(8)}
    assert "w2" not in decisions


def test_a_failed_worker_loses_its_confirmed_entries(parts) -> None:
    parts.index.apply("w2", [BlockStored([1, 2], None, PROMPT[:32], 16, None, "GPU")])
    parts.router.worker_failed("w2")
    assert parts.router.stats().index.blocks_per_worker["w2"] == 0


def test_exact_tokenizer_is_used_when_configured(clock, tmp_path) -> None:
    from tests.router.model_dirs import CHATML_TEMPLATE, write_model_dir

    tokenizer = RoutingTokenizer.from_dir(write_model_dir(tmp_path / "m", "byte_level", CHATML_TEMPLATE))
    router = Router({"main": [WorkerSpec("w0", "m", 4)]}, RoutingRules((rule("d", "main"),)),
                    tokenizers={"m": tokenizer}, clock=clock)
    decision = router.route(RouteRequest(model="m", messages=[{"role": "user", "content": "Hello there"}])).decision
    assert decision.tokenizer_mode == "exact"
    assert decision.num_prompt_tokens == len(tokenizer.encode_chat([{"role": "user", "content": "Hello there"}]))


def test_with_prompt_copies_every_field_of_the_request() -> None:
    """_with_prompt is a hand-written dataclasses.replace: it must keep up with RouteRequest's fields."""
    import dataclasses

    from router.router import _with_prompt

    values = {f.name: f"value of {f.name}" for f in dataclasses.fields(RouteRequest) if f.name != "messages"}
    req = RouteRequest(**values)  # every field set to something other than its default
    assert _with_prompt(req, 7, (1, 2), "w9", {"w9": 3}) == dataclasses.replace(
        req, num_prompt_tokens=7, block_keys=(1, 2), home_worker="w9", prefixes_per_worker={"w9": 3})


def test_a_request_beside_one_still_computing_its_prefix_is_not_predicted_a_hit(parts) -> None:
    """Both go to the worker that will hold the prefix, but only once the first has computed it is
    the prefix counted as cached for the next (a request beside it computes it again)."""
    first = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    second = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    assert second.decision.worker_id == first.decision.worker_id
    assert second.decision.predicted_cached_tokens == 0
    first.dispatched(first.decision.worker_id)
    first.first_token()
    third = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    assert third.decision.worker_id == first.decision.worker_id
    assert third.decision.predicted_cached_tokens == 48  # full blocks, never the last prompt token


@pytest.mark.parametrize("capacity", ["configured", "reported"])
def test_a_prefix_the_work_queued_at_a_small_worker_will_evict_is_not_counted_on(clock, capacity) -> None:
    """Capacity 8 blocks (in the worker's spec, or reported by the worker: a configured value wins),
    a freed 3-block prefix cached: once a request needing 8 new blocks is dispatched ahead, the
    prefix will be evicted (LRU) before the next request runs, though it is still indexed."""
    pools = {"main": [WorkerSpec("w0", "m", 16, num_blocks=8 if capacity == "configured" else None)]}
    index = KvIndex(clock=clock)
    router = Router(pools, RoutingRules((rule("default", "main"),)), index=index, clock=clock, rng=random.Random(0))
    router.worker_cache_config("w0", num_blocks=8 if capacity == "reported" else 4096)
    index.apply("w0", [BlockStored([1, 2, 3], None, PROMPT[:48], 16, None, "GPU")])
    first = router.route(RouteRequest(model="m", prompt=PROMPT))
    assert first.decision.predicted_cached_tokens == 48
    first.failed("test")  # over: its blocks are free at w0 from now on
    probe = router.route(RouteRequest(model="m", prompt=PROMPT))
    assert probe.cached_tokens_at("w0") == 48
    probe.failed("test")
    big = router.route(RouteRequest(model="m", prompt=list(range(1000, 1000 + 8 * 16 + 1))))
    big.dispatched("w0")
    ticket = router.route(RouteRequest(model="m", prompt=PROMPT))
    assert index.match(block_keys(PROMPT, 16, "m"))["w0"][0] == 3  # still indexed: no eviction event yet
    assert (ticket.cached_tokens_at("w0"), ticket.decision.predicted_cached_tokens) == (0, 0)



@pytest.mark.parametrize("told_by", ["report", "events"])
def test_keys_follow_the_block_size_the_worker_reports_over_a_default_in_its_spec(parts, told_by, caplog) -> None:
    """w2 caches in blocks of 32, its spec says 16 (the default where the config gives none): no
    key of 16 matches its events until the router takes the worker's size, from its metrics
    (vllm:cache_config_info) or, with none reported, from the block size its events carry."""
    parts.index.apply("w2", [BlockStored([1, 2], None, PROMPT, 32, None, "GPU")])
    assert parts.index.match(block_keys(PROMPT, 16, "m")) == {}
    parts.router.worker_cache_config("w2", block_size=32 if told_by == "report" else None)
    decision = parts.router.route(RouteRequest(model="m", prompt=PROMPT + [99])).decision
    assert (decision.worker_id, decision.predicted_cached_tokens) == ("w2", 64)
    assert "worker w2 uses KV blocks of 32 tokens, not 16" in caplog.text


def test_a_worker_that_says_nothing_of_its_cache_keeps_its_spec(parts) -> None:
    parts.router.worker_cache_config("w1")
    parts.index.apply("w1", [BlockStored([1, 2, 3], None, PROMPT[:48], 16, None, "GPU")])
    assert parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision.worker_id == "w1"


def test_a_prompt_whose_prefix_every_cache_has_forgotten_goes_back_where_it_went_last(parts, clock) -> None:
    """Its prediction expired and no worker's events hold it (evicted): it returns to its home, though
    another worker now holds a request (of another prompt) and by load alone would not be picked."""
    first = parts.router.route(RouteRequest(model="m", prompt=PROMPT))
    home = first.decision.worker_id
    first.dispatched(home)
    first.first_token()
    first.finished({"prompt_tokens": 64})
    clock.advance(11.0)  # kv_aware's prediction_ttl_s is 10 s
    busy = parts.router.route(RouteRequest(model="m", prompt=list(range(500, 520))))
    busy.dispatched(home)  # another prompt keeps the home busy: one request there, none elsewhere
    again = parts.router.route(RouteRequest(model="m", prompt=PROMPT + [7]))
    assert again.decision.predicted_cached_tokens == 0  # nothing cached anywhere any more
    assert again.decision.worker_id == home


def test_a_peer_replicas_decision_counts_as_this_routers_own(parts, clock) -> None:
    """Another gateway replica sent PROMPT to w3: this router predicts it there (for the TTL the peer
    gave), sends the prompt after it there, and keeps it home there once the prediction expires."""
    keys = block_keys(PROMPT, 16, "m")
    parts.router.peer_routed("w3", keys, 10.0)
    assert parts.index.match(keys) == {"w3": (0, 4)}
    assert parts.router.route(RouteRequest(model="m", prompt=PROMPT + [9])).decision.worker_id == "w3"
    clock.advance(11.0)
    assert parts.router.route(RouteRequest(model="m", prompt=PROMPT + [10])).decision.worker_id == "w3"
    parts.router.peer_routed("gone", keys, None)  # a worker this router does not know: ignored


def test_a_replica_sends_a_prefix_after_the_one_a_peer_has_just_sent_it_with_as_the_peer_would(clock) -> None:
    """Workers of known capacity (their evictions modelled): replica A sends a long new prompt to a
    worker, whose queue is that prompt's prefill now; replica B hears of the decision and of A's load
    but not yet of any KV event. The next request sharing the prefix goes to that worker from B as
    from A: B counts the prefix predicted there, not evicted for never having been seen stored."""
    long_prompt = list(range(1, 20 * 16 + 1))  # 20 blocks

    def replica() -> Router:
        pools = {"main": [WorkerSpec(f"w{i}", "m", 16, num_blocks=1000) for i in range(4)]}
        return Router(pools, RoutingRules((rule("default", "main"),)), clock=clock, rng=random.Random(0))

    a, b = replica(), replica()
    a.on_routed = b.peer_routed
    first = a.route(RouteRequest(model="m", prompt=long_prompt))
    first.dispatched(first.decision.worker_id)
    b.peer_load("a", a.own_load())
    follow_up = RouteRequest(model="m", prompt=long_prompt + [7, 8, 9])
    assert a.route(follow_up).decision.worker_id == first.decision.worker_id
    assert b.route(follow_up).decision.worker_id == first.decision.worker_id


def test_every_decision_is_told_to_on_routed(parts) -> None:
    told = []
    parts.router.on_routed = lambda worker, keys, ttl_s: told.append((worker, keys, ttl_s))
    decision = parts.router.route(RouteRequest(model="m", prompt=PROMPT)).decision
    assert told == [(decision.worker_id, tuple(block_keys(PROMPT, 16, "m")), 10.0)]


def test_a_conversations_first_turn_has_no_home_and_its_later_turns_follow_it(parts, clock) -> None:
    """Two conversations on one system prompt, every cache forgotten between turns: the second one's
    first turn is not pulled to where the first went (the system prompt's last worker) but placed
    where the fewest prefixes and conversations live; each conversation's next turn goes home, to
    where its own last turn went (by the system prompt's blocks alone, both would go where the
    conversation placed last went)."""
    system = {"role": "system", "content": "s" * 640}

    def turn(user: str, *earlier: dict) -> RouteRequest:
        return RouteRequest(model="m", messages=[system, *earlier, {"role": "user", "content": user * 200}],
                            session_id=f"user-{user}")

    first = parts.router.route(turn("a")).decision.worker_id
    clock.advance(11.0)  # kv_aware's prediction_ttl_s is 10 s: nothing cached or predicted anywhere
    second = parts.router.route(turn("b")).decision
    assert second.worker_id != first
    assert second.explanation[0].note == "new session: fewest placed here"
    clock.advance(11.0)
    reply = {"role": "assistant", "content": "r" * 64}
    assert parts.router.route(turn("a", {"role": "user", "content": "a" * 200}, reply)).decision.worker_id == first
    clock.advance(11.0)
    assert parts.router.route(turn("b", {"role": "user", "content": "b" * 200}, reply)).decision.worker_id \
        == second.worker_id


@pytest.mark.parametrize(("full", "roomy"), [("w0", "w1"), ("w1", "w0")])
def test_a_worker_whose_running_requests_hold_its_blocks_is_charged_for_a_prompt_that_does_not_fit(
        clock, full: str, roomy: str) -> None:
    # 4 blocks of prompt and 1 of output: 8 blocks at 75% usage leave 2 free, at 25% 6
    pools = {"main": [WorkerSpec(f"w{i}", "m", 16, num_blocks=8) for i in range(2)]}
    router = Router(pools, RULES, clock=clock, rng=random.Random(0))
    router.worker_load_scraped(full, running_requests=1, kv_usage_frac=0.75)
    router.worker_load_scraped(roomy, running_requests=1, kv_usage_frac=0.25)
    assert router.route(RouteRequest(model="m", prompt=PROMPT)).decision.worker_id == roomy


def test_a_worker_back_in_rotation_cold_is_held_back_while_it_warms_and_its_share_is_reported(clock) -> None:
    router = Router({"main": [WorkerSpec("w0", "m", 16), WorkerSpec("w1", "m", 16)]},
                    RoutingRules((rule("default", "main", policy_type="round_robin"),)), clock=clock,
                    rng=random.Random(3), slow_start_s={"main": 30.0})
    router.start_warm_up("w0")
    assert router.stats().warm_up == {"w0": 0.1, "w1": 1.0}
    decisions = [router.route(RouteRequest(model="m", prompt=[i] * 16)).decision for i in range(200)]
    taken = sum(d.worker_id == "w0" for d in decisions)
    assert taken < 30  # round robin would give it 100
    held = next(d for d in decisions if d.held_back == "w0")
    assert held.worker_id == "w1" and "slow_start_held_back=w0" in held.explain()
    clock.advance(30.0)
    assert router.stats().warm_up == {"w0": 1.0, "w1": 1.0}
