"""kv_aware: predicted TTFT with penalties for blocks that do not fit and for queues, hot-spot guard, tie sampling."""

from __future__ import annotations

import random

import pytest

from router.policies.kv_aware import KvAware, KvAwareParams
from router.types import RouteRequest
from tests.router._views import request, view

PROMPT = 1024  # 64 blocks of 16


@pytest.mark.parametrize(
    ("params", "table", "expected_first"),
    [
        ({}, [view("a", confirmed=10), view("b", confirmed=60), view("c")], "b"),
        ({}, [view("a", confirmed=64, queued=50_000), view("b")], "b"),
        ({}, [view("a", confirmed=20, free_blocks=10), view("b", confirmed=20, free_blocks=200)], "b"),
        ({}, [view("a", confirmed=62, free_blocks=4), view("b", free_blocks=200)], "a"),
        ({}, [view("a", confirmed=20, waiting=10), view("b", confirmed=20)], "b"),
        ({}, [view("a", confirmed=20, decodes=40), view("b", confirmed=20)], "b"),
        ({}, [view("a", predicted=64), view("b", confirmed=10)], "a"),
        ({"predicted_weight": 0.0}, [view("a", predicted=64), view("b", confirmed=10)], "b"),
        ({"pool_prefill_rate": False},
         [view("a", confirmed=32, prefill_tokens_per_s=100.0), view("b", prefill_tokens_per_s=100_000.0)], "b"),
        ({}, [view("a", confirmed=32, prefill_tokens_per_s=100.0), view("b", prefill_tokens_per_s=100_000.0)], "a"),
    ],
    ids=[
        "longest-prefix",
        "queued-prefill-outweighs-cache",
        "new-blocks-do-not-fit",
        "a-full-cache-holding-the-prefix-fits-the-rest",
        "waiting-queue",
        "running-decodes",
        "predicted-counts",
        "predicted-weight-zero",
        "measured-prefill-rate-per-worker",
        "pooled-prefill-rate",
    ],
)
def test_kv_aware_minimises_predicted_ttft(params: dict, table: list, expected_first: str) -> None:
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(request(PROMPT), table)
    assert decision.worker_id == expected_first


@pytest.mark.parametrize(
    ("params", "expected_first"),
    [({}, "a"), ({"recompute_weight": 0.0}, "b")],
    ids=["recompute-charged-stays-with-the-prefix", "own-ttft-only-duplicates-the-prefix"],
)
def test_worker_already_computing_the_prefix_wins_over_an_idle_one(params: dict, expected_first: str) -> None:
    # a was just sent this prefix (predicted) and is still computing it: 1,100 tokens queued.
    table = [view("a", predicted=64, queued=1100, requests=1), view("b")]
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(request(PROMPT), table)
    assert decision.worker_id == expected_first


@pytest.mark.parametrize(
    ("requests_on_holder", "params", "holder_first"),
    [(2, {}, True), (2, {"hot_min_requests": 1}, False), (8, {}, False)],
    ids=["light-load-keeps-the-prefix", "no-floor-spreads-at-once", "over-floor-and-bound-spreads"],
)
def test_hot_spot_guard_has_a_floor(requests_on_holder: int, params: dict, holder_first: bool) -> None:
    table = [view("a", confirmed=64, requests=requests_on_holder), view("b"), view("c")]
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(request(PROMPT), table)
    assert (decision.worker_id == "a") is holder_first


def test_hot_prefix_holder_is_skipped_so_the_prefix_spreads() -> None:
    table = [view("a", confirmed=64, requests=10), view("b", requests=1), view("c", requests=2)]
    decision = KvAware(rng=random.Random(0)).choose(request(PROMPT), table)
    assert decision.worker_ids == ("b", "c", "a")
    hot = [c for c in decision.explanation if c.worker_id == "a"][0]
    assert hot.note == "hot: over load bound"


def test_configured_max_requests_marks_a_worker_hot() -> None:
    table = [view("a", confirmed=64, requests=4), view("b", requests=4)]
    decision = KvAware(KvAwareParams(max_requests_per_worker=4), rng=random.Random(0)).choose(request(PROMPT), table)
    assert decision.worker_ids == ("a", "b")  # both hot: plain score order
    table = [view("a", confirmed=64, requests=4), view("b", requests=3)]
    decision = KvAware(KvAwareParams(max_requests_per_worker=4), rng=random.Random(0)).choose(request(PROMPT), table)
    assert decision.worker_id == "b"


def test_ties_are_broken_by_sampling_two_and_taking_the_less_loaded() -> None:
    table = [view("a", requests=1), view("b", requests=0), view("c", requests=1), view("d", requests=1)]
    policy = KvAware(KvAwareParams(slack=10.0), rng=random.Random(3))
    chosen = [policy.choose(request(PROMPT), table).worker_id for _ in range(40)]
    assert chosen.count("b") > 10  # b wins whenever sampled
    assert set(chosen) <= {"a", "b", "c", "d"}


def test_tie_breaking_is_reproducible_with_the_same_seed() -> None:
    table = [view(f"w{i}") for i in range(6)]
    first = [KvAware(rng=random.Random(5)).choose(request(PROMPT), table).worker_id for _ in range(3)]
    again = [KvAware(rng=random.Random(5)).choose(request(PROMPT), table).worker_id for _ in range(3)]
    assert first == again


def test_explanation_shows_cached_blocks_and_predicted_ttft() -> None:
    table = [view("a", confirmed=32), view("b")]
    decision = KvAware(rng=random.Random(0)).choose(request(PROMPT), table)
    top = decision.explanation[0]
    assert (top.worker_id, top.cached_blocks) == ("a", 32)
    assert top.predicted_ttft_ms == pytest.approx(512 / 10_000 * 1000)
    assert "a(cached_blocks=32" in decision.explain()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"slack": -1}, "slack: must be >= 0, got -1"),
        ({"predicted_weight": 2}, "predicted_weight: must be <= 1, got 2"),
        ({"max_requests_per_worker": 1.5}, "max_requests_per_worker: must be an integer, got 1.5"),
        ({"queue_penalty_s": "x"}, "queue_penalty_s: must be a number, got 'x'"),
        ({"recompute_weight": -0.5}, "recompute_weight: must be >= 0, got -0.5"),
        ({"hot_min_requests": 0}, "hot_min_requests: must be >= 1, got 0"),
        ({"prediction_ttl_s": 0}, "prediction_ttl_s: must be > 0, got 0"),
        ({"session_slack": -1}, "session_slack: must be >= 0, got -1"),
    ],
    ids=["negative-slack", "weight-above-one", "float-cap", "string", "negative-recompute-weight",
         "zero-hot-floor", "zero-prediction-ttl", "negative-session-slack"],
)
def test_bad_parameters_are_rejected(params: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        KvAwareParams(**params)
    assert str(excinfo.value) == message


@pytest.mark.parametrize(
    ("session_id", "holder_load", "params", "holder_first"),
    [
        ("user-1", 10, {}, True),
        (None, 10, {}, False),
        ("user-1", 10, {"session_slack": 0.5}, False),
        ("user-1", 20, {}, False),
        ("user-1", 10, {"max_requests_per_worker": 10}, False),
    ],
    ids=["session-keeps-its-history-holder", "no-session-spreads", "no-wider-bound",
         "over-the-session-bound-spreads", "hard-cap-still-applies"],
)
def test_conversation_stays_with_the_hot_worker_holding_its_history(
    session_id: str | None, holder_load: int, params: dict, holder_first: bool
) -> None:
    # a holds the whole history (64 blocks), the others only the shared system prompt (8 blocks).
    table = [view("a", confirmed=64, requests=holder_load),
             *(view(w, confirmed=8, requests=4) for w in ("b", "c", "d"))]
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(
        request(PROMPT, session_id=session_id), table)
    assert (decision.worker_id == "a") is holder_first
    if holder_first:
        assert decision.explanation[0].note == "session: holds its history"


def test_session_exemption_needs_the_history_to_live_only_on_hot_workers() -> None:
    # b (under the bound) holds as much as the hot a: moving costs nothing, so the guard applies.
    table = [view("a", confirmed=64, requests=10), view("b", confirmed=64, requests=1), view("c", requests=2)]
    decision = KvAware(rng=random.Random(0)).choose(request(PROMPT, session_id="user-1"), table)
    assert decision.worker_id == "b"


@pytest.mark.parametrize(
    ("home", "params", "queued_at_home", "expected_first"),
    [("b", {}, 3000, "b"), ("b", {"evicted_home_weight": 1.0}, 3000, "a"),
     ("b", {"home_weight": 0.0, "evicted_home_weight": 0.0}, 800, "a"), ("b", {}, 12000, "a"), ("gone", {}, 800, "a")],
    ids=["evicted-prefix-goes-home", "a-weaker-evicted-home-gives-way-to-the-queue", "no-home-weights-go-by-load",
         "a-long-queue-at-home-outweighs-it", "a-home-that-is-no-candidate-is-ignored"],
)
def test_a_prefix_cached_nowhere_goes_back_to_its_home(home, params, queued_at_home, expected_first) -> None:
    """The prefix was evicted everywhere: load alone would pick a; its home b keeps it unless the
    queue there costs more than moving it (evicted_home_weight, 10 by default, x its prefill: 1,024
    tokens; 3,000 queued is less, 12,000 more)."""
    table = [view("a"), view("b", queued=queued_at_home)]
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(request(PROMPT, home_worker=home), table)
    assert decision.worker_id == expected_first


@pytest.mark.parametrize(
    ("params", "queued_at_home", "expected_first"),
    [({}, 600, "b"), ({}, 3000, "a"), ({"evicted_home_weight": 0.0}, 600, "b"), ({"home_weight": 0.0}, 600, "a")],
    ids=["home-kept-against-a-short-queue", "home_weight-not-evicted_home_weight-applies",
         "evicted_home_weight-plays-no-part", "no-home-weight-goes-by-score"],
)
def test_a_prefix_held_somewhere_goes_home_by_home_weight(params, queued_at_home, expected_first) -> None:
    """a holds 4 blocks of the prompt (64 tokens), so the prefix is not evicted everywhere: its home b
    is charged home_weight (1) x the prefill, not evicted_home_weight."""
    table = [view("a", confirmed=4), view("b", queued=queued_at_home)]
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(request(PROMPT, home_worker="b"), table)
    assert decision.worker_id == expected_first


@pytest.mark.parametrize(
    ("table", "params", "extra", "expected_first"),
    [
        ([view("a"), view("b", queued=300)], {}, {}, "b"),
        ([view("a"), view("b", queued=300)], {"placement_slack": 0.0}, {}, "a"),
        ([view("a"), view("b", queued=3000)], {}, {}, "a"),
        ([view("a"), view("b", queued=300, confirmed=1)], {}, {}, "a"),
        ([view("a"), view("b", queued=300)], {}, {"home_worker": "a"}, "a"),
        ([view("a"), view("b", queued=300)], {}, {"block_keys": ()}, "a"),
        ([view("a"), view("b", queued=300), view("c", requests=8)], {}, {}, "b"),
    ],
    ids=["fewest-placed-prefixes-wins", "placement-slack-zero-goes-by-load", "a-longer-queue-than-its-prefill-wins",
         "not-new-a-worker-holds-part-of-it", "not-new-it-has-a-home", "no-full-block-nothing-to-place",
         "a-hot-worker-is-not-placed-on"],
)
def test_a_new_prefix_goes_where_the_fewest_prefixes_live(table, params, extra, expected_first) -> None:
    """Nothing of the prompt is cached or predicted anywhere and it has no home: where it lands, its
    later prompts follow. a is the home of 5 recent prefixes, b of 3, c of none (but over the load bound)."""
    req = request(PROMPT, **{"block_keys": (1, 2, 3), "prefixes_per_worker": {"a": 5, "b": 3}, **extra})
    decision = KvAware(KvAwareParams(**params), rng=random.Random(0)).choose(req, table)
    assert decision.worker_id == expected_first
    if expected_first == "b" and not table[1].confirmed_blocks:
        assert decision.explanation[0].note == "new prefix: fewest placed here"


SYSTEM = {"role": "system", "content": "shared system prompt"}
FIRST_TURN = [SYSTEM, {"role": "user", "content": "hello"}]
LATER_TURN = [*FIRST_TURN, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]


@pytest.mark.parametrize(
    ("messages", "session_id", "queued_at_holder", "expected_first"),
    [
        (FIRST_TURN, "user-1", 800, "b"),
        (FIRST_TURN, "user-1", 0, "a"),
        (LATER_TURN, "user-1", 800, "a"),
        (FIRST_TURN, None, 800, "a"),
    ],
    ids=["first-turn-goes-where-the-fewest-live", "first-turn-beside-an-idle-holder-keeps-the-hit",
         "a-later-turn-is-not-placed-again", "without-a-session-the-shared-prefix-decides"],
)
def test_a_conversations_first_turn_goes_where_the_fewest_prefixes_live(messages, session_id, queued_at_holder,
                                                                        expected_first) -> None:
    """a holds the shared system prompt (40 of the prompt's 64 blocks) and is the home of 5 recent
    prefixes or conversations, b holds nothing and is the home of 3. A conversation's first turn is
    placed like a new prefix (its later turns follow it), as long as b scores within one prefill of a."""
    req = RouteRequest(model="m", messages=messages, session_id=session_id, num_prompt_tokens=PROMPT,
                       block_keys=(1, 2, 3), prefixes_per_worker={"a": 5, "b": 3})
    assert req.starts_session is (messages is FIRST_TURN and session_id is not None)
    table = [view("a", confirmed=40, queued=queued_at_holder), view("b")]
    decision = KvAware(rng=random.Random(0)).choose(req, table)
    assert decision.worker_id == expected_first
    if expected_first == "b":
        assert decision.explanation[0].note == "new session: fewest placed here"
