"""Block keys follow docs/architecture.md exactly."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from router.block_keys import PrefixKeyCache, block_keys, chain_block_keys, model_seed, pack_tokens_u32le


def reference_keys(tokens: list[int], block_size: int, model: str) -> list[int]:
    key = xxhash.xxh3_64_intdigest(model.encode())
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        key = xxhash.xxh3_64_intdigest(struct.pack("<Q", key) + struct.pack(f"<{block_size}I", *block))
        keys.append(key)
    return keys


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200),
    block_size=st.integers(min_value=1, max_value=33),
)
def test_keys_equal_the_documented_formula(tokens: list[int], block_size: int) -> None:
    assert block_keys(tokens, block_size, "llama-3-8b") == reference_keys(tokens, block_size, "llama-3-8b")


@pytest.mark.parametrize(
    ("num_tokens", "num_keys"), [(0, 0), (15, 0), (16, 1), (31, 1), (48, 3)], ids=["empty", "partial", "one", "one-and-partial", "three"]
)
def test_only_full_blocks_have_keys(num_tokens: int, num_keys: int) -> None:
    assert len(block_keys(list(range(num_tokens)), 16, "m")) == num_keys


def test_chain_continues_from_a_parent_key() -> None:
    tokens = list(range(64))
    whole = block_keys(tokens, 16, "m")
    tail = chain_block_keys(tokens[32:], 16, whole[1])
    assert tail == whole[2:]


def test_packed_bytes_and_lists_give_the_same_keys() -> None:
    tokens = [7, 2**32 - 1, 0, 123456] * 8
    assert block_keys(pack_tokens_u32le(tokens), 4, "m") == block_keys(tokens, 4, "m")


def test_different_models_give_different_keys() -> None:
    assert model_seed("a") != model_seed("b")
    assert block_keys([1] * 16, 16, "a") != block_keys([1] * 16, 16, "b")


def test_token_ids_outside_u32_are_rejected() -> None:
    with pytest.raises(OverflowError):
        pack_tokens_u32le([2**32])


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=8),
    shared=st.lists(st.integers(0, 3), max_size=30),
    block_size=st.sampled_from([1, 4, 16]),
    max_entries=st.integers(0, 3),
    max_bytes=st.sampled_from([0, 400, 1_000, 2**20]),
)
def test_prefix_key_cache_gives_the_keys_of_a_fresh_chain(prompts, shared, block_size, max_entries, max_bytes) -> None:
    """Prompts that share prefixes (and tiny alphabets, so blocks repeat) through a small cache,
    bounded by entries and bytes; never over its byte budget."""
    cache = PrefixKeyCache(max_entries, max_bytes)
    for tail in prompts:
        tokens = shared + tail
        assert cache.keys(pack_tokens_u32le(tokens), block_size, 7) == chain_block_keys(tokens, block_size, 7)
        assert cache.num_bytes <= max_bytes and len(cache) <= max_entries


def test_the_next_turn_hashes_only_its_new_blocks() -> None:
    cache = PrefixKeyCache()
    history = list(range(64))  # 4 blocks of 16
    cache.keys(pack_tokens_u32le(history), 16, 1)
    assert (cache.blocks_hashed, cache.blocks_reused) == (4, 0)
    cache.keys(pack_tokens_u32le(history + list(range(100, 132))), 16, 1)  # 2 new blocks
    assert (cache.blocks_hashed, cache.blocks_reused) == (6, 4)
    cache.keys(pack_tokens_u32le(history[:32]), 16, 1)  # a prefix: nothing to hash, the longer entry kept
    assert (cache.blocks_hashed, cache.blocks_reused) == (6, 6)
    keys = cache.keys(pack_tokens_u32le(history[:40] + [999] * 30), 16, 1)  # diverges inside block 2
    assert (cache.blocks_hashed, cache.blocks_reused) == (8, 8)
    assert keys == chain_block_keys(history[:40] + [999] * 30, 16, 1)


def test_the_cache_is_bounded() -> None:
    cache = PrefixKeyCache(max_entries=2)
    for first in range(5):
        cache.keys(pack_tokens_u32le([first] * 32), 16, 1)
    assert len(cache._entries) == 2
