"""KV-event subscriber for one worker: ZMQ SUB on the event loop, sequence tracking, gap replay."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from router.kv_events import KvEventBatch, KvEventDecodeError, decode_batch, decode_seq, encode_seq
from router.kv_index import KvIndex

log = logging.getLogger(__name__)

_END_SEQ = -1
_DRAIN_BATCHES = 32  # messages read in one turn of the event loop, at most (a few ms of work)


@dataclass(slots=True)
class SubscriberCounters:
    """Monotonic counters for one worker's stream, exported as metrics by the gateway."""

    batches: int = 0
    events_applied: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    resets: int = 0
    decode_errors: int = 0


class KvEventSubscriber:
    """Applies one worker's KV events to the index, in order.

    A gap in seq asks the replay socket (DEALER -> ROUTER: [b"", start seq]; replies
    [b"", seq, payload] until seq -1) for the missed batches; if replay is impossible or
    incomplete the worker's confirmed entries are cleared. A seq at or below the last one means
    the worker restarted: its entries are cleared before the batch is applied.
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
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.worker_id = worker_id
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
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        socket.connect(self.endpoint)
        self._socket = socket
        self._task = asyncio.get_running_loop().create_task(self._run(socket), name=f"kv-events-{self.worker_id}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    async def _run(self, socket: zmq.asyncio.Socket) -> None:
        # The same socket without asyncio futures: messages that are already queued are read with
        # plain non-blocking receives (an awaited receive costs ~30 µs a message, this ~3), in runs
        # of at most _DRAIN_BATCHES before the loop gets a turn, so a burst cannot starve requests.
        queued = zmq.Socket.shadow(socket.underlying)
        while True:
            await self._handle_safely(await socket.recv_multipart())
            for _ in range(_DRAIN_BATCHES):
                try:
                    frames = queued.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._handle_safely(frames)
            await asyncio.sleep(0)

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

    async def _recover(self, start_seq: int, next_seq: int) -> None:
        """Fill seqs [start_seq, next_seq) from the replay socket, else clear the worker."""
        missed = await self._replay(start_seq) if self.replay_endpoint else None
        wanted = [(s, p) for s, p in (missed or ()) if start_seq <= s < next_seq]
        if [s for s, _ in wanted] != list(range(start_seq, next_seq)):
            self.counters.replay_failures += 1
            log.warning(
                "worker %s: cannot replay seqs %d..%d; clearing its cache entries", self.worker_id, start_seq, next_seq - 1
            )
            self._index.clear_worker(self.worker_id)
            return
        self.counters.replays += 1
        for _, payload in wanted:
            if self._apply_payload(payload):
                self.counters.replayed_batches += 1

    async def _replay(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        """Ask the ROUTER replay socket for batches from start_seq; None on timeout or error."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        batches: list[tuple[int, bytes]] = []
        try:
            socket.connect(self.replay_endpoint)
            await socket.send_multipart([b"", encode_seq(start_seq)])
            while True:
                frames = await asyncio.wait_for(socket.recv_multipart(), self._replay_timeout_s)
                if frames and frames[0] == b"" and len(frames) == 3:
                    frames = frames[1:]
                seq = decode_seq(frames[0])
                if seq == _END_SEQ:
                    return batches
                batches.append((seq, frames[1]))
        except (asyncio.TimeoutError, zmq.ZMQError, KvEventDecodeError, IndexError) as exc:
            log.warning("worker %s: replay from seq %d failed: %r", self.worker_id, start_seq, exc)
            return None
        finally:
            socket.close()

    def _decode_error(self, message: str) -> None:
        self.counters.decode_errors += 1
        log.warning("worker %s: bad KV-event message: %s", self.worker_id, message)
