"""KvIndex: confirmed entries from every event kind, predicted entries with expiry, bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.clock import ManualClock
from router.block_keys import block_keys
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from router.kv_index import KvIndex
from router.mask_table import MAX_LOAD

MODEL = "m"
B = 4
TOKENS = list(range(100, 124))  # six blocks
KEYS = block_keys(TOKENS, B, MODEL)
OTHER_KEYS = block_keys(TOKENS[: 2 * B] + list(range(500, 516)), B, MODEL)  # shares two blocks with KEYS


def expected_match(held: dict[str, set[int]], predicted: dict[str, set[int]]) -> dict[str, tuple[int, int]]:
    """Brute force: each worker's leading run of held / predicted block indexes."""

    def prefix(blocks: set[int]) -> int:
        n = 0
        while n in blocks:
            n += 1
        return n

    return {worker: (prefix(held[worker]), prefix(predicted[worker]))
            for worker in held if prefix(held[worker]) or prefix(predicted[worker])}


def horizons(**by_worker: int):
    """match()'s eviction_horizon, a fixed horizon per worker (whatever its pinned blocks)."""
    return lambda worker_id, _pinned_blocks: by_worker.get(worker_id)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, **kw: object) -> BlockStored:
    return BlockStored(hashes, parent, tokens, B, kw.get("lora_id"), kw.get("medium", "GPU"))


@pytest.fixture
def index(clock) -> KvIndex:
    idx = KvIndex(clock=clock, predicted_ttl_s=2.0)
    for worker in ("w0", "w1"):
        idx.add_worker(worker, model_name=MODEL)
    return idx


def test_stored_blocks_from_the_seed_give_the_prefix(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2, 3], TOKENS[:12])])
    assert index.match(KEYS) == {"w0": (3, 0)}


def test_stored_with_a_parent_continues_the_chain(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2], TOKENS[:8]), stored([3, 4], TOKENS[8:16], parent=2)])
    assert index.match(KEYS) == {"w0": (4, 0)}


def test_stored_with_an_unknown_parent_is_skipped_and_counted(index: KvIndex) -> None:
    index.apply("w0", [stored([3], TOKENS[8:12], parent=99)])
    assert index.match(KEYS) == {}
    assert index.counters.stored_unknown_parent == 1


def test_removed_block_cuts_the_prefix_there(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2, 3, 4], TOKENS[:16]), BlockRemoved([3])])
    assert index.match(KEYS) == {"w0": (2, 0)}


def test_all_blocks_cleared_forgets_only_that_worker(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2], TOKENS[:8])])
    index.apply("w1", [stored([7, 8, 9], TOKENS[:12])])
    index.apply("w0", [AllBlocksCleared()])
    assert index.match(KEYS) == {"w1": (3, 0)}


def test_removing_a_worker_drops_all_its_entries(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2], TOKENS[:8])])
    index.record_prediction("w0", KEYS)
    index.remove_worker("w0")
    assert index.match(KEYS) == {}
    assert index.stats().num_keys == 0
    index.add_worker("w2", model_name=MODEL)  # takes the freed slot, starts empty
    assert index.match(KEYS) == {}


def test_cap_evicts_the_oldest_blocks_first(clock) -> None:
    index = KvIndex(clock=clock)
    index.add_worker("w0", model_name=MODEL, max_blocks=3)
    index.apply("w0", [stored([1, 2, 3, 4, 5], TOKENS[:20])])
    assert index.stats().blocks_per_worker == {"w0": 3}
    assert index.counters.blocks_evicted == 2
    assert index.match(KEYS) == {}  # keys 0 and 1 were the oldest
    assert index.match(KEYS[2:]) == {"w0": (3, 0)}  # the three youngest are still held
    assert index.stats().num_keys == 3


def test_two_engine_hashes_for_one_key_keep_it_until_both_are_removed(index: KvIndex) -> None:
    index.apply("w0", [stored([1], TOKENS[:4]), stored([101], TOKENS[:4])])
    index.apply("w0", [BlockRemoved([1])])
    assert index.match(KEYS) == {"w0": (1, 0)}
    index.apply("w0", [BlockRemoved([101])])
    assert index.match(KEYS) == {}


def test_prefix_lengths_are_per_worker(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2, 3, 4, 5, 6], TOKENS)])
    index.apply("w1", [stored([7, 8], TOKENS[:8])])
    assert index.match(KEYS) == {"w0": (6, 0), "w1": (2, 0)}


@pytest.mark.parametrize(
    ("event", "counter"),
    [
        (stored([1], TOKENS[:4], lora_id=3), "events_skipped_lora"),
        (stored([1], TOKENS[:4], medium="CPU"), "events_skipped_medium"),
    ],
    ids=["lora", "cpu-medium"],
)
def test_blocks_the_router_cannot_key_are_skipped(index: KvIndex, event: BlockStored, counter: str) -> None:
    index.apply("w0", [event])
    assert index.match(KEYS) == {}
    assert getattr(index.counters, counter) == 1


def test_predicted_entries_expire_after_the_ttl(index: KvIndex, clock) -> None:
    index.record_prediction("w1", KEYS[:3])
    clock.advance(1.9)
    assert index.match(KEYS) == {"w1": (0, 3)}
    clock.advance(0.2)
    assert index.match(KEYS) == {}
    assert index.stats().num_keys == 0


def test_a_new_prediction_extends_the_expiry(index: KvIndex, clock) -> None:
    index.record_prediction("w1", KEYS[:3])
    clock.advance(1.5)
    index.record_prediction("w1", KEYS[:3])
    clock.advance(1.0)
    assert index.match(KEYS) == {"w1": (0, 3)}


def test_confirmed_and_predicted_are_reported_separately(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2], TOKENS[:8])])
    index.record_prediction("w0", KEYS[:5])
    assert index.match(KEYS) == {"w0": (2, 5)}


def test_stats_report_entries_and_bytes(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2, 3], TOKENS[:12])])
    stats = index.stats()
    assert stats.blocks_per_worker == {"w0": 3, "w1": 0}
    assert stats.approx_bytes > 0


def test_events_for_an_unknown_worker_raise(index: KvIndex) -> None:
    with pytest.raises(KeyError, match="worker 'nope' is not indexed"):
        index.apply("nope", [AllBlocksCleared()])


@settings(max_examples=150, deadline=None)
@given(
    stored_prefixes=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    removed=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), max_size=4),
    predicted_prefixes=st.lists(st.integers(0, 6), min_size=3, max_size=3),
)
def test_match_equals_a_brute_force_walk_over_both_layers(
    stored_prefixes: list[int], removed: list[tuple[int, int]], predicted_prefixes: list[int]
) -> None:
    """Workers store a prefix of the chain, lose some blocks, and get predictions of another prefix."""
    index = KvIndex()
    held: dict[str, set[int]] = {}
    predicted: dict[str, set[int]] = {}
    for w, (n_stored, n_predicted) in enumerate(zip(stored_prefixes, predicted_prefixes)):
        worker = f"w{w}"
        index.add_worker(worker, model_name=MODEL)
        if n_stored:
            index.apply(worker, [stored(list(range(1, n_stored + 1)), TOKENS[: n_stored * B])])
        held[worker] = set(range(n_stored))
        if n_predicted:
            index.record_prediction(worker, tuple(KEYS[:n_predicted]))
        predicted[worker] = set(range(n_predicted))
    for w, engine_hash in removed:
        index.apply(f"w{w}", [BlockRemoved([engine_hash])])
        held[f"w{w}"].discard(engine_hash - 1)

    assert index.match(KEYS) == expected_match(held, predicted)


def test_stats_count_the_entries_of_both_layers(index: KvIndex) -> None:
    index.apply("w0", [stored([1, 2, 3], TOKENS[:12])])
    index.record_prediction("w1", tuple(KEYS[:5]))
    stats = index.stats()
    assert stats.num_keys == 3 + 5
    assert stats.predicted_per_worker == {"w0": 0, "w1": 5}
    assert stats.approx_bytes > index._confirmed.nbytes


def test_a_prediction_extending_a_reported_one_adds_the_new_keys(index: KvIndex) -> None:
    index.record_prediction("w0", tuple(KEYS[:2]))
    index.record_prediction("w1", tuple(KEYS[:4]))
    predicted = index.match(KEYS)["w0"][1]
    index.record_prediction("w0", tuple(KEYS), num_predicted=predicted)
    assert index.match(KEYS) == {"w0": (0, 6), "w1": (0, 4)}


def test_clearing_a_worker_with_many_blocks_keeps_the_others(clock) -> None:
    """Thousands of blocks: clear_worker drops its bit in one vectorized pass."""
    index = KvIndex(clock=clock)
    tokens = list(range(5000 * B))
    keys = block_keys(tokens, B, MODEL)
    for worker in ("w0", "w1"):
        index.add_worker(worker, model_name=MODEL, max_blocks=10_000)
    index.apply("w0", [stored(list(range(1, 5001)), tokens)])
    index.apply("w1", [stored(list(range(1, 101)), tokens[: 100 * B])])
    index.apply("w0", [stored([9001], TOKENS[:4])])  # two engine hashes for one key, cleared at once
    index.apply("w0", [stored([9002], TOKENS[:4])])
    assert index.match(keys) == {"w0": (5000, 0), "w1": (100, 0)}
    index.clear_worker("w0")
    assert index.match(keys) == {"w1": (100, 0)}
    assert index.match(KEYS) == {}
    assert index.stats().num_keys == 100
    index.apply("w0", [stored([1, 2], tokens[: 2 * B])])  # indexed again from scratch
    assert index.match(keys) == {"w0": (2, 0), "w1": (100, 0)}
    index.remove_worker("w1")
    assert index.match(keys) == {"w0": (2, 0)} and index.stats().num_keys == 2


@settings(max_examples=100, deadline=None)
@given(
    wide=st.booleans(),
    stored_prefixes=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    predicted_prompts=st.lists(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=3),
                               min_size=3, max_size=3),
    cleared=st.sets(st.integers(0, 2)),
    expire_first=st.booleans(),
)
def test_match_equals_a_brute_force_walk_with_overlapping_predictions_and_wide_masks(
    wide: bool, stored_prefixes: list[int], predicted_prompts: list[list[tuple[bool, int]]], cleared: set[int],
    expire_first: bool,
) -> None:
    """Predictions are leading blocks of two prompts that share their first two blocks; with
    expire_first, every other one is recorded and expires before the rest are recorded; with
    `wide`, 64 other workers come first, so these get slots >= 64 (two-word masks)."""
    clock = ManualClock()
    index = KvIndex(clock=clock, predicted_ttl_s=2.0)
    if wide:
        for i in range(64):
            index.add_worker(f"filler{i}", model_name=MODEL)
    held: dict[str, set[int]] = {}  # block indexes of TOKENS
    live: dict[str, set[int]] = {}  # predicted keys still live
    for w, n_stored in enumerate(stored_prefixes):
        worker = f"w{w}"
        index.add_worker(worker, model_name=MODEL)
        if n_stored:
            index.apply(worker, [stored(list(range(1, n_stored + 1)), TOKENS[: n_stored * B])])
        held[worker] = set() if w in cleared else set(range(n_stored))
        if w in cleared:
            index.clear_worker(worker)
        live[worker] = set()
    for first_round in (True, False):
        for w in range(len(stored_prefixes)):
            for i, (other, n) in enumerate(predicted_prompts[w]):
                if (i % 2 == 0) == first_round:
                    keys = (OTHER_KEYS if other else KEYS)[:n]
                    index.record_prediction(f"w{w}", tuple(keys))
                    live[f"w{w}"] |= set(keys)
        if first_round and expire_first:
            clock.advance(2.5)
            live = {w: set() for w in live}

    def indexes(walk: list[int], keys: set[int]) -> set[int]:
        return {j for j, key in enumerate(walk) if key in keys}

    assert index.match(KEYS) == expected_match(held, {w: indexes(KEYS, k) for w, k in live.items()})
    assert index.match(OTHER_KEYS) == expected_match({w: {j for j in h if j < 2} for w, h in held.items()},
                                                     {w: indexes(OTHER_KEYS, k) for w, k in live.items()})
    assert index.match(KEYS[:0]) == {}
    assert index.stats().num_keys == len(set().union(*held.values())) + len(set().union(*live.values()))


@pytest.mark.parametrize("num_keys", [1, 5, 47, 48, 49, 200], ids=lambda n: f"{n}-keys")
def test_short_and_long_prompts_match_alike(num_keys: int, monkeypatch) -> None:
    """match() looks short prompts up key by key and long ones vectorized: same answers."""
    import router.kv_index as kv_index

    tokens = list(range(1000, 1000 + B * 200))
    keys = block_keys(tokens, B, MODEL)[:num_keys]
    answers = []
    for small_limit in (0, 10**9):
        monkeypatch.setattr(kv_index, "_SMALL_PROMPT_KEYS", small_limit)
        monkeypatch.setattr(kv_index, "COMPILED_WALK", False)  # so the per-key path runs when built, too
        index = KvIndex()
        for w, held in enumerate((num_keys, num_keys // 2, 1)):
            index.add_worker(f"w{w}", model_name=MODEL)
            if held:
                index.apply(f"w{w}", [stored(list(range(1, held + 1)), tokens[: held * B])])
        index.apply("w1", [BlockRemoved([1])] if num_keys == 5 else [])
        answers.append(index.match(keys))
    assert answers[0] == answers[1]
    assert answers[0]["w0"] == (num_keys, 0)


def test_reserve_makes_room_up_front(clock) -> None:
    index = KvIndex(clock=clock)
    index.add_worker("w0", model_name=MODEL)
    index.reserve(10_000)
    slots = index._confirmed.num_slots
    assert slots * MAX_LOAD >= 10_000
    index.apply("w0", [stored(list(range(1, 1001)), list(range(1000 * B)))])
    assert index._confirmed.num_slots == slots  # no doubling while filling what was reserved
    assert index.match(block_keys(list(range(1000 * B)), B, MODEL)) == {"w0": (1000, 0)}


# -- eviction: keys used longer ago than a worker can allocate before evicting are not counted ----------


def chain(start: int, num_blocks: int) -> tuple[list[int], list[int]]:
    """(tokens, keys) of a prompt of num_blocks blocks of its own."""
    tokens = list(range(start, start + num_blocks * B))
    return tokens, block_keys(tokens, B, MODEL)


@pytest.fixture
def sized(clock) -> KvIndex:
    """w0 has a known capacity of 100 blocks; w1's is unknown (no eviction model)."""
    idx = KvIndex(clock=clock, predicted_ttl_s=2.0)
    idx.add_worker("w0", model_name=MODEL, max_blocks=100)
    idx.add_worker("w1", model_name=MODEL)
    return idx


def store_chain(index: KvIndex, worker: str, tokens: list[int], first_hash: int) -> None:
    num_blocks = len(tokens) // B
    index.apply(worker, [stored(list(range(first_hash, first_hash + num_blocks)), tokens)])


def test_a_prefix_used_more_allocations_ago_than_the_horizon_is_not_counted(sized: KvIndex) -> None:
    tokens, keys = chain(1000, 10)
    store_chain(sized, "w0", tokens, 1)
    store_chain(sized, "w0", chain(5000, 60)[0], 100)  # 60 blocks allocated since
    assert sized.match(keys) == {"w0": (10, 0)}  # still indexed: the capacity holds 70 blocks
    assert sized.match(keys, horizons(w0=61)) == {"w0": (10, 0)}
    assert sized.match(keys, horizons(w0=50)) == {}  # 50 more allocations before the prompt is computed: gone


def test_routing_a_prompt_to_a_worker_makes_its_prefix_recent_again(sized: KvIndex) -> None:
    tokens, keys = chain(1000, 10)
    store_chain(sized, "w0", tokens, 1)
    store_chain(sized, "w0", chain(5000, 80)[0], 100)
    assert sized.match(keys, horizons(w0=20)) == {}
    sized.record_prediction("w0", tuple(keys[:6]))  # a request sharing the first six blocks went there
    assert sized.match(keys, horizons(w0=20)) == {"w0": (6, 6)}


def test_a_prediction_is_not_counted_once_the_worker_has_allocated_past_it(sized: KvIndex) -> None:
    _, keys = chain(1000, 10)
    sized.record_prediction("w0", tuple(keys))
    sized.release("w0", keys)  # its request ended: the blocks are free, evictable from now on
    assert sized.match(keys, horizons(w0=100)) == {"w0": (0, 10)}
    store_chain(sized, "w0", chain(5000, 90)[0], 100)  # the worker stored 90 blocks of other prompts since
    assert sized.match(keys, horizons(w0=100)) == {"w0": (0, 10)}
    assert sized.match(keys, horizons(w0=80)) == {}


def test_blocks_of_a_request_in_flight_are_not_evicted_and_age_from_its_end(sized: KvIndex) -> None:
    _, keys = chain(1000, 10)
    sized.record_prediction("w0", tuple(keys))
    sized.record_prediction("w0", tuple(keys[:4]))  # a second request holds the first four blocks
    store_chain(sized, "w0", chain(5000, 90)[0], 100)
    assert sized.match(keys, horizons(w0=0)) == {"w0": (0, 10)}  # held by running requests: not evictable
    assert sized.blocks_in_use("w0") == 10
    sized.release("w0", keys)
    assert sized.blocks_in_use("w0") == 4
    store_chain(sized, "w0", chain(9000, 30)[0], 300)
    assert sized.match(keys, horizons(w0=29)) == {"w0": (0, 4)}  # freed 30 allocations ago; the rest still held
    assert sized.match(keys, horizons(w0=36)) == {"w0": (0, 10)}


def test_a_released_prompt_is_evicted_tail_first(sized: KvIndex) -> None:
    """An engine frees a request's blocks deepest first, and evicts the least recently freed: with
    room for only part of a freed prompt, its head outlives its tail."""
    _, keys = chain(1000, 10)
    sized.record_prediction("w0", tuple(keys))
    sized.release("w0", keys)
    store_chain(sized, "w0", chain(5000, 20)[0], 100)  # 20 allocations since
    assert sized.match(keys, horizons(w0=30)) == {"w0": (0, 10)}
    assert sized.match(keys, horizons(w0=24)) == {"w0": (0, 4)}  # the 6 deepest freed blocks are the first to go
    assert sized.match(keys, horizons(w0=20)) == {}


def test_a_peer_replicas_prediction_counts_until_the_worker_allocates_past_it(sized: KvIndex) -> None:
    """Another gateway replica's request (pin=False: no release will come here) holds nothing in this
    index's count of blocks in use, but its prefix is counted as used now, as this router's own
    would be, not as never seen (evicted): until the worker has allocated past it."""
    _, keys = chain(1000, 10)
    sized.record_prediction("w0", tuple(keys), pin=False)
    assert sized.blocks_in_use("w0") == 0
    assert sized.match(keys, horizons(w0=100)) == {"w0": (0, 10)}
    store_chain(sized, "w0", chain(5000, 90)[0], 100)  # the worker stored 90 blocks of other prompts since
    assert sized.match(keys, horizons(w0=100)) == {"w0": (0, 10)}
    assert sized.match(keys, horizons(w0=80)) == {}


def test_a_prediction_lands_when_its_request_has_computed_the_prompt(sized: KvIndex) -> None:
    _, keys = chain(1000, 10)
    sized.record_prediction("w0", tuple(keys))
    assert sized.landed_prefix("w0", keys, 10) == 0  # still in prefill: a request beside it computes it again
    sized.prediction_landed("w0", keys[:6])
    assert sized.landed_prefix("w0", keys, 10) == 6
    sized.prediction_landed("w0", keys)
    assert sized.landed_prefix("w0", keys, 10) == 10


def test_an_eviction_event_ends_a_landed_prediction_but_not_one_still_in_prefill(sized: KvIndex) -> None:
    tokens, keys = chain(1000, 10)
    store_chain(sized, "w0", tokens, 1)
    sized.record_prediction("w0", tuple(keys))
    sized.apply("w0", [BlockRemoved([8, 9, 10], "GPU")])  # an old copy evicted before the request ran
    assert sized.match(keys) == {"w0": (7, 10)}
    sized.prediction_landed("w0", keys)
    sized.apply("w0", [BlockRemoved([6, 7], "GPU")])  # evicted after the request computed them
    assert sized.match(keys) == {"w0": (5, 5)}


def test_a_worker_of_unknown_capacity_is_not_judged_on_eviction(sized: KvIndex) -> None:
    tokens, keys = chain(1000, 10)
    store_chain(sized, "w1", tokens, 1)
    store_chain(sized, "w1", chain(5000, 500)[0], 100)
    assert sized.match(keys, {"w1": 0}.get) == {"w1": (10, 0)}


def test_a_cleared_worker_holds_nothing_it_was_predicted_to(sized: KvIndex) -> None:
    _, keys = chain(1000, 10)
    sized.record_prediction("w0", tuple(keys))
    sized.apply("w0", [AllBlocksCleared()])
    assert sized.match(keys, horizons(w0=100)) == {}


def test_last_use_entries_stay_bounded_by_the_capacity(sized: KvIndex) -> None:
    for i in range(200):
        store_chain(sized, "w0", chain(10_000 + 100 * i, 20)[0], 1 + 20 * i)
    worker = sized._workers["w0"]
    assert len(worker.last_used) <= 4 * 100 + 4096
    assert worker.blocks_allocated == 4000


def test_last_use_entries_stay_bounded_while_peers_route_to_a_worker_whose_events_stopped(sized: KvIndex) -> None:
    """Other replicas' predictions count as used now; with no event from the worker its allocation
    clock stands still, so only the capacity bounds them: the most recently used are kept."""
    for i in range(500):
        sized.record_prediction("w0", tuple(chain(10_000 + 100 * i, 10)[1]), pin=False)
    assert len(sized._workers["w0"].last_used) <= 4 * 100 + 4096
    _, last_keys = chain(10_000 + 100 * 499, 10)
    assert sized.match(last_keys, {"w0": 100}.get) == {"w0": (0, 10)}


def test_a_capacity_learned_later_caps_the_blocks_and_models_evictions_from_then(clock) -> None:
    index = KvIndex(clock=clock)
    index.add_worker("w0", model_name=MODEL)
    tokens, keys = chain(1000, 10)
    store_chain(index, "w0", tokens, 1)
    index.set_capacity("w0", 8)  # the two oldest blocks go; the rest count as freed now
    assert index.match(keys, {"w0": 8}.get) == {}  # its first blocks are gone: no prefix left
    index2 = KvIndex(clock=clock)
    index2.add_worker("w0", model_name=MODEL)
    store_chain(index2, "w0", tokens, 1)
    index2.set_capacity("w0", 100)
    assert index2.match(keys, {"w0": 50}.get) == {"w0": (10, 0)}
    store_chain(index2, "w0", chain(5000, 60)[0], 100)
    assert index2.match(keys, {"w0": 50}.get) == {}
