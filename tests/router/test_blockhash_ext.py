"""The C extension router._blockhash agrees with xxhash and with the pure-Python chain.

Tests that take the `ext` fixture skip when the extension isn't built; the chain_block_keys tests at
the end run either way (and force the Python path too).
"""

from __future__ import annotations

import contextlib
import random
import struct
from types import ModuleType
from unittest import mock

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from router import block_keys as bk


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return pytest.importorskip("router._blockhash", reason="C extension not built (no compiler?)")


U64_MAX = 2**64 - 1
BLOCK_SIZES = [1, 2, 3, 15, 16, 17, 32, 64, 100, 256]
PARENTS = [0, 1, 2**63, U64_MAX, 0x0123456789ABCDEF]


def python_chain(packed: bytes, block_size: int, parent: int) -> list[int]:
    """The documented formula, written out independently of router.block_keys."""
    stride = 4 * block_size
    key, keys = parent, []
    for start in range(0, len(packed) - stride + 1, stride):
        key = xxhash.xxh3_64_intdigest(struct.pack("<Q", key) + packed[start : start + stride])
        keys.append(key)
    return keys


def test_xxh3_64_matches_xxhash_for_every_length_up_to_2048(ext: ModuleType) -> None:
    """Every length class: 0, 1-3, 4-8, 9-16, 17-128, 129-240, and long (> 240, several 1 KiB blocks)."""
    rng = random.Random(20240611)
    for length in range(2049):
        for data in (rng.randbytes(length), b"\xff" * length):
            assert ext.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), length


@pytest.mark.parametrize("length", [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 1088, 4096, 100_003])
def test_xxh3_64_matches_xxhash_at_the_class_edges(ext: ModuleType, length: int) -> None:
    data = random.Random(length).randbytes(length)
    assert ext.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=3000))
def test_xxh3_64_matches_xxhash_on_random_inputs(ext: ModuleType, data: bytes) -> None:
    assert ext.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


def test_xxh3_64_takes_any_bytes_like_object(ext: ModuleType) -> None:
    data = bytes(range(200))
    expected = xxhash.xxh3_64_intdigest(data)
    assert ext.xxh3_64(bytearray(data)) == expected
    assert ext.xxh3_64(memoryview(data)) == expected
    with pytest.raises(TypeError):
        ext.xxh3_64("not bytes")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("parent", PARENTS)
def test_chain_keys_equal_the_python_chain(ext: ModuleType, block_size: int, parent: int) -> None:
    rng = random.Random(block_size * 1_000_003 + parent % 1_000_003)
    stride = 4 * block_size
    for num_blocks in (0, 1, 2, 5):
        for trailing in (0, 1, 4, stride - 1):  # trailing partial blocks have no key
            packed = rng.randbytes(num_blocks * stride + trailing % stride)
            expected = python_chain(packed, block_size, parent)
            assert len(expected) == num_blocks
            assert ext.chain_keys(packed, block_size, parent) == expected
            assert bk._chain_packed_python(packed, block_size, parent) == expected


@settings(max_examples=200, deadline=None)
@given(
    packed=st.binary(max_size=2200),
    block_size=st.sampled_from(BLOCK_SIZES) | st.integers(1, 300),
    parent=st.integers(0, U64_MAX),
)
def test_chain_keys_equal_the_python_chain_on_random_inputs(
    ext: ModuleType, packed: bytes, block_size: int, parent: int
) -> None:
    assert ext.chain_keys(packed, block_size, parent) == python_chain(packed, block_size, parent)


def test_chain_keys_takes_any_bytes_like_object(ext: ModuleType) -> None:
    packed = bk.pack_tokens_u32le(range(1000))
    expected = python_chain(packed, 16, 42)
    assert ext.chain_keys(bytearray(packed), 16, 42) == expected
    assert ext.chain_keys(memoryview(packed), 16, 42) == expected
    assert ext.chain_keys(memoryview(packed)[64:], 16, 42) == python_chain(packed[64:], 16, 42)


def test_chain_keys_of_nothing(ext: ModuleType) -> None:
    assert ext.chain_keys(b"", 16, 0) == []
    assert ext.chain_keys(b"\x00" * 63, 16, 0) == []  # a partial block only
    assert ext.chain_keys(b"\x00" * 64, 2**62, 0) == []  # a block longer than any input
    assert ext.chain_keys(b"\x00" * 64, 2**200, 0) == []


def test_chain_keys_are_unsigned_64_bit_ints(ext: ModuleType) -> None:
    keys = ext.chain_keys(bk.pack_tokens_u32le(range(4096)), 1, U64_MAX)
    assert all(type(key) is int and 0 <= key <= U64_MAX for key in keys)
    assert any(key >= 2**63 for key in keys)


@pytest.mark.parametrize("block_size", [0, -1, -(2**100)])
def test_chain_keys_rejects_a_block_size_below_one(ext: ModuleType, block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        ext.chain_keys(b"\x00" * 64, block_size, 0)


@pytest.mark.parametrize("parent", [-1, 2**64, 2**100])
def test_chain_keys_rejects_a_parent_outside_u64(ext: ModuleType, parent: int) -> None:
    with pytest.raises(OverflowError):
        ext.chain_keys(b"\x00" * 64, 16, parent)
    with pytest.raises(OverflowError):
        ext.chain_keys(b"", 16, parent)


def test_chain_keys_rejects_bad_argument_types(ext: ModuleType) -> None:
    with pytest.raises(TypeError):
        ext.chain_keys("text", 16, 0)
    with pytest.raises(TypeError):
        ext.chain_keys(b"", 16.0, 0)
    with pytest.raises(TypeError):
        ext.chain_keys(b"", 16, 0.0)
    with pytest.raises(TypeError):
        ext.chain_keys(b"", 16)  # type: ignore[call-arg]


def test_the_extension_is_the_active_path(ext: ModuleType) -> None:
    """Built, so chain_block_keys runs it."""
    assert bk.COMPILED_KEYS
    assert bk._chain_keys_c is ext.chain_keys


# chain_block_keys: the same keys whichever path is active (these run without the extension too)

ACTIVE_PATHS = ["as-built", "python-forced"]


def _path(name: str) -> contextlib.AbstractContextManager[object]:
    """Runs the block with the C path switched off (python-forced) or as the install left it."""
    return mock.patch.object(bk, "_chain_keys_c", None) if name == "python-forced" else contextlib.nullcontext()


@pytest.mark.parametrize("path", ACTIVE_PATHS)
@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=600),
    block_size=st.sampled_from(BLOCK_SIZES),
    parent=st.sampled_from(PARENTS) | st.integers(0, U64_MAX),
)
def test_chain_block_keys_equals_the_python_path(path: str, tokens: list[int], block_size: int, parent: int) -> None:
    """chain_block_keys of token lists and of packed bytes gives the pure-Python path's keys."""
    packed = bk.pack_tokens_u32le(tokens)
    expected = python_chain(packed, block_size, parent)
    assert bk._chain_packed_python(bk.pack_tokens_u32le(tokens), block_size, parent) == expected
    with _path(path):
        assert bk.chain_block_keys(tokens, block_size, parent) == expected
        assert bk.chain_block_keys(packed, block_size, parent) == expected


@pytest.mark.parametrize("path", ACTIVE_PATHS)
def test_chain_block_keys_keeps_its_errors(path: str) -> None:
    with _path(path):
        with pytest.raises(ValueError, match="block_size"):
            bk.chain_block_keys([1, 2, 3], 0, 0)
        with pytest.raises(ValueError, match="block_size"):
            bk.chain_block_keys(b"", -1, 0)
        with pytest.raises(OverflowError):
            bk.chain_block_keys([2**32], 1, 0)
        with pytest.raises(OverflowError):
            bk.chain_block_keys([-1], 1, 0)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 2**30 + 5), max_size=300))
def test_pack_u32_equals_the_array_packing(ext: ModuleType, tokens: list[int]) -> None:
    expected = struct.pack(f"<{len(tokens)}I", *tokens)
    assert ext.pack_u32(tokens) == expected
    assert ext.pack_u32(tuple(tokens)) == expected


@pytest.mark.parametrize(
    ("tokens", "error"),
    [([-1], OverflowError), ([-(2**40)], OverflowError), ([2**32], OverflowError), ([2**64], OverflowError),
     ([1.0], TypeError), (["1"], TypeError), ([None], TypeError)],
    ids=["minus-one", "very-negative", "2**32", "2**64", "float", "str", "none"],
)
def test_pack_u32_rejects_what_is_not_a_u32(ext: ModuleType, tokens: list, error: type) -> None:
    with pytest.raises(error):
        ext.pack_u32([5, *tokens])


def test_pack_u32_takes_int_likes_as_array_does(ext: ModuleType) -> None:
    import numpy as np

    assert ext.pack_u32([True, np.int64(7), np.uint32(2**32 - 1)]) == struct.pack("<3I", 1, 7, 2**32 - 1)
    with pytest.raises(TypeError):
        ext.pack_u32(iter([1, 2]))  # a list or a tuple only (pack_tokens_u32le sends the rest to array)


def test_pack_u32_survives_an_index_that_changes_the_list(ext: ModuleType) -> None:
    """__index__ runs Python code: a token list resized meanwhile is an error, not a crash."""
    tokens: list = []

    class Shrinking:
        def __index__(self) -> int:
            tokens.clear()
            return 1

    tokens.extend([Shrinking(), 2, 3])
    with pytest.raises(RuntimeError, match="changed"):
        ext.pack_u32(tokens)
