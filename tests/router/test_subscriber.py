"""KvEventSubscriber over real ZMQ sockets on loopback: order, gaps with replay, restarts, bad data."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from router.block_keys import block_keys
from router.kv_events import encode_seq
from router.kv_index import KvIndex
from router.subscriber import KvEventSubscriber

B = 4
TOKENS = list(range(1, 25))  # six blocks
KEYS = block_keys(TOKENS, B, "m")


def stored_map(hashes: list[int], first_block: int, parent: int | None) -> dict:
    tokens = TOKENS[first_block * B : (first_block + len(hashes)) * B]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": B, "lora_id": None, "medium": "GPU"}


def stored_array(hashes: list[int], first_block: int, parent: int | None) -> list:
    tokens = TOKENS[first_block * B : (first_block + len(hashes)) * B]
    return ["BlockStored", hashes, parent, tokens, B, None, "GPU"]


def batch_array(*events: object) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def batch_map(*events: object) -> bytes:
    return msgpack.packb({"ts": 1.0, "events": list(events), "data_parallel_rank": 0})


class FakeWorker:
    """A worker's KV-event side: XPUB (to see the subscription arrive) and a ROUTER replay socket."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.pub = context.socket(zmq.XPUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay = context.socket(zmq.ROUTER)
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []

    async def publish(self, seq: int, payload: bytes, *, lost: bool = False) -> None:
        self.buffer.append((seq, payload))
        if not lost:
            await self.pub.send_multipart([b"kv-events", encode_seq(seq), payload])

    async def serve_replay_once(self) -> None:
        identity, empty, start = await self.replay.recv_multipart()
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in self.buffer:
            if seq >= start_seq:
                await self.replay.send_multipart([identity, b"", encode_seq(seq), payload])
        await self.replay.send_multipart([identity, b"", encode_seq(-1), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.replay.close(linger=0)


Scenario = Callable[[FakeWorker, KvEventSubscriber, KvIndex], Awaitable[None]]


def run_scenario(scenario: Scenario, *, with_replay: bool = True, **options: int) -> None:
    """options: the subscriber's max_replay_batches / max_message_bytes."""
    async def main() -> None:
        context = zmq.asyncio.Context()
        worker = FakeWorker(context)
        index = KvIndex()
        index.add_worker("w0", model_name="m")
        sub = KvEventSubscriber(
            "w0", index, worker.endpoint, replay_endpoint=worker.replay_endpoint if with_replay else None,
            replay_timeout_s=1.0, context=context, **options,
        )
        sub.start()
        try:
            await asyncio.wait_for(worker.pub.recv(), 5)  # the subscription reached the publisher
            await scenario(worker, sub, index)
        finally:
            await sub.stop()
            worker.close()
            context.term()

    asyncio.run(main())


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("encode", [batch_array, batch_map], ids=["array-batch", "map-batch"])
@pytest.mark.parametrize("event", [stored_map, stored_array], ids=["map-events", "array-events"])
def test_batches_in_order_are_applied(encode: Callable, event: Callable) -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        await worker.publish(0, encode(event([10, 11], 0, None)))
        await worker.publish(1, encode(event([12], 2, 11)))
        await until(lambda: sub.counters.batches == 2)
        assert index.match(KEYS) == {"w0": (3, 0)}
        assert sub.counters.events_applied == 2

    run_scenario(scenario)


def test_gap_is_filled_from_the_replay_socket() -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        replay = asyncio.create_task(worker.serve_replay_once())
        await worker.publish(0, batch_array(stored_map([10, 11], 0, None)))
        await worker.publish(1, batch_map(stored_array([12], 2, 11)), lost=True)
        await worker.publish(2, batch_array(stored_map([13], 3, 12)))
        await until(lambda: sub.counters.batches == 3)
        await replay
        assert index.match(KEYS) == {"w0": (4, 0)}
        assert (sub.counters.gaps, sub.counters.replays, sub.counters.replayed_batches) == (1, 1, 1)

    run_scenario(scenario)


def test_gap_without_replay_clears_the_worker() -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        await worker.publish(0, batch_array(stored_map([10, 11], 0, None)))
        await worker.publish(1, batch_array(stored_map([12], 2, 11)), lost=True)
        await worker.publish(2, batch_array(stored_map([20], 0, None)))
        await until(lambda: sub.counters.batches == 2)
        assert index.match(KEYS) == {"w0": (1, 0)}  # only what came after the gap
        assert (sub.counters.gaps, sub.counters.replay_failures) == (1, 1)

    run_scenario(scenario, with_replay=False)


def test_sequence_reset_means_restart_and_clears_first() -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        await worker.publish(5, batch_array(stored_map([10, 11, 12], 0, None)))
        await worker.publish(0, batch_array(stored_map([30], 0, None)))
        await until(lambda: sub.counters.batches == 2)
        assert index.match(KEYS) == {"w0": (1, 0)}
        assert sub.counters.resets == 1
        assert sub.last_seq == 0

    run_scenario(scenario)


def test_malformed_payload_is_counted_and_the_stream_continues() -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        await worker.publish(0, b"\xc1 not msgpack")
        await worker.publish(1, batch_array(stored_map([10], 0, None)))
        await until(lambda: sub.counters.batches == 1)
        assert sub.counters.decode_errors == 1
        assert sub.counters.gaps == 0
        assert index.match(KEYS) == {"w0": (1, 0)}

    run_scenario(scenario)


def test_a_burst_is_applied_in_order() -> None:
    """Hundreds of messages published back to back (read in runs without a future each): all
    applied, in order, none lost."""

    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        for seq in range(400):  # chains of six one-block events, each block on the one before
            first = seq % 6
            parent = None if first == 0 else 100 * (seq - 1) + first - 1
            await worker.publish(seq, batch_array(["BlockStored", [100 * seq + first], parent,
                                                   TOKENS[first * B : (first + 1) * B], B, None, "GPU"]))
        await until(lambda: sub.counters.batches == 400)
        assert (sub.counters.events_applied, sub.counters.gaps, sub.counters.decode_errors) == (400, 0, 0)
        assert index.counters.stored_unknown_parent == 0  # every parent was applied before its child
        assert index.match(KEYS) == {"w0": (6, 0)}

    run_scenario(scenario)


def test_a_jump_beyond_the_replay_window_resyncs_without_asking_for_replay() -> None:
    """A seq far ahead (a long outage, or a bogus seq) costs no list of the missed seqs and no
    replay request: more than max_replay_batches cannot be replayed, so the worker is resynced."""

    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        await worker.publish(0, batch_array(stored_map([10, 11], 0, None)))
        await worker.publish(2**40, batch_array(stored_map([20], 0, None)))
        await until(lambda: sub.counters.batches == 2)
        assert index.match(KEYS) == {"w0": (1, 0)}  # only what came after the jump
        assert (sub.counters.gaps, sub.counters.replay_failures, sub.counters.replays) == (1, 1, 0)
        assert sub.last_seq == 2**40
        assert await worker.replay.poll(timeout=0) == 0  # nobody asked

    run_scenario(scenario, max_replay_batches=100)


def test_a_gap_within_the_replay_window_is_still_replayed() -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        replay = asyncio.create_task(worker.serve_replay_once())
        await worker.publish(0, batch_array(stored_map([10, 11], 0, None)))
        await worker.publish(1, batch_array(stored_map([12], 2, 11)), lost=True)
        await worker.publish(2, batch_array(stored_map([13], 3, 12)), lost=True)
        await worker.publish(3, batch_array(stored_map([14], 4, 13)))
        await until(lambda: sub.counters.batches == 4)
        await replay
        assert index.match(KEYS) == {"w0": (5, 0)}
        assert (sub.counters.replays, sub.counters.replayed_batches, sub.counters.replay_failures) == (1, 2, 0)

    run_scenario(scenario, max_replay_batches=2)


def test_a_replay_that_skips_a_seq_resyncs() -> None:
    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        replay = asyncio.create_task(worker.serve_replay_once())
        await worker.publish(0, batch_array(stored_map([10, 11], 0, None)))
        await worker.publish(1, batch_array(stored_map([12], 2, 11)), lost=True)
        worker.buffer.pop()  # seq 1 is no longer buffered: the replay starts at 2
        await worker.publish(2, batch_array(stored_map([13], 3, 12)), lost=True)
        await worker.publish(3, batch_array(stored_map([30], 0, None)))
        await until(lambda: sub.counters.batches == 2)
        await replay
        assert index.match(KEYS) == {"w0": (1, 0)}
        assert (sub.counters.gaps, sub.counters.replays, sub.counters.replay_failures) == (1, 0, 1)

    run_scenario(scenario)


def test_a_message_over_max_message_bytes_never_arrives() -> None:
    """ZMQ_MAXMSGSIZE: the oversized frame drops the connection (ZMQ reconnects and subscribes
    again), so its payload is never buffered or decoded; the seq it used is a gap."""

    async def scenario(worker: FakeWorker, sub: KvEventSubscriber, index: KvIndex) -> None:
        await worker.publish(0, batch_array(stored_map([10, 11], 0, None)))
        await until(lambda: sub.counters.batches == 1)
        oversized = {**stored_map([12], 2, 11), "padding": b"x" * 8192}
        await worker.publish(1, batch_map(oversized))
        while (await asyncio.wait_for(worker.pub.recv(), 5))[:1] != b"\x01":  # dropped (an unsubscribe) ...
            pass  # ... reconnected: subscribed again
        await worker.publish(2, batch_array(stored_map([20], 0, None)))
        await until(lambda: sub.counters.batches == 2)
        assert index.match(KEYS) == {"w0": (1, 0)}
        assert (sub.counters.decode_errors, sub.counters.gaps, sub.counters.replay_failures) == (0, 1, 1)
        assert sub.counters.disconnects == 1

    run_scenario(scenario, with_replay=False, max_message_bytes=4096)
