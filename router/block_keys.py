"""Chained block keys: xxh3_64 over (previous key || block tokens), per docs/architecture.md."""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest
_U64LE = struct.Struct("<Q").pack
_U32_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_NEEDS_BYTESWAP = sys.byteorder != "little"


def model_seed(model_name: str) -> int:
    """seed = xxh3_64(model_name as UTF-8)."""
    return _xxh3_64(model_name.encode("utf-8"))


def pack_tokens_u32le(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive 4-byte little-endian unsigned ints (raises OverflowError if not u32)."""
    packed = array(_U32_TYPECODE, token_ids)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def chain_block_keys(
    token_ids: Sequence[int] | bytes, block_size: int, parent_key: int
) -> list[int]:
    """Keys of the full blocks of token_ids, chained from parent_key (the seed for a prompt start).

    key_i = xxh3_64(u64le(key_{i-1}) || u32le(tokens[i*B:(i+1)*B])); a trailing partial block has
    no key. token_ids may already be packed (bytes from pack_tokens_u32le).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    packed = token_ids if isinstance(token_ids, bytes) else pack_tokens_u32le(token_ids)
    stride = 4 * block_size
    num_blocks = len(packed) // stride
    # struct cuts the blocks out in C (its format cache keeps the compiled layout)
    blocks = struct.unpack(f"{stride}s" * num_blocks, packed[: num_blocks * stride])
    key = parent_key
    return [key := _xxh3_64(_U64LE(key) + block) for block in blocks]


def block_keys(token_ids: Sequence[int] | bytes, block_size: int, model_name: str) -> list[int]:
    """Keys of a prompt's full blocks: the chain started from model_seed(model_name)."""
    return chain_block_keys(token_ids, block_size, model_seed(model_name))
