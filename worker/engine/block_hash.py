"""Chained block keys for the prefix cache, exactly as docs/architecture.md defines them.

seed = xxh3_64(model_name); key_0 = xxh3_64(u64le(seed) || u32le(block_0));
key_i = xxh3_64(u64le(key_{i-1}) || u32le(block_i)). Only full blocks have keys.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest


def model_seed(model_name: str) -> int:
    """seed = xxh3_64(model_name as UTF-8)."""
    return _xxh3_64(model_name.encode("utf-8"))


@lru_cache(maxsize=16)
def _block_struct(block_size: int) -> struct.Struct:
    """u64le(parent key) followed by block_size u32le token ids."""
    return struct.Struct(f"<Q{block_size}I")


def block_key(parent_key: int, block_token_ids: Sequence[int]) -> int:
    """xxh3_64(u64le(parent_key) || u32le(block_token_ids)); parent_key is the seed for block 0."""
    return _xxh3_64(_block_struct(len(block_token_ids)).pack(parent_key, *block_token_ids))


def extend_block_keys(
    keys: list[int], token_ids: Sequence[int], block_size: int, seed: int
) -> None:
    """Append to keys the keys of token_ids' full blocks that keys does not cover yet.

    keys must be the chain of token_ids' first len(keys) blocks; the cost is one hash per new
    block, so a sequence growing during decode never rehashes its prompt.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    pack = _block_struct(block_size).pack
    num_full_blocks = len(token_ids) // block_size
    parent = keys[-1] if keys else seed
    for index in range(len(keys), num_full_blocks):
        start = index * block_size
        parent = _xxh3_64(pack(parent, *token_ids[start : start + block_size]))
        keys.append(parent)


def block_keys(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Keys of token_ids' full blocks, chained from seed (a trailing partial block has none)."""
    keys: list[int] = []
    extend_block_keys(keys, token_ids, block_size, seed)
    return keys
