"""MaskTable against a plain dict: single-key updates, growth, widening, overflow, prompt lookups,
bulk removal."""

from __future__ import annotations

import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import mask_table
from router.mask_table import MaskTable, as_keys, prefix_holders_of

U64 = 2**64 - 1
# keys with equal low and high halves have one candidate slot, the same for all of these in any
# table under 2**20 slots: all but one go to the overflow dict
ONE_SLOT = [(j << 20) * (2**32 + 1) for j in range(6)]
EDGE_KEYS = [0, U64, 1, 2**32, 2**32 + 1, 2**63, *ONE_SLOT[1:4]]

def mask_of(row: np.ndarray) -> int:
    return sum(int(word) << (64 * w) for w, word in enumerate(row.tolist()))


def ref_prefix_lengths(keys: list[int], ref: dict[int, int], num_bits: int) -> list[int]:
    lengths = []
    for bit in range(num_bits):
        n = 0
        while n < len(keys) and ref.get(keys[n], 0) >> bit & 1:
            n += 1
        lengths.append(n)
    return lengths


def check_invariants(table: MaskTable, ref: dict[int, int]) -> None:
    """Every live key sits in one of its two slots, free slots hold a filler and a zero mask."""
    tab = table._tab
    m = len(tab) - 1
    keys = tab[:, 0].tolist()
    live = np.flatnonzero(tab[:, 1:].any(axis=1)).tolist()
    for s, key in enumerate(keys):
        if s not in live:
            assert key == (s ^ 1) * (2**32 + 1)
    live_keys = [keys[s] for s in live]
    assert len(set(live_keys)) == len(live_keys)
    for s in live:
        assert s in (keys[s] & m, (keys[s] >> 32) & m)
    assert not set(live_keys) & set(table._stash)
    assert all(table._stash.values())
    assert len(table) == len(live) + len(table._stash) == len(ref)


def check_against(table: MaskTable, ref: dict[int, int], pool: list[int]) -> None:
    assert len(table) == len(ref)
    for key in pool:
        assert table.get(key) == ref.get(key, 0)
    rows = table.lookup(pool)
    assert rows.shape == (len(pool), table.words) and rows.dtype == np.uint64
    assert [mask_of(row) for row in rows] == [ref.get(key, 0) for key in pool]
    assert np.array_equal(table.lookup(np.array(pool, dtype=np.uint64)), rows)
    num_bits = 64 * table.words
    for prompt in (pool, pool[::-1], [k for k in pool if k in ref], [k for k in pool if k in ref][::-1]):
        expected = ref_prefix_lengths(prompt, ref, num_bits)
        assert table.prefix_lengths(prompt) == expected
        assert table.prefix_lengths(as_keys(prompt)) == expected


def apply(table: MaskTable, ref: dict[int, int], op: str, key: int, bits: int) -> None:
    prev = ref.get(key, 0)
    if op == "add":
        assert table.add_bits(key, bits) == prev
        new = prev | bits
    else:
        assert table.remove_bits(key, bits) == prev
        new = prev & ~bits
    if new:
        ref[key] = new
    else:
        ref.pop(key, None)


def ref_remove(ref: dict[int, int], key: int, bits: int) -> bool:
    """remove_bits on the reference alone; whether the key is gone by it."""
    prev = ref.pop(key, 0)
    if prev & ~bits:
        ref[key] = prev & ~bits
    return bool(prev) and not prev & ~bits


# -- properties ----------------------------------------------------------------------------------

bit_sets = st.sets(st.integers(0, 199), max_size=4).map(lambda bits: sum(1 << b for b in bits))
key_pools = st.lists(st.integers(0, U64), min_size=1, max_size=12).map(lambda keys: keys + EDGE_KEYS)


@settings(max_examples=120, deadline=None)
@given(pool=key_pools, ops=st.lists(st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 10**6), bit_sets), max_size=60))
def test_matches_a_dict_through_any_sequence_of_updates(pool: list[int], ops: list[tuple[str, int, int]]) -> None:
    table, ref = MaskTable(initial_slots=4), {}
    for op, index, bits in ops:
        apply(table, ref, op, pool[index % len(pool)], bits)
    check_invariants(table, ref)
    check_against(table, ref, pool)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), size=st.integers(1, 400), removed=st.floats(0, 1))
def test_growth_from_a_tiny_table_keeps_every_key(seed: int, size: int, removed: float) -> None:
    rng = random.Random(seed)
    table, ref = MaskTable(initial_slots=1), {}
    keys = [rng.getrandbits(64) for _ in range(size)]
    for key in keys:
        apply(table, ref, "add", key, 1 << rng.randrange(130))
    for key in keys[: int(size * removed)]:
        apply(table, ref, "remove", key, ref.get(key, 0))
    for key in keys[: int(size * removed) : 2]:  # back again, maybe into other slots
        apply(table, ref, "add", key, 1 << rng.randrange(70))
    check_invariants(table, ref)
    check_against(table, ref, keys[:64] + [rng.getrandbits(64) for _ in range(8)])


@settings(max_examples=60, deadline=None)
@given(
    masks=st.lists(st.sets(st.integers(0, 139), max_size=6), min_size=1, max_size=40),
    absent_at=st.none() | st.integers(0, 39),
)
def test_prefix_lengths_is_the_running_and_per_bit(masks: list[set[int]], absent_at: int | None) -> None:
    rng = random.Random(len(masks))
    table, ref = MaskTable(initial_slots=8), {}
    keys = [rng.getrandbits(64) for _ in masks]
    for key, bits in zip(keys, masks):
        apply(table, ref, "add", key, sum(1 << b for b in bits))
    if absent_at is not None and absent_at < len(keys):
        keys[absent_at] = rng.getrandbits(64)
    expected = ref_prefix_lengths(keys, ref, 64 * table.words)
    assert table.prefix_lengths(keys) == expected
    held = np.bitwise_and.accumulate(table.lookup(keys), axis=0)
    running = ref.get(keys[0], 0)
    for key, row in zip(keys, held):
        running &= ref.get(key, 0)
        assert mask_of(row) == running


# -- examples ------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [0, U64, 2**32 + 1, 2**63, 12345], ids=["zero", "max", "equal-halves", "top-bit", "small"])
def test_any_u64_is_a_key(key: int) -> None:
    table = MaskTable()
    assert table.get(key) == 0 and table.lookup([key]).tolist() == [[0]]
    assert table.add_bits(key, 0b101) == 0
    assert table.get(key) == 0b101 and len(table) == 1
    assert table.lookup([key, key]).tolist() == [[0b101], [0b101]]
    assert table.remove_bits(key, 0b100) == 0b101
    assert table.remove_bits(key, 0b001) == 0b001
    assert table.get(key) == 0 and len(table) == 0


@pytest.mark.parametrize(
    ("masks", "expected"),
    [
        ([0b11, 0b11, 0b01], {0: 3, 1: 2}),
        ([0b11, 0b00, 0b11], {0: 1, 1: 1}),
        ([1 << 127 | 1, 1 << 127, 1 << 127], {0: 1, 127: 3}),
        ([1 << 64, 1 << 64 | 1 << 65, 1 << 65], {64: 2}),
    ],
    ids=["one-bit-drops-last", "absent-middle-key", "high-word-survives", "word-one-only"],
)
def test_prefix_lengths_examples(masks: list[int], expected: dict[int, int]) -> None:
    table = MaskTable()
    table.add_bits(1, 1 << 127)  # two words wide
    keys = [1000 + i for i in range(len(masks))]
    for key, mask in zip(keys, masks):
        table.add_bits(key, mask)
    lengths = table.prefix_lengths(keys)
    assert len(lengths) == 64 * table.words == 128
    assert {bit: n for bit, n in enumerate(lengths) if n} == expected


@pytest.mark.parametrize("keys", [[], (), np.zeros(0, dtype=np.uint64)], ids=["list", "tuple", "array"])
def test_no_keys(keys) -> None:
    table = MaskTable()
    table.add_bits(7, 1 << 70)
    assert table.lookup(keys).shape == (0, 2)
    assert table.prefix_lengths(keys) == [0] * 128


def test_widening_keeps_masks_and_lookup_shape() -> None:
    table = MaskTable()
    table.add_bits(1, 0b1)
    table.add_bits(2, 1 << 63)
    assert table.words == 1
    table.add_bits(3, 1 << 64)
    table.add_bits(1, 1 << 200)
    assert table.words == 4
    assert [table.get(k) for k in (1, 2, 3)] == [1 << 200 | 1, 1 << 63, 1 << 64]
    assert table.lookup([1, 2, 3, 4]).shape == (4, 4)
    assert table.prefix_lengths([1, 1])[200] == 2


def test_removed_key_leaves_no_stale_copy() -> None:
    table = MaskTable(initial_slots=4)
    a, b = 0x0000_0001_0000_0001, 0x0000_0002_0000_0001  # both have slot 1 as a candidate
    table.add_bits(a, 1)
    table.remove_bits(a, 1)
    assert table.lookup([a]).tolist() == [[0]] and table.prefix_lengths([a])[0] == 0
    table.add_bits(b, 2)
    table.add_bits(a, 4)  # back, wherever it fits now
    assert table.lookup([a, b]).tolist() == [[4], [2]]
    assert table.remove_bits(a, 4) == 4 and table.get(a) == 0 and table.get(b) == 2
    check_invariants(table, {b: 2})


def test_keys_without_room_overflow_and_stay_exact() -> None:
    table, ref = MaskTable(initial_slots=64), {}
    for i, key in enumerate(ONE_SLOT):
        apply(table, ref, "add", key, 1 << (20 * i))
    assert len(table._stash) == len(ONE_SLOT) - 1
    check_invariants(table, ref)
    check_against(table, ref, ONE_SLOT + [99])
    assert table.prefix_lengths([ONE_SLOT[3]] * 3)[60] == 3
    apply(table, ref, "add", ONE_SLOT[4], 1)
    apply(table, ref, "remove", ONE_SLOT[4], 1 << 80)
    table.reserve(1000)  # a rebuild: still one slot for all of them
    assert len(table._stash) == len(ONE_SLOT) - 1
    check_invariants(table, ref)
    check_against(table, ref, ONE_SLOT + [99])
    for key in list(ref):
        apply(table, ref, "remove", key, ref[key])
    assert len(table) == 0 and not table._stash


def test_many_keys_with_growth_and_churn() -> None:
    rng = random.Random(7)
    table, ref = MaskTable(initial_slots=16), {}
    keys = [rng.getrandbits(64) for _ in range(3000)]
    for i, key in enumerate(keys):
        apply(table, ref, "add", key, 1 << (i % 100))
        if i % 3 == 0:
            apply(table, ref, "remove", keys[rng.randrange(i + 1)], 1 << rng.randrange(100))
    assert table.num_slots * 0.48 >= len(table) > table.num_slots * 0.2
    check_invariants(table, ref)
    check_against(table, ref, keys[:200])
    assert table.nbytes == table.num_slots * 8 * (1 + table.words)


def test_reserve_sizes_the_table_once() -> None:
    table = MaskTable()
    table.add_bits(5, 1)
    table.reserve(10_000)
    slots = table.num_slots
    assert slots * 0.48 >= 10_000 and table.get(5) == 1
    for key in range(1, 10_000):
        table.add_bits(key * 0x9E37_79B9_7F4A_7C15 % 2**64, 1)
    assert table.num_slots == slots


def test_long_prompts() -> None:
    table = MaskTable()
    keys = list(range(1, 3001))
    for key in keys[:2500]:
        table.add_bits(key, 0b10)
    table.add_bits(keys[0], 0b01)
    assert table.prefix_lengths(keys)[:2] == [1, 2500]
    assert table.lookup(keys)[2499:2501].tolist() == [[0b10], [0]]


def test_lookup_returns_a_copy() -> None:
    table = MaskTable()
    table.add_bits(9, 3)
    rows = table.lookup([9])
    rows[0, 0] = 0
    assert table.get(9) == 3 and table.lookup([9]).tolist() == [[3]]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t: t.add_bits(-1, 1), ValueError),
        (lambda t: t.add_bits(2**64, 1), ValueError),
        (lambda t: t.add_bits(1, -1), ValueError),
        (lambda t: t.remove_bits(1, -1), ValueError),
        (lambda t: t.lookup([2**64]), OverflowError),
        (lambda t: t.prefix_lengths([-1]), OverflowError),
    ],
    ids=["negative-key", "key-too-big", "negative-bits", "remove-negative-bits", "lookup-key-too-big", "lookup-negative"],
)
def test_invalid_arguments_raise(call, error) -> None:
    table = MaskTable()
    with pytest.raises(error):
        call(table)
    assert len(table) == 0


# -- many keys at once ---------------------------------------------------------------------------


@pytest.fixture(params=["vectorized", "one-by-one"])
def bulk_min_keys(request):
    """remove_bits_many's two paths: the vectorized one for any number of keys, or remove_bits."""
    with mock.patch.object(mask_table, "_BULK_MIN_KEYS", 0 if request.param == "vectorized" else 10**9):
        yield request.param


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pool=key_pools,
    adds=st.lists(st.tuples(st.integers(0, 10**6), bit_sets), max_size=60),
    removed=st.lists(st.integers(0, 10**6), max_size=30),
    bits=bit_sets,
)
def test_remove_bits_many_equals_remove_bits_per_key(bulk_min_keys, pool, adds, removed, bits) -> None:
    table, ref = MaskTable(initial_slots=4), {}
    for index, add in adds:
        apply(table, ref, "add", pool[index % len(pool)], add)
    keys = [pool[i % len(pool)] for i in removed]  # repeats, and keys never added
    assert table.remove_bits_many(keys, bits) == sum(ref_remove(ref, key, bits) for key in dict.fromkeys(keys))
    check_invariants(table, ref)
    check_against(table, ref, pool)


def test_remove_bits_many_with_keys_in_the_overflow_dict(bulk_min_keys) -> None:
    table, ref = MaskTable(initial_slots=64), {}
    for i, key in enumerate(ONE_SLOT):
        apply(table, ref, "add", key, 1 << (20 * i) | 1)
    assert table._stash
    assert table.remove_bits_many(ONE_SLOT[1:4] + [99, ONE_SLOT[2]], 1) == 0
    for key in ONE_SLOT[1:4]:
        ref_remove(ref, key, 1)
    check_invariants(table, ref)
    check_against(table, ref, ONE_SLOT + [99])
    assert table.remove_bits_many(np.array(ONE_SLOT, dtype=np.uint64), (1 << 120) - 1) == len(ONE_SLOT)
    assert len(table) == 0 and not table._stash
    check_invariants(table, {})


@pytest.mark.slow
def test_remove_bits_many_on_a_large_table_drops_one_bit_everywhere() -> None:
    """Default threshold: thousands of keys take the vectorized path; the other bits stay."""
    rng = random.Random(3)
    table, ref = MaskTable(), {}
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    for i, key in enumerate(keys):
        apply(table, ref, "add", key, 1 << 5 | (1 << 9 if i % 3 == 0 else 0))
    assert len(keys) > table.num_slots >> 9
    assert table.remove_bits_many(keys + keys[:100], 1 << 5) == len(keys) - len(keys[::3])
    ref = {key: 1 << 9 for key in keys[::3]}
    check_invariants(table, ref)
    check_against(table, ref, keys[:300] + [rng.getrandbits(64) for _ in range(20)])
    assert table.remove_bits_many(keys, 0) == 0 and table.remove_bits_many([], 1 << 9) == 0
    assert len(table) == len(ref)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda t: t.remove_bits_many([1], -1), ValueError),
        (lambda t: t.remove_bits_many([2**64], 1), OverflowError),
        (lambda t: t.remove_bits_many([-1], 1), OverflowError),
    ],
    ids=["negative-bits", "key-too-big", "negative-key"],
)
def test_remove_bits_many_invalid_arguments_raise(call, error) -> None:
    table = MaskTable()
    table.add_bits(1, 1)
    with pytest.raises(error):
        call(table)
    assert table.get(1) == 1


@settings(max_examples=150, deadline=None)
@given(
    held_for=st.dictionaries(st.integers(0, 127), st.integers(0, 30), max_size=12),
    noise=st.lists(st.integers(0, U64), max_size=30),
    wide=st.booleans(),
)
def test_prefix_holders_are_the_nonzero_prefix_lengths(held_for: dict[int, int], noise: list[int], wide: bool) -> None:
    """Bit b is held by the first held_for[b] keys (several bits may drop at one key), plus noise
    bits; in one word (the path that maps over single lost bits, or the unpacking one) or two."""
    rng = random.Random(len(held_for) + len(noise))
    width = 128 if wide else 64
    masks = [sum(1 << b % width for b, n in held_for.items() if i < n) for i in range(31)]
    for i, extra in enumerate(noise):
        masks[i] |= extra if i % 2 else 0
    table, ref = MaskTable(initial_slots=8), {}
    if wide:
        table.add_bits(rng.getrandbits(64), 1 << 100)
    keys = [rng.getrandbits(64) for _ in masks]
    for key, mask in zip(keys, masks):
        apply(table, ref, "add", key, mask)
    expected = {b: n for b, n in enumerate(ref_prefix_lengths(keys, ref, 64 * table.words)) if n}
    for asked in (keys, tuple(keys), as_keys(keys)):  # list/tuple: the C walk when built; array: numpy
        bits, lengths = table.prefix_holders(asked)
        assert len(bits) == len(lengths) == len(set(bits))
        assert dict(zip(bits, lengths)) == expected
    column = np.array([[mask >> (64 * w) & U64 for w in range(table.words)] for mask in masks], dtype=np.uint64)
    assert dict(zip(*prefix_holders_of(column))) == expected


def test_prefix_holders_of_masks_wider_than_a_thousand_workers() -> None:
    """Masks of 20 words (more than the C walk keeps on its stack): the same holders either way."""
    rng = random.Random(7)
    table = MaskTable(initial_slots=8)
    keys = [rng.getrandbits(64) for _ in range(12)]
    for i, key in enumerate(keys):
        table.add_bits(key, sum(1 << bit for bit in (3, 700, 1279) if i < bit % 13))
    expected = {3: 3, 700: 11, 1279: 5}
    assert dict(zip(*table.prefix_holders(keys))) == expected
    assert dict(zip(*table.prefix_holders(as_keys(keys)))) == expected
