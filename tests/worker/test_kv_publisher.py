"""KVEventPublisher over loopback ZMQ, checked against vLLM 0.32's wire format written out here."""

from __future__ import annotations

import statistics
import time

import msgpack
import pytest
import zmq

from worker.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from worker.kv_publisher import KVEventPublisher, default_replay_endpoint, encode_batch

ANY_PORT = "tcp://127.0.0.1:*"
BIG_HASH = 2**64 - 1  # xxh3_64 keys use the whole unsigned range
STORED = BlockStored(block_hashes=[BIG_HASH, 7], parent_block_hash=3, token_ids=[1, 2, 3, 4], block_size=2)
REMOVED = BlockRemoved(block_hashes=[BIG_HASH])


# ---- a subscriber written from the wire-format description, not from the publisher's code ----


def seq_of(frame: bytes) -> int:
    assert len(frame) == 8
    return int.from_bytes(frame, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode(payload: bytes) -> list:
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) == 3, "KVEventBatch is the array [ts, events, dp_rank]"
    return batch


class Sockets:
    """Client sockets for one test, all closed at its end."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.opened: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        self.opened.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.opened:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def context():
    sockets = Sockets()
    yield sockets
    sockets.close()


@pytest.fixture
def publisher():
    pub = KVEventPublisher(ANY_PORT, ANY_PORT, clock=lambda: 1234.5)
    yield pub
    pub.close()


def subscribe(context: Sockets, publisher: KVEventPublisher) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(publisher.endpoint)
    return sub


def wait_until_subscribed(publisher: KVEventPublisher, sub: zmq.Socket) -> int:
    """Publish AllBlocksCleared until one arrives (PUB drops all before the subscription lands).

    Returns the seq the next publish() gets.
    """
    for num_sent in range(1, 500):
        publisher.publish([AllBlocksCleared()])
        if sub.poll(20):
            break
    else:
        pytest.fail("subscriber never received a warm-up batch")
    while sub.poll(100):  # drain warm-ups still in flight
        sub.recv_multipart()
    return num_sent


def receive_seq(sub: zmq.Socket, wanted_seq: int) -> list[bytes]:
    while True:
        frames = sub.recv_multipart()
        if seq_of(frames[1]) == wanted_seq:
            return frames


def wait_published(publisher: KVEventPublisher, num_batches: int) -> None:
    deadline = time.monotonic() + 5
    while publisher.stats().batches_published < num_batches:
        assert time.monotonic() < deadline, "publisher thread did not send in time"
        time.sleep(0.005)


def ask_replay(context: Sockets, publisher: KVEventPublisher, start_seq: int, delimiter: bool) -> list[list[bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", seq_bytes(start_seq)] if delimiter else [seq_bytes(start_seq)])
    replies = []
    while True:
        frames = dealer.recv_multipart()
        replies.append(frames)
        if seq_of(frames[-2]) == -1:
            return replies


# ---- tests -----------------------------------------------------------------------------------


def test_subscriber_decodes_every_event_of_a_batch_in_vllm_layout(context, publisher):
    sub = subscribe(context, publisher)
    seq = wait_until_subscribed(publisher, sub)

    publisher.publish([STORED, REMOVED, AllBlocksCleared()])
    topic, seq_frame, payload = receive_seq(sub, seq)

    assert topic == b"kv-events"
    ts, events, dp_rank = decode(payload)
    assert (ts, dp_rank) == (1234.5, 0)
    assert events == [
        {"type": "BlockStored", "block_hashes": [BIG_HASH, 7], "parent_block_hash": 3, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [BIG_HASH], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


def test_sequence_numbers_start_at_zero_and_skip_empty_steps(context, publisher):
    publisher.publish([REMOVED])
    publisher.publish([])
    publisher.publish([AllBlocksCleared()])
    wait_published(publisher, 2)

    replies = ask_replay(context, publisher, 0, delimiter=True)

    assert [seq_of(r[1]) for r in replies] == [0, 1, -1]
    assert publisher.stats().events_published == 2


def test_replay_from_k_returns_k_to_last_then_minus_one(context, publisher):
    for i in range(6):
        publisher.publish([BlockRemoved(block_hashes=[i])])
    wait_published(publisher, 6)

    replies = ask_replay(context, publisher, 3, delimiter=True)

    assert [r[0] for r in replies] == [b""] * 4
    assert [seq_of(r[1]) for r in replies] == [3, 4, 5, -1]
    assert [decode(r[2])[1][0]["block_hashes"] for r in replies[:-1]] == [[3], [4], [5]]
    assert replies[-1][2] == b""


def test_replay_accepts_a_request_without_the_empty_delimiter(context, publisher):
    publisher.publish([REMOVED])
    wait_published(publisher, 1)

    replies = ask_replay(context, publisher, 0, delimiter=False)

    assert [len(r) for r in replies] == [2, 2]
    assert [seq_of(r[0]) for r in replies] == [0, -1]


def test_replay_keeps_only_the_last_buffer_steps_batches(context):
    with KVEventPublisher(ANY_PORT, ANY_PORT, buffer_steps=3) as publisher:
        for i in range(5):
            publisher.publish([BlockRemoved(block_hashes=[i])])
        wait_published(publisher, 5)

        replies = ask_replay(context, publisher, 0, delimiter=True)

    assert [seq_of(r[1]) for r in replies] == [2, 3, 4, -1]


def test_replay_keeps_no_more_than_buffer_bytes_of_batches_but_always_the_newest(context):
    batch = [BlockRemoved(block_hashes=list(range(1_000, 1_200)))]  # about 640 bytes: 3 fit
    with KVEventPublisher(ANY_PORT, ANY_PORT, buffer_bytes=2_000) as publisher:
        size = len(encode_batch(0.0, batch, 0, "GPU"))
        for _ in range(10):
            publisher.publish(batch)
        wait_published(publisher, 10)

        replies = ask_replay(context, publisher, 0, delimiter=True)

    kept = [seq_of(r[1]) for r in replies[:-1]]
    assert kept == list(range(10 - 2_000 // size, 10)) and len(kept) * size <= 2_000


def test_late_subscriber_recovers_missed_batches_through_replay(context, publisher):
    publisher.publish([STORED])
    publisher.publish([REMOVED])
    sub = subscribe(context, publisher)
    first_live_seq = wait_until_subscribed(publisher, sub) - 1

    replies = ask_replay(context, publisher, 0, delimiter=True)

    replayed = {seq_of(r[1]): decode(r[2])[1] for r in replies[:-1]}
    assert set(replayed) >= set(range(first_live_seq + 1))
    assert replayed[0][0]["type"] == "BlockStored" and replayed[0][0]["block_hashes"] == [BIG_HASH, 7]
    assert replayed[1] == [{"type": "BlockRemoved", "block_hashes": [BIG_HASH], "medium": "GPU"}]


def test_publish_takes_microseconds_with_no_subscriber_and_ten_thousand_batches_queued():
    with KVEventPublisher(ANY_PORT, ANY_PORT, max_queue_batches=10_000) as publisher:
        durations_s = []
        for _ in range(20_000):
            start = time.perf_counter()
            publisher.publish([STORED])
            durations_s.append(time.perf_counter() - start)

    assert statistics.median(durations_s) < 50e-6
    assert sorted(durations_s)[int(0.99 * len(durations_s))] < 1e-3


def test_full_queue_drops_oldest_batches_and_counts_them():
    with KVEventPublisher(ANY_PORT, ANY_PORT, max_queue_batches=1) as publisher:
        for _ in range(2_000):
            publisher.publish([REMOVED])
    stats = publisher.stats()

    assert stats.batches_dropped > 0
    assert stats.batches_published + stats.batches_dropped == 2_000


def test_close_is_prompt_and_publish_after_close_raises():
    publisher = KVEventPublisher(ANY_PORT, ANY_PORT)
    publisher.publish([REMOVED])

    start = time.monotonic()
    publisher.close()

    assert time.monotonic() - start < 0.2
    assert publisher.stats().batches_published == 1
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish([REMOVED])


def test_medium_and_data_parallel_rank_come_from_the_constructor(context):
    with KVEventPublisher(ANY_PORT, ANY_PORT, data_parallel_rank=None, medium="CPU") as publisher:
        publisher.publish([REMOVED])
        wait_published(publisher, 1)
        replies = ask_replay(context, publisher, 0, delimiter=True)

    _, events, dp_rank = decode(replies[0][2])
    assert dp_rank is None and events[0]["medium"] == "CPU"


def test_binding_a_busy_port_fails_in_the_constructor(publisher):
    with pytest.raises(OSError) as info:
        KVEventPublisher(publisher.endpoint, ANY_PORT)
    assert str(info.value) == f"cannot bind KV-event socket {publisher.endpoint}: Address already in use"


def test_a_busy_replay_port_is_named_as_the_replay_socket(publisher):
    with pytest.raises(OSError) as info:
        KVEventPublisher(ANY_PORT, publisher.replay_endpoint)
    assert str(info.value) == f"cannot bind KV-event replay socket {publisher.replay_endpoint}: Address already in use"


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [("tcp://127.0.0.1:5701", "tcp://127.0.0.1:5702"), ("tcp://*:5557", "tcp://*:5558")],
    ids=["host", "wildcard-host"],
)
def test_replay_endpoint_defaults_to_the_next_port(endpoint, expected):
    assert default_replay_endpoint(endpoint) == expected


def test_replay_endpoint_must_be_given_when_there_is_no_port():
    with pytest.raises(ValueError, match="kv_events.replay_endpoint must be given"):
        default_replay_endpoint("ipc:///tmp/kv.sock")
