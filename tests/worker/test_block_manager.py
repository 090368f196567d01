"""Block manager and block keys: allocation accounting, prefix caching, LRU eviction, KV events."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from worker.engine.block_hash import block_key, block_keys, extend_block_keys, model_seed
from worker.engine.block_manager import BlockManager
from worker.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

PARAMS = SamplingParams()


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), PARAMS, arrival_time_s=float(seq_id))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What the engine does after a step that ran all of seq's allocated tokens."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


class EventLog:
    """Replays KV events into the set of keys a router would think the worker holds."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.keys: set[int] = set()
        self.tokens_by_key: dict[int, list[int]] = {}
        self.num_removed = 0

    def __call__(self, event: object) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            assert not self.keys.intersection(event.block_hashes), "stored twice without removal"
            self.keys.update(event.block_hashes)
            for i, key in enumerate(event.block_hashes):
                size = event.block_size
                self.tokens_by_key[key] = event.token_ids[i * size : (i + 1) * size]
        elif isinstance(event, BlockRemoved):
            assert self.keys.issuperset(event.block_hashes), "removed a key never stored"
            self.keys.difference_update(event.block_hashes)
            self.num_removed += len(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.keys.clear()


# ---- block keys ------------------------------------------------------------------------------


def test_block_keys_follow_the_documented_byte_layout() -> None:
    seed = xxhash.xxh3_64_intdigest(b"tiny-model")
    tokens = [1, 2, 3, 70000, 5, 6, 7, 8, 9]
    key0 = xxhash.xxh3_64_intdigest(struct.pack("<Q", seed) + struct.pack("<4I", 1, 2, 3, 70000))
    key1 = xxhash.xxh3_64_intdigest(struct.pack("<Q", key0) + struct.pack("<4I", 5, 6, 7, 8))

    assert model_seed("tiny-model") == seed
    assert block_keys(tokens, 4, seed) == [key0, key1]
    assert block_key(key0, [5, 6, 7, 8]) == key1


def test_extending_block_keys_token_by_token_matches_hashing_at_once() -> None:
    tokens = list(range(1, 40))
    keys: list[int] = []
    for end in range(len(tokens) + 1):
        extend_block_keys(keys, tokens[:end], 4, seed=7)
        assert keys == block_keys(tokens[:end], 4, seed=7)


def test_block_keys_reject_token_ids_that_are_not_u32() -> None:
    with pytest.raises(struct.error):
        block_keys([2**32, 1], 2, seed=0)


# ---- examples ----------------------------------------------------------------------------------


def test_second_request_with_same_prompt_reuses_computed_blocks() -> None:
    log = EventLog()
    bm = BlockManager(num_blocks=10, block_size=4, hash_seed=3, event_sink=log)
    first = make_seq(0, list(range(10)))
    assert bm.allocate(first) == 0
    compute_all(bm, first)
    second = make_seq(1, list(range(10)) + [99])

    assert bm.allocate(second) == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.ref_count(b) for b in first.block_table] == [2, 2, 1]
    assert (bm.prefix_cache_queries_tokens, bm.prefix_cache_hits_tokens) == (21, 8)
    assert log.events == [
        BlockStored(block_keys(list(range(8)), 4, 3), None, list(range(8)), 4)
    ]


@pytest.mark.parametrize(
    ("prompt_len", "expected_cached_tokens"),
    [(8, 4), (9, 8), (7, 4), (4, 0)],
    ids=["exact-blocks-leave-last-block", "one-extra-token", "partial-tail", "single-block"],
)
def test_full_prompt_hit_leaves_the_last_token_to_compute(
    prompt_len: int, expected_cached_tokens: int
) -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    warm = make_seq(0, list(range(prompt_len)) + [1000])
    bm.allocate(warm)
    compute_all(bm, warm)

    again = make_seq(1, list(range(prompt_len)))

    assert bm.allocate(again) == expected_cached_tokens
    assert again.num_computed_tokens == expected_cached_tokens


def test_freed_cached_blocks_are_evicted_least_recently_freed_first_and_reported() -> None:
    log = EventLog()
    bm = BlockManager(num_blocks=4, block_size=2, event_sink=log)
    old, new = make_seq(0, [1, 2, 3, 4]), make_seq(1, [5, 6, 7, 8])
    for seq in (old, new):
        bm.allocate(seq)
        compute_all(bm, seq)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 4

    bm.allocate(make_seq(2, [9, 9, 9]))  # needs two blocks: old's, tail block first

    old_keys = block_keys([1, 2, 3, 4], 2, 0)
    assert log.events[-1] == BlockRemoved([old_keys[1], old_keys[0]])
    assert bm.cached_block_keys() == frozenset(block_keys([5, 6, 7, 8], 2, 0))


def test_reusing_a_cached_free_block_protects_it_from_eviction() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    warm = make_seq(0, [1, 2, 3])
    bm.allocate(warm)
    compute_all(bm, warm)
    bm.free(warm)

    again = make_seq(1, [1, 2, 3, 4, 5])  # hit on [1, 2]; needs 2 more blocks, evicting none of it

    assert bm.allocate(again) == 2
    assert bm.num_free_blocks == 0
    assert bm.cached_block_keys() == frozenset(block_keys([1, 2], 2, 0))


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = make_seq(0, [1, 2, 3, 4, 5])

    assert bm.allocate(seq) is None
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_two_requests_computing_the_same_prefix_register_it_once() -> None:
    log = EventLog()
    bm = BlockManager(num_blocks=6, block_size=2, event_sink=log)
    a, b = make_seq(0, [1, 2, 3, 4, 5]), make_seq(1, [1, 2, 3, 4, 6])
    bm.allocate(a)
    bm.allocate(b)  # nothing cached yet: computes its own copy
    compute_all(bm, a)
    compute_all(bm, b)

    assert len([e for e in log.events if isinstance(e, BlockStored)]) == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 6


def test_reset_prefix_cache_forgets_every_key_and_says_so() -> None:
    log = EventLog()
    bm = BlockManager(num_blocks=4, block_size=2, event_sink=log)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    bm.allocate(seq)
    compute_all(bm, seq)

    bm.reset_prefix_cache()

    assert log.events[-1] == AllBlocksCleared()
    assert bm.num_cached_blocks == 0
    assert bm.lookup_prefix(make_seq(1, [1, 2, 3, 4, 5])) == []


def test_without_prefix_caching_nothing_is_shared_or_reported() -> None:
    log = EventLog()
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False, event_sink=log)
    first = make_seq(0, [1, 2, 3, 4, 5])
    bm.allocate(first)
    compute_all(bm, first)

    assert bm.allocate(make_seq(1, [1, 2, 3, 4, 5])) == 0
    assert log.events == []


def test_append_slots_adds_a_block_only_when_the_last_one_is_full() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = make_seq(0, [1, 2, 3])
    bm.allocate(seq)
    compute_all(bm, seq)
    seq.append_token(4)
    assert bm.append_slots(seq, 1) and len(seq.block_table) == 2
    seq.num_computed_tokens = 4
    seq.append_token(5)
    assert bm.append_slots(seq, 1) and len(seq.block_table) == 3
    seq.num_computed_tokens = 5
    seq.append_token(6)
    seq.num_computed_tokens = 6
    seq.append_token(7)
    assert not bm.append_slots(seq, 1)
    assert len(seq.block_table) == 3


# ---- stateful property test -------------------------------------------------------------------

BASES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0, 0, 0, 1, 1, 2, 2], [2] * 12)
TOKENS = st.builds(
    lambda base, length, tail: base[:length] + tail,
    st.sampled_from(BASES),
    st.integers(1, 12),
    st.lists(st.integers(0, 2), max_size=3),
)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / grow / free / reset against a model of the KV contents."""

    @initialize(num_blocks=st.integers(1, 8), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.log = EventLog()
        self.bm = BlockManager(num_blocks, block_size, hash_seed=11, event_sink=self.log)
        self.block_size = block_size
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.next_id = 0

    def _brute_force_hit_blocks(self, seq: Sequence) -> int:
        keys = block_keys(seq.token_ids, self.block_size, 11)
        cached = self.bm.cached_block_keys()
        count = 0
        for key in keys[: (seq.num_tokens - 1) // self.block_size]:
            if key not in cached:
                break
            count += 1
        return count

    @rule(tokens=TOKENS, chunk=st.integers(1, 14))
    def allocate(self, tokens: list[int], chunk: int) -> None:
        self._allocate(tokens, chunk)

    def _allocate(self, tokens: list[int], chunk: int) -> Sequence | None:
        seq = make_seq(self.next_id, tokens)
        self.next_id += 1
        hits = self.bm.lookup_prefix(seq)
        assert len(hits) == self._brute_force_hit_blocks(seq)
        for i, block_id in enumerate(hits):  # a hit block really holds these tokens
            for offset in range(self.block_size):
                assert self.kv[(block_id, offset)] == tokens[i * self.block_size + offset]
        num_new = min(chunk, seq.num_tokens - len(hits) * self.block_size)
        evicted_before = self.log.num_removed
        fits = self.bm.can_allocate(seq, num_new, hits)
        allocated = self.bm.allocate(seq, num_new, hits) is not None
        assert allocated == fits
        event("allocation evicted" if self.log.num_removed > evicted_before else "no eviction")
        event("prefix hit" if hits else "no hit")
        if not allocated:
            return None
        self.live.append(seq)
        return seq

    @rule(tokens=TOKENS)
    def serve_whole_request(self, tokens: list[int]) -> None:
        """Allocate, compute and free at once: warms the cache so later allocations evict."""
        seq = self._allocate(tokens, chunk=len(tokens))
        if seq is not None:
            self._compute(seq, len(tokens))
            self.live.remove(seq)
            self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), num_tokens=st.integers(1, 14))
    def compute(self, data: st.DataObject, num_tokens: int) -> None:
        self._compute(data.draw(st.sampled_from(self.live)), num_tokens)

    def _compute(self, seq: Sequence, num_tokens: int) -> None:
        capacity = min(len(seq.block_table) * self.block_size, seq.num_tokens)
        end = min(seq.num_computed_tokens + num_tokens, capacity)
        for pos in range(seq.num_computed_tokens, end):
            block_id = seq.block_table[pos // self.block_size]
            assert self.bm.ref_count(block_id) == 1, "writes into a shared block"
            self.kv[(block_id, pos % self.block_size)] = seq.token_ids[pos]
        seq.num_computed_tokens = end
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2), num_new=st.integers(1, 6))
    def grow(self, data: st.DataObject, token: int, num_new: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        num_new = min(num_new, seq.num_uncomputed_tokens)
        before = list(seq.block_table)
        if not self.bm.append_slots(seq, num_new):
            assert seq.block_table == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)

    @rule()
    def reset(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        holders = [0] * self.bm.num_blocks
        for seq in self.live:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [self.bm.ref_count(b) for b in range(self.bm.num_blocks)] == holders

    @invariant()
    def free_list_holds_exactly_the_unreferenced_blocks_once(self) -> None:
        free = self.bm.free_block_ids()
        assert len(free) == len(set(free)) == self.bm.num_free_blocks
        assert set(free) == {b for b in range(self.bm.num_blocks) if self.bm.ref_count(b) == 0}
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks

    @invariant()
    def replayed_events_equal_the_cached_keys(self) -> None:
        assert self.log.keys == set(self.bm.cached_block_keys())

    @invariant()
    def cached_blocks_still_hold_the_tokens_they_were_stored_with(self) -> None:
        for key, block_id in self.bm.cached_blocks().items():
            stored = [self.kv[(block_id, offset)] for offset in range(self.block_size)]
            assert stored == self.log.tokens_by_key[key]

    @invariant()
    def stored_events_chain_from_their_token_ids(self) -> None:
        for event in self.log.events[-3:]:
            if isinstance(event, BlockStored):
                parent = 11 if event.parent_block_hash is None else event.parent_block_hash
                assert block_keys(event.token_ids, event.block_size, parent) == event.block_hashes


TestBlockManagerStateful = pytest.mark.slow(BlockManagerMachine.TestCase)  # ~3 s: 200 runs of 50 steps
TestBlockManagerStateful.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
