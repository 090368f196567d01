"""Chained block keys: xxh3_64 over (previous key || block tokens), per docs/architecture.md; and a
cache that lets a prompt extending a recent one hash only its new blocks, bounded in bytes.
The chain runs in the C extension router._blockhash when it is built (COMPILED_KEYS), else in Python.

A chain starts from a seed: the model name's hash, or, for a tenant with cache isolation, the model
name hashed with that tenant's cache salt, so its keys never equal another tenant's keys for the
same tokens (docs/architecture.md, "Cache isolation", says what that does and does not hide).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

try:
    from router._blockhash import chain_keys as _chain_keys_c, pack_u32 as _pack_u32_c
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _chain_keys_c = _pack_u32_c = None

COMPILED_KEYS: bool = _chain_keys_c is not None
"""Whether chain_block_keys runs the C extension (else the pure-Python chain)."""

_xxh3_64 = xxhash.xxh3_64_intdigest
_U64LE = struct.Struct("<Q").pack
_U32_TYPECODE = "I" if array("I").itemsize == 4 else "L"
_NEEDS_BYTESWAP = sys.byteorder != "little"


def model_seed(model_name: str, cache_salt: str | None = None) -> int:
    """seed = xxh3_64(model_name as UTF-8); with a cache salt, xxh3_64(model_name as UTF-8) seeded
    with xxh3_64("kvgate-cache-salt:" + salt): a chain of its own for the same tokens."""
    if cache_salt is None:
        return _xxh3_64(model_name.encode("utf-8"))
    return _xxh3_64(model_name.encode("utf-8"), seed=_xxh3_64(_SALT_PREFIX + cache_salt.encode("utf-8")))


_SALT_PREFIX = b"kvgate-cache-salt:"


def pack_tokens_u32le(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive 4-byte little-endian unsigned ints (raises OverflowError if not u32)."""
    if _pack_u32_c is not None and isinstance(token_ids, (list, tuple)):
        return _pack_u32_c(token_ids)
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
    packed = token_ids if isinstance(token_ids, bytes) else pack_tokens_u32le(token_ids)
    if _chain_keys_c is not None:
        return _chain_keys_c(packed, block_size, parent_key)  # (ValueError for block_size < 1 too)
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    return _chain_packed_python(packed, block_size, parent_key)


def _chain_packed_python(packed: bytes, block_size: int, parent_key: int) -> list[int]:
    """chain_block_keys of packed tokens in pure Python (the path without the C extension)."""
    stride = 4 * block_size
    num_blocks = len(packed) // stride
    # struct cuts the blocks out in C (its format cache keeps the compiled layout)
    blocks = struct.unpack(f"{stride}s" * num_blocks, packed[: num_blocks * stride])
    key = parent_key
    return [key := _xxh3_64(_U64LE(key) + block) for block in blocks]


def block_keys(token_ids: Sequence[int] | bytes, block_size: int, model_name: str,
               cache_salt: str | None = None) -> list[int]:
    """Keys of a prompt's full blocks: the chain started from model_seed(model_name, cache_salt)."""
    return chain_block_keys(token_ids, block_size, model_seed(model_name, cache_salt))


DEFAULT_KEY_CACHE_BYTES = 16 * 1024 * 1024
"""PrefixKeyCache's default byte budget: over 256 prompts of 8,192 tokens, one of 2M tokens."""

_KEY_BYTES = 8 + sys.getsizeof(2**63)  # a list slot and a 64-bit int object
_ENTRY_OVERHEAD_BYTES = 300  # the dict entry, its index tuple, the bytes and list headers


class PrefixKeyCache:
    """Block keys of recent prompts, so a prompt that starts like one of them (the next turn of a
    conversation, a shared system prompt) reuses the keys of the common full blocks and hashes
    only the rest. Exact: keys are reused only for byte-identical leading blocks.

    Entries are indexed by (seed, block size, first block's bytes), one per index (the newest).
    Each holds the packed prompt and its keys (~50 KB for 8,192 tokens, ~13 MB for 2M); the
    cache keeps at most max_entries of them in at most max_bytes (num_bytes: their estimated
    size), evicting the least recently used, and never keeps a prompt larger than max_bytes.
    """

    def __init__(self, max_entries: int = 256, max_bytes: int = DEFAULT_KEY_CACHE_BYTES) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.blocks_reused = 0
        self.blocks_hashed = 0
        self._entries: OrderedDict[tuple[int, int, bytes], tuple[bytes, list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, packed: bytes, block_size: int, seed: int) -> list[int]:
        """chain_block_keys(packed, block_size, seed), reusing a cached prompt's common blocks.
        The list returned may be shared with the cache: do not modify it."""
        stride = 4 * block_size
        usable = len(packed) // stride * stride
        if not self.max_entries or not self.max_bytes or not usable:
            keys = chain_block_keys(packed, block_size, seed)
            self.blocks_hashed += len(keys)
            return keys
        index = (seed, block_size, packed[:stride])
        entry = self._entries.get(index)
        common = 0
        if entry is not None:
            cached_packed, cached_keys = entry
            common = _common_blocks(packed, cached_packed, stride, min(usable, len(cached_packed)))
        if common * stride == usable:  # a prefix of the cached prompt (or the same prompt again): keep it
            keys = cached_keys if common == len(cached_keys) else cached_keys[:common]
            self._entries.move_to_end(index)
        else:
            reused = cached_keys[:common] if common else []
            fresh = chain_block_keys(packed[common * stride : usable], block_size, reused[-1] if reused else seed)
            keys = reused + fresh
            self.blocks_hashed += len(fresh)
            self._store(index, packed[:usable], keys)
        self.blocks_reused += common
        return keys

    def _store(self, index: tuple[int, int, bytes], packed: bytes, keys: list[int]) -> None:
        """Keep (packed, keys) as index's entry, the newest; evict the oldest beyond the bounds."""
        size = _entry_bytes(index, packed, keys)
        if size > self.max_bytes:
            return  # it alone would fill the cache: the cache keeps the smaller prompts it has
        old = self._entries.pop(index, None)
        if old is not None:
            self.num_bytes -= _entry_bytes(index, *old)
        while self._entries and (len(self._entries) >= self.max_entries or self.num_bytes + size > self.max_bytes):
            oldest, entry = self._entries.popitem(last=False)  # room first: never over the budget
            self.num_bytes -= _entry_bytes(oldest, *entry)
        self._entries[index] = (packed, keys)
        self.num_bytes += size


def _entry_bytes(index: tuple[int, int, bytes], packed: bytes, keys: list[int]) -> int:
    """An estimate of one entry's memory: its packed tokens, first block, keys and containers."""
    return _ENTRY_OVERHEAD_BYTES + len(index[2]) + len(packed) + _KEY_BYTES * len(keys)


def _common_blocks(a: bytes, b: bytes, stride: int, limit: int) -> int:
    """How many leading stride-byte blocks a and b share, within limit bytes (memcmp, bisected)."""
    hi = limit // stride
    if a[: hi * stride] == b[: hi * stride]:
        return hi
    lo = 0  # the first lo blocks are equal; the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * stride] == b[: mid * stride]:
            lo = mid
        else:
            hi = mid
    return lo
