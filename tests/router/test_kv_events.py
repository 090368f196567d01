"""Decoding vLLM KV-event batches in every layout."""

from __future__ import annotations

import msgpack
import pytest

from router.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
)

STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,  # newer vLLM field, ignored
}
STORED_ARRAY = ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"]
EXPECTED_STORED = BlockStored([11, 12], None, list(range(8)), 4, None, "GPU")


@pytest.mark.parametrize(
    "batch",
    [
        [1.5, [STORED_MAP, {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0],
        {"ts": 1.5, "events": [STORED_ARRAY, ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]], "data_parallel_rank": 0},
        [1.5, [STORED_ARRAY, ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]], 0],
        {"ts": 1.5, "events": [STORED_MAP, {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}, {"type": "AllBlocksCleared"}], "data_parallel_rank": 0, "extra": 1},
    ],
    ids=["array-batch-map-events", "map-batch-array-events", "array-batch-array-events", "map-batch-map-events"],
)
def test_every_layout_decodes_to_the_same_events(batch: object) -> None:
    decoded = decode_batch(msgpack.packb(batch))
    assert decoded.ts == 1.5
    assert decoded.data_parallel_rank == 0
    assert decoded.events == (EXPECTED_STORED, BlockRemoved([11], "GPU"), AllBlocksCleared())


def test_bytes_block_hashes_are_kept_opaque() -> None:
    event = dict(STORED_MAP, block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=b"\x00" * 32)
    decoded = decode_batch(msgpack.packb([0, [event]], use_bin_type=True)).events[0]
    assert decoded.block_hashes == [b"\x01" * 32, b"\x02" * 32]
    assert decoded.parent_block_hash == b"\x00" * 32


def test_batch_without_rank_decodes_with_rank_none() -> None:
    assert decode_batch(msgpack.packb([2, []])).data_parallel_rank is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "payload is not msgpack"),
        (msgpack.packb("hello"), "batch must be an array [ts, events, ...] or a map, got str"),
        (msgpack.packb([1, {"a": 1}]), "batch.events must be an array, got dict"),
        (msgpack.packb(["x", []]), "batch.ts must be a number, got str"),
        (msgpack.packb([1, [{"type": "BlockMoved"}]]), "events[0]: unknown event type 'BlockMoved'"),
        (msgpack.packb([1, [7]]), "events[0] must be a map or a tagged array, got int"),
        (msgpack.packb([1, [dict(STORED_MAP, block_size=0)]]), "events[0].block_size must be a positive int"),
        (msgpack.packb([1, [dict(STORED_MAP, token_ids=[1, 2])]]), "events[0]: 2 token_ids for 2 blocks of 4"),
        (msgpack.packb([1, [{"type": "BlockRemoved"}]]), "events[0].block_hashes must be an array"),
    ],
    ids=["not-msgpack", "scalar", "events-not-array", "ts-not-number", "unknown-type", "event-scalar", "bad-block-size", "short-tokens", "missing-hashes"],
)
def test_malformed_payloads_raise_a_clear_error(payload: bytes, message: str) -> None:
    with pytest.raises(KvEventDecodeError) as excinfo:
        decode_batch(payload)
    assert str(excinfo.value).startswith(message)


def test_seq_round_trips_as_8_byte_big_endian_signed() -> None:
    assert encode_seq(-1) == b"\xff" * 8
    assert decode_seq(encode_seq(2**40 + 3)) == 2**40 + 3
    with pytest.raises(KvEventDecodeError, match="seq frame must be 8 bytes, got 4"):
        decode_seq(b"\x00" * 4)


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (["BlockStored", [11, 12], None, list(range(8)), 4], BlockStored([11, 12], None, list(range(8)), 4, None, None)),
        (["BlockStored", [11], 7, list(range(4)), 4, None, "GPU", "a-newer-field"],
         BlockStored([11], 7, list(range(4)), 4, None, "GPU")),
        (["BlockStored", [[1, 2], [3, 4]], [0, 9], list(range(8)), 4, 5, 3],
         BlockStored([(1, 2), (3, 4)], (0, 9), list(range(8)), 4, 5, None)),
    ],
    ids=["older-layout-without-lora-and-medium", "newer-layout-with-more-fields", "array-hashes-and-a-non-string-medium"],
)
def test_array_events_of_other_lengths_and_shapes(event: list, expected: BlockStored) -> None:
    assert decode_batch(msgpack.packb([1, [event]])).events == (expected,)


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (["BlockStored"], "events[0].block_hashes must be an array"),
        (["BlockStored", [1], None, [1, 2, 3, 4], True], "events[0].block_size must be a positive int"),
        (["BlockStored", [1], {"a": 1}, [1, 2, 3, 4], 4], "events[0]: a block hash must not be a map"),
    ],
    ids=["tag-only", "bool-block-size", "map-parent"],
)
def test_malformed_array_events_raise_a_clear_error(event: list, message: str) -> None:
    with pytest.raises(KvEventDecodeError) as excinfo:
        decode_batch(msgpack.packb([1, [event]]))
    assert str(excinfo.value).startswith(message)
