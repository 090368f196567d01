"""Publishes the block manager's KV events in vLLM's ZMQ wire format, off the engine thread.

Wire format (vLLM 0.32 ZmqEventPublisher): PUB multipart (topic, seq as 8-byte big-endian signed,
msgpack [ts, events, data_parallel_rank]); events are maps tagged by "type". A ROUTER socket
replays buffered batches from a start seq and ends with seq -1.

Exposure: the events carry every tenant's prompt token ids, and neither socket authenticates its
peers, so they bind to loopback unless told otherwise: a bare port binds 127.0.0.1 (bind_endpoint);
a tcp://HOST:PORT on another interface (or `*`) exposes those token ids to anyone who can reach it,
and is logged as such. The replay window is bounded: the last REPLAY_BUFFER_STEPS batches, and no
more than REPLAY_BUFFER_BYTES of them (enough for a subscriber to fill a short gap, not a history).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvgate.kv_endpoints import replay_endpoint
from worker.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay's final frame carries this seq and an empty payload
DEFAULT_KV_EVENTS_HOST = "127.0.0.1"
REPLAY_BUFFER_STEPS = 1_000
REPLAY_BUFFER_BYTES = 16 << 20
_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
_POLL_INTERVAL_S = 0.01  # how long the publisher thread waits for a batch before checking replay
_WAKE = object()  # queued by close() so the thread notices at once


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Totals since start. A dropped batch (queue full) leaves a gap in seq that subscribers see."""

    batches_published: int
    events_published: int
    batches_dropped: int
    encode_errors: int
    replay_requests: int


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent, medium: str) -> dict[str, Any]:
    """One event as vLLM 0.32's msgpack map, tagged by "type"."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": event.lora_id, "medium": medium, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int | None, medium: str) -> bytes:
    """A KVEventBatch as vLLM 0.32's msgpack array [ts, events, data_parallel_rank]."""
    return msgpack.packb([float(ts), [encode_event(e, medium) for e in events], data_parallel_rank],
                         use_bin_type=True)


def bind_endpoint(spec: str) -> str:
    """The endpoint to bind for a --kv-events-endpoint value: a bare PORT is tcp://127.0.0.1:PORT."""
    spec = spec.strip()
    return f"tcp://{DEFAULT_KV_EVENTS_HOST}:{spec}" if spec.isdigit() else spec


def is_loopback(endpoint: str) -> bool:
    """Whether only this machine can reach the endpoint (a loopback tcp host, or ipc/inproc)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return scheme in ("ipc", "inproc")
    host = rest.rpartition(":")[0]
    return host.startswith("127.") or host in _LOOPBACK_HOSTS


def default_replay_endpoint(endpoint: str) -> str:
    """The replay endpoint next to a tcp endpoint (kvgate.kv_endpoints: same host, port + 1)."""
    replay = replay_endpoint(endpoint)
    if replay is None:
        raise ValueError(f"kv_events.replay_endpoint must be given for endpoint {endpoint!r} "
                         "(port + 1 needs tcp://host:port)")
    return replay


def _bind_socket(socket: zmq.Socket, endpoint: str, what: str) -> str:
    """Bind and return the bound address; OSError with one line naming the endpoint otherwise."""
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind {what} socket {endpoint}: {zmq.strerror(exc.errno)}") from None
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    """ZMQ PUB of KV-event batches plus a ROUTER replay socket; publish() never blocks.

    publish() stamps a seq and a timestamp and enqueues; a background thread, the only one that
    touches the sockets, encodes, sends and keeps the last buffer_steps batches (at most
    buffer_bytes of payload, the newest always) for replay. When the queue holds
    max_queue_batches, the oldest queued batch is dropped (counted; its seq is a gap). endpoint
    may use port * (the bound address is then in .endpoint after start).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        buffer_steps: int = REPLAY_BUFFER_STEPS,
        data_parallel_rank: int | None = 0,
        *,
        buffer_bytes: int = REPLAY_BUFFER_BYTES,
        medium: str = "GPU",
        max_queue_batches: int = 100_000,
        clock: Callable[[], float] = time.time,
        start_timeout_s: float = 5.0,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("kv_events.buffer_steps must be >= 1")
        if buffer_bytes < 1:
            raise ValueError("kv_events.buffer_bytes must be >= 1")
        if max_queue_batches < 1:
            raise ValueError("kv_events.max_queue_batches must be >= 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or default_replay_endpoint(endpoint)
        self.topic = topic
        self._topic_bytes = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.medium = medium
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_steps = buffer_steps
        self._buffer_bytes = buffer_bytes
        self._num_buffered_bytes = 0
        self._next_seq = 0
        self._counts = {"batches_published": 0, "events_published": 0, "batches_dropped": 0,
                        "encode_errors": 0, "replay_requests": 0}
        self._closing = threading.Event()
        self._close_deadline = 0.0
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._await_start(start_timeout_s)

    # ---- engine thread ------------------------------------------------------------------------

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's events as one batch (nothing for an empty step); never blocks or does I/O."""
        if self._closing.is_set():
            raise RuntimeError("KVEventPublisher is closed")
        if not events:
            return
        item = (self._next_seq, self._clock(), tuple(events))
        self._next_seq += 1
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        try:
            dropped = self._queue.get_nowait()
        except queue.Empty:
            return
        if dropped is not _WAKE:
            self._counts["batches_dropped"] += 1

    def stats(self) -> PublisherStats:
        return PublisherStats(**self._counts)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to timeout_s), then stop and close the sockets (linger 0)."""
        if self._closing.is_set():
            return
        self._close_deadline = time.monotonic() + timeout_s
        self._closing.set()
        try:
            self._queue.put_nowait(_WAKE)
        except queue.Full:
            pass  # the thread is busy draining and will see _closing
        self._thread.join(timeout_s + 1.0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _await_start(self, timeout_s: float) -> None:
        if not self._started.wait(timeout_s):
            self.close(0.0)
            raise RuntimeError(f"KV-event publisher did not start within {timeout_s} s")
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    # ---- publisher thread (owns the sockets) --------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        replay = context.socket(zmq.ROUTER)
        try:
            self._bind(pub, replay)
        except OSError as exc:
            self._start_error = exc
        self._started.set()
        try:
            if self._start_error is None:
                self._loop(pub, replay)
        finally:
            pub.close(linger=0)
            replay.close(linger=0)
            context.term()

    def _bind(self, pub: zmq.Socket, replay: zmq.Socket) -> None:
        pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = _bind_socket(pub, self.endpoint, "KV-event")
        replay.setsockopt(zmq.SNDHWM, self._buffer_steps + 16)
        self.replay_endpoint = _bind_socket(replay, self.replay_endpoint, "KV-event replay")

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket) -> None:
        while True:
            while replay.poll(0):
                self._serve_replay(replay)
            if self._closing.is_set() and (self._queue.empty() or time.monotonic() > self._close_deadline):
                while not self._queue.empty():  # unsent at the close deadline
                    self._drop_oldest()
                return
            try:
                item = self._queue.get(timeout=_POLL_INTERVAL_S)
            except queue.Empty:
                continue
            if item is not _WAKE:
                self._send(pub, *item)

    def _send(self, pub: zmq.Socket, seq: int, ts: float, events: tuple[KVEvent, ...]) -> None:
        try:
            payload = encode_batch(ts, events, self.data_parallel_rank, self.medium)
        except (TypeError, ValueError, OverflowError):
            log.exception("KV-event batch %d could not be encoded; dropped", seq)
            self._counts["encode_errors"] += 1
            return
        pub.send_multipart((self._topic_bytes, encode_seq(seq), payload))
        self._keep_for_replay(seq, payload)
        self._counts["batches_published"] += 1
        self._counts["events_published"] += len(events)

    def _keep_for_replay(self, seq: int, payload: bytes) -> None:
        """Buffer a sent batch; drop the oldest past buffer_steps batches or buffer_bytes (keeping this one)."""
        buffer = self._buffer
        buffer.append((seq, payload))
        self._num_buffered_bytes += len(payload)
        while len(buffer) > 1 and (len(buffer) > self._buffer_steps
                                   or self._num_buffered_bytes > self._buffer_bytes):
            self._num_buffered_bytes -= len(buffer.popleft()[1])

    def _serve_replay(self, replay: zmq.Socket) -> None:
        """(identity, [b"",] start_seq) -> one (identity, [b"",] seq, payload) per batch >= start, then seq -1."""
        frames = replay.recv_multipart()
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            envelope = [frames[0], b""]
        elif len(frames) == 2 and len(frames[1]) == 8:
            envelope = [frames[0]]
        else:
            log.warning("ignoring malformed KV-event replay request of %d frames", len(frames))
            return
        self._counts["replay_requests"] += 1
        start_seq = int.from_bytes(frames[-1], "big", signed=True)
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart([*envelope, encode_seq(seq), payload])
        replay.send_multipart([*envelope, encode_seq(END_SEQ), b""])
