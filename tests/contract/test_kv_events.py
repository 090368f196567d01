"""The KV-event contract, checked from both sides.

The subscriber here is written from the wire-format description in docs/architecture.md
(ZMQ multipart: topic, 8-byte big-endian seq, msgpack [ts, events, dp_rank] with events as maps
tagged by "type"), not from either side's code. It checks that the worker publishes every
block it stores and evicts, that replay recovers missed batches, and that the router's keys for
a request equal the keys carried by the events a real worker publishes after serving it.
"""

from __future__ import annotations

import asyncio
import struct
import time
from contextlib import ExitStack

import msgpack
import pytest
import zmq

from kvgate.kv_endpoints import replay_endpoint
from router.block_keys import block_keys
from router.kv_index import KvIndex
from router.subscriber import KvEventSubscriber
from router.tokenization import RoutingTokenizer
from tests.conftest import free_port_pair
from tests.processes import running, worker_process
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.events import AllBlocksCleared
from worker.engine.sampling_params import SamplingParams
from worker.kv_publisher import KVEventPublisher


def decode_message(frames: list[bytes]) -> tuple[int, list[dict]]:
    """(seq, events) from one published message, per the wire description."""
    topic, seq_frame, payload = frames
    (seq,) = struct.unpack(">q", seq_frame)
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and isinstance(events, list)
    return seq, events


def apply(cached: set[int], events: list[dict]) -> None:
    for event in events:
        kind = event["type"]
        if kind == "BlockStored":
            assert len(event["token_ids"]) == event["block_size"] * len(event["block_hashes"])
            cached.update(event["block_hashes"])
        elif kind == "BlockRemoved":
            for block_hash in event["block_hashes"]:
                cached.remove(block_hash)  # never a removal of something not stored
        elif kind == "AllBlocksCleared":
            cached.clear()
        else:
            raise AssertionError(f"unknown event type {kind}")


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)

    def probe_until_subscribed(self, publisher: KVEventPublisher, timeout_s: float = 5.0) -> int:
        """Publish AllBlocksCleared (harmless: nothing is cached yet) until one arrives here, so
        the subscription has reached the publisher; returns how many probes were published (the
        first received is left to read)."""
        deadline = time.monotonic() + timeout_s
        num_probes = 0
        while True:
            publisher.publish([AllBlocksCleared()])
            num_probes += 1
            if self.socket.poll(50):
                return num_probes
            assert time.monotonic() < deadline, "the subscription never reached the publisher"

    def receive_through(self, last_seq: int, timeout_s: float = 10.0) -> list[tuple[int, list[dict]]]:
        """Messages up to and including seq last_seq (each arriving within timeout_s)."""
        messages: list[tuple[int, list[dict]]] = []
        while not messages or messages[-1][0] < last_seq:
            assert self.socket.poll(int(timeout_s * 1000)), f"no message after {messages[-1:]}"
            messages.append(decode_message(self.socket.recv_multipart()))
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def replay(endpoint: str, start_seq: int) -> list[tuple[int, list[dict]]]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", struct.pack(">q", start_seq)])
    batches = []
    try:
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            frames = frames[1:] if frames[0] == b"" else frames
            (seq,) = struct.unpack(">q", frames[0])
            if seq == -1:
                return batches
            batches.append((seq, msgpack.unpackb(frames[1], raw=False)[1]))
        raise AssertionError("replay did not end with seq -1")
    finally:
        dealer.close(linger=0)
        context.term()


@pytest.fixture
def engine_with_publisher(tiny_llama_dir):
    from worker.executor.torch_executor import TorchExecutor

    executor = TorchExecutor.from_pretrained(tiny_llama_dir, block_size=4, num_blocks=24)
    events: list = []
    engine = Engine(executor, None, EngineConfig(model_name="tiny", block_size=4, num_blocks=24,
                                                  max_num_batched_tokens=64), event_sink=events.append)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    yield engine, events, publisher
    publisher.close()


def run_requests(engine: Engine, events: list, publisher: KVEventPublisher, prompts: list[list[int]]) -> int:
    """Serve prompts, publishing each step's events; returns how many batches were published."""
    num_batches = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            if events:
                publisher.publish(list(events))
                events.clear()
                num_batches += 1
    return num_batches


def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


PROMPTS = [[(7 * i + j) % 300 + 5 for j in range(10 + 3 * i)] for i in range(12)]
PROMPTS += [PROMPTS[0] + [9, 9, 9, 9], PROMPTS[3][:8] + [11] * 9]  # shared prefixes: cache hits


def test_replaying_published_events_reproduces_the_engines_cached_blocks(engine_with_publisher):
    engine, events, publisher = engine_with_publisher
    subscriber = Subscriber(publisher.endpoint)
    try:
        num_probes = subscriber.probe_until_subscribed(publisher)  # (late joiners use replay)
        num_published = num_probes + run_requests(engine, events, publisher, PROMPTS)
        messages = subscriber.receive_through(num_published - 1)
    finally:
        subscriber.close()
    seqs = [seq for seq, _ in messages]
    assert seqs[0] < num_probes and seqs == list(range(seqs[0], num_published))
    cached: set[int] = set()
    for _, batch in messages:
        apply(cached, batch)
    assert any(e["type"] == "BlockRemoved" for _, batch in messages for e in batch), "the run must evict"
    assert cached == set(engine.block_manager.cached_block_keys())


def test_a_subscriber_that_missed_batches_recovers_them_by_replay(engine_with_publisher):
    engine, events, publisher = engine_with_publisher
    num_batches = run_requests(engine, events, publisher, PROMPTS[:6])  # nobody listening: all missed
    until(lambda: publisher.stats().batches_published == num_batches)  # sent, so buffered for replay
    batches = replay(publisher.replay_endpoint, 0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    cached: set[int] = set()
    for _, batch in batches:
        apply(cached, batch)
    assert cached == set(engine.block_manager.cached_block_keys())
    later = replay(publisher.replay_endpoint, 2)
    assert [seq for seq, _ in later] == list(range(2, len(batches)))


async def until_subscribed(client, url: str, subscriber: KvEventSubscriber, timeout_s: float = 30.0) -> None:
    """Serve distinct warm-up prompts until the subscriber has applied one of the worker's batches:
    its subscription has reached the worker, so what follows arrives from its first batch."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while subscriber.counters.batches == 0:
        assert time.monotonic() < deadline, "no KV event reached the subscriber"
        await client.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": f"warm-up number {attempt} " * 3, "max_tokens": 1, "temperature": 0})
        attempt += 1  # (awaiting the answer gave the subscriber's task its turns to read)


@pytest.mark.slow
def test_router_keys_for_a_chat_equal_the_keys_a_real_worker_publishes(tiny_llama_dir):
    """End to end across processes: a real worker serves a chat; the router's subscriber
    indexes its events; the router's own keys for that chat are all found at that worker."""
    block_size = 4
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    kv_port = free_port_pair()
    tokenizer = RoutingTokenizer.from_dir(tiny_llama_dir)
    token_ids = tokenizer.encode_chat(messages)
    router_keys = block_keys(token_ids, block_size, "tiny")
    assert len(router_keys) >= 4

    async def scenario(url: str) -> dict[str, tuple[int, int]]:
        import httpx

        index = KvIndex()
        index.add_worker("w0", model_name="tiny")
        endpoint = f"tcp://127.0.0.1:{kv_port}"
        subscriber = KvEventSubscriber("w0", index, endpoint, replay_endpoint=replay_endpoint(endpoint))
        subscriber.start()
        async with httpx.AsyncClient(timeout=60) as client:
            await until_subscribed(client, url, subscriber)
            response = await client.post(f"{url}/v1/chat/completions", json={
                "model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True})
            assert response.json()["prompt_token_ids"] == token_ids  # router and worker tokenize alike
        for _ in range(50):
            if index.match(router_keys).get("w0", (0, 0))[0] >= len(router_keys):
                break
            await asyncio.sleep(0.05)
        await subscriber.stop()
        return index.match(router_keys)

    with ExitStack() as stack:
        worker = stack.enter_context(running(worker_process(
            tiny_llama_dir, "--block-size", str(block_size), "--served-model-name", "tiny", kv_events_port=kv_port)))
        match = asyncio.run(scenario(worker.url))
    confirmed, _ = match["w0"]
    assert confirmed == len(router_keys)  # every full prompt block, under the router's own keys
