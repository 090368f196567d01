"""KV-event subscriber for one worker: ZMQ SUB on the event loop, sequence tracking, gap replay.

Memory stays bounded whatever a worker (or an impostor on its port) sends: ZMQ drops the
connection of a peer whose message exceeds max_message_bytes (ZMQ_MAXMSGSIZE, on the SUB and the
replay socket) before reading it, and the subscriber connects again (libzmq does not after such a
drop); a gap longer than max_replay_batches is not replayed but resynced (the worker's entries
dropped, its stream followed from there); replayed batches are applied as they arrive, never
collected.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvgate.tasks import stop_tasks
from router.kv_events import KvEventBatch, KvEventDecodeError, decode_batch, decode_seq, encode_seq
from router.kv_index import KvIndex

log = logging.getLogger(__name__)

_END_SEQ = -1
_RECONNECT_DELAY_S = 0.1  # libzmq's own reconnect interval (ZMQ_RECONNECT_IVL's default)
_DRAIN_BATCHES = 32  # messages read in one turn of the event loop, at most (a few ms of work)
DEFAULT_MAX_REPLAY_BATCHES = 10_000  # vLLM's replay buffer (buffer_steps); the bundled worker keeps <= 1,000
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # one frame; a step's batch is KBs, a 128k-token prefill < 1 MB


@dataclass(slots=True)
class SubscriberCounters:
    """Monotonic counters for one worker's stream, exported as metrics by the gateway."""

    batches: int = 0
    events_applied: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0  # gaps not filled (no replay socket, too long, replay failed): resyncs
    resets: int = 0
    decode_errors: int = 0
    disconnects: int = 0  # the SUB's connection dropped (worker gone, or a message over max_message_bytes)


class KvEventSubscriber:
    """Applies one worker's KV events to the index, in order.

    A gap in seq asks the replay socket (DEALER -> ROUTER: [b"", start seq]; replies
    [b"", seq, payload] until seq -1) for the missed batches; if replay is impossible or
    incomplete, or the gap is longer than max_replay_batches (more than the worker buffers), the
    worker's confirmed entries are cleared (a resync). A seq at or below the last one means the
    worker restarted: its entries are cleared before the batch is applied. A message over
    max_message_bytes never arrives (ZMQ disconnects its sender, who is reconnected): a gap.
    """

    def __init__(
        self,
        worker_id: str,
        index: KvIndex,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        replay_timeout_s: float = 1.0,
        max_replay_batches: int = DEFAULT_MAX_REPLAY_BATCHES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if max_replay_batches < 0:
            raise ValueError("max_replay_batches must be >= 0")
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        self.worker_id = worker_id
        self.max_replay_batches = max_replay_batches
        self.max_message_bytes = max_message_bytes
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.counters = SubscriberCounters()
        self.last_seq: int | None = None
        self._index = index
        self._topic = topic
        self._replay_timeout_s = replay_timeout_s
        self._context = context or zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self._socket: zmq.asyncio.Socket | None = None

    def start(self) -> asyncio.Task[None]:
        """Connect and run in a task on the current event loop; the SUB is connected on return."""
        socket = self._socket_of(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        drops = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(self.endpoint)
        self._socket = socket
        self._task = asyncio.get_running_loop().create_task(self._run(socket, drops),
                                                            name=f"kv-events-{self.worker_id}")
        return self._task

    async def stop(self) -> None:
        await stop_tasks([self._task])
        self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    async def _run(self, socket: zmq.asyncio.Socket, drops: zmq.asyncio.Socket) -> None:
        """Receive and apply, while a second task reconnects the socket when its connection drops."""
        reconnecting = asyncio.get_running_loop().create_task(self._reconnect_when_dropped(socket, drops))
        try:
            await self._receive(socket)
        finally:
            await stop_tasks([reconnecting])
            socket.disable_monitor()
            drops.close()

    async def _reconnect_when_dropped(self, socket: zmq.asyncio.Socket, drops: zmq.asyncio.Socket) -> None:
        """libzmq reconnects after a network error but gives up on a connection it dropped for a
        protocol error, such as a message over max_message_bytes: connect again, at its pace.
        (What was missed meanwhile shows as a gap in seq.)"""
        while True:
            await drops.recv_multipart()  # one EVENT_DISCONNECTED
            self.counters.disconnects += 1
            await asyncio.sleep(_RECONNECT_DELAY_S)
            try:
                socket.disconnect(self.endpoint)
            except zmq.ZMQError:
                pass  # libzmq dropped the endpoint already
            socket.connect(self.endpoint)

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        # Messages are read with plain non-blocking receives on the socket without asyncio futures (at a
        # live engine's pace, one a millisecond, ~0.7x the CPU a message of an awaited receive each, libzmq's
        # thread included: bench_router's paced row), in runs of at most _DRAIN_BATCHES before the loop gets
        # a turn, so a burst cannot starve requests. With nothing queued, the loop waits on the
        # socket's file descriptor, which libzmq signals edge-triggered: ZMQ_EVENTS is read after the
        # wait is armed and before it is awaited, so a message that came meanwhile is not missed.
        queued = zmq.Socket.shadow(socket.underlying)
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()

        def readable() -> None:
            # reading ZMQ_EVENTS takes libzmq's signal: the descriptor is not readable again until news, so
            # the loop does not call this on every turn while the task is busy elsewhere (a replay)
            queued.getsockopt(zmq.EVENTS)
            signalled.set()

        fd = queued.getsockopt(zmq.FD)
        loop.add_reader(fd, readable)
        try:
            while True:
                signalled.clear()
                for _ in range(_DRAIN_BATCHES):
                    # ZMQ_EVENTS says whether a message is queued (its parts come together): a receive
                    # finding none would raise zmq.Again, an exception built in Python for every message
                    if not queued.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    await self._handle_safely(queued.recv_multipart(zmq.NOBLOCK))
                else:
                    await asyncio.sleep(0)  # a full run: the loop's turn, then on with what is queued
                    continue
                await signalled.wait()
        finally:
            loop.remove_reader(fd)

    async def _handle_safely(self, frames: list[bytes]) -> None:
        try:
            await self.handle(frames)
        except Exception:  # one bad message must not stop the stream
            self.counters.decode_errors += 1
            log.exception("worker %s: failed to apply KV events", self.worker_id)

    async def handle(self, frames: list[bytes]) -> None:
        """One published message (topic, seq, payload)."""
        if len(frames) != 3:
            self._decode_error(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
            return
        try:
            seq = decode_seq(frames[1])
        except KvEventDecodeError as exc:
            self._decode_error(str(exc))
            return
        last = self.last_seq
        if last is not None and seq <= last:
            self.counters.resets += 1
            log.info("worker %s: seq went back from %d to %d (restart); clearing", self.worker_id, last, seq)
            self._index.clear_worker(self.worker_id)
        elif last is not None and seq > last + 1:
            self.counters.gaps += 1
            await self._recover(last + 1, seq)
        self.last_seq = seq
        self._apply_payload(frames[2])

    def _apply_payload(self, payload: bytes) -> bool:
        try:
            batch = decode_batch(payload)
        except KvEventDecodeError as exc:
            self._decode_error(str(exc))
            return False
        self._apply(batch)
        return True

    def _apply(self, batch: KvEventBatch) -> None:
        self.counters.batches += 1
        self.counters.events_applied += self._index.apply(self.worker_id, batch.events)

    def _socket_of(self, kind: int) -> zmq.asyncio.Socket:
        """A socket that closes at once and refuses messages over max_message_bytes."""
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        return socket

    async def _recover(self, start_seq: int, next_seq: int) -> None:
        """Apply seqs [start_seq, next_seq) from the replay socket, else resync (clear the worker)."""
        num_missed = next_seq - start_seq
        if not self.replay_endpoint or num_missed > self.max_replay_batches:
            self._resync(start_seq, next_seq, "no replay socket" if not self.replay_endpoint
                         else f"more than max_replay_batches={self.max_replay_batches} missed")
            return
        if await self._replay(start_seq, next_seq):
            self.counters.replays += 1
            return
        self._resync(start_seq, next_seq, "replay failed or incomplete")

    def _resync(self, start_seq: int, next_seq: int, why: str) -> None:
        """Forget what the worker holds: the stream goes on from next_seq."""
        self.counters.replay_failures += 1
        log.warning("worker %s: cannot replay seqs %d..%d (%s); clearing its cache entries",
                    self.worker_id, start_seq, next_seq - 1, why)
        self._index.clear_worker(self.worker_id)

    async def _replay(self, start_seq: int, next_seq: int) -> bool:
        """Ask the ROUTER replay socket for the batches from start_seq and apply them in order as
        they arrive, up to next_seq; False on a missing seq, timeout or error (a resync follows,
        so batches applied before it do no harm)."""
        socket = self._socket_of(zmq.DEALER)
        wanted = start_seq
        try:
            socket.connect(self.replay_endpoint)
            await socket.send_multipart([b"", encode_seq(start_seq)])
            while wanted < next_seq:
                seq, payload = _replayed(await asyncio.wait_for(socket.recv_multipart(), self._replay_timeout_s))
                if seq == _END_SEQ or seq > wanted:
                    return False  # the replay ended early, or skips a seq the worker no longer buffers
                if seq == wanted:
                    wanted += 1
                    if self._apply_payload(payload):
                        self.counters.replayed_batches += 1
            return True
        except (asyncio.TimeoutError, zmq.ZMQError, KvEventDecodeError, IndexError) as exc:
            log.warning("worker %s: replay from seq %d failed: %r", self.worker_id, start_seq, exc)
            return False
        finally:
            socket.close()

    def _decode_error(self, message: str) -> None:
        self.counters.decode_errors += 1
        log.warning("worker %s: bad KV-event message: %s", self.worker_id, message)


def _replayed(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one replay reply: [b"", seq, payload] (or without the empty frame)."""
    if frames and frames[0] == b"" and len(frames) == 3:
        frames = frames[1:]
    return decode_seq(frames[0]), frames[1] if len(frames) > 1 else b""
