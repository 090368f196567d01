"""What gateway replicas tell each other through Redis: routing decisions, load and breaker changes.

Every replica publishes on one pub/sub channel, `kvgate:peers`, and subscribes to it:
- a dispatch record for every routing decision (worker, the prompt's block keys there): the others
  count that prefix as predicted on that worker and remember it as the prefix's home, exactly as
  for a decision of their own (Router.peer_routed), so a tenant's requests spread over replicas by
  a load balancer still meet on one worker's cache. Each replica still learns the confirmed cache
  from the workers' KV events itself;
- its own load, every LOAD_INTERVAL_S while it changes (and at least every LOAD_REFRESH_S while
  it is not nothing): per worker, its requests in flight, their uncached prefill tokens queued and
  decodes running. The others add it to each worker's load (Router.peer_load), so N replicas weigh
  cache against queues as one gateway would, and drop it after LOAD_EXPIRY_S of silence;
- a breaker change (a worker's breaker opened or closed here): the others open or close theirs,
  so a worker one replica ejects is avoided by all within milliseconds. An open breaker is also
  written as a key that expires after the breaker's reset timeout, which a replica starting later
  reads for the workers it knows.

A replica starts listening before it serves: start() waits (at most FIRST_SUBSCRIBE_WAIT_S) for its
subscription, so the decisions its peers make from its first request on reach it; until the
subscription stands, `state` is "local".

Nothing on a request's path waits on Redis: a decision appends to a list that a background task
publishes every PUBLISH_INTERVAL_S (one message per batch). While Redis is unreachable, records
are dropped (counted), each replica routes on what it knows itself, and both tasks retry every
RETRY_INTERVAL_S; `state` says which, for /ready and the metrics.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping

import msgpack

from admission.redis_buckets import REDIS_ERRORS, wait_until_redis_answers
from kvgate.tasks import stop_tasks

log = logging.getLogger("kvgate.gateway")

CHANNEL = "kvgate:peers"
BREAKER_KEY_PREFIX = "kvgate:breaker:"
PUBLISH_INTERVAL_S = 0.002
LOAD_INTERVAL_S = 0.05
LOAD_REFRESH_S = 0.5
LOAD_EXPIRY_S = 1.5
STOP_WAIT_S = 1.0
FIRST_SUBSCRIBE_WAIT_S = 2.0
RETRY_INTERVAL_S = 1.0
MAX_PENDING = 10_000  # records held for one publish; beyond it (Redis slow) the oldest go
_DISPATCH, _BREAKER, _LOAD = 0, 1, 2
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_keys(keys: Iterable[int]) -> bytes:
    packed = array.array("Q", keys)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _unpack_keys(raw: bytes) -> tuple[int, ...]:
    keys = array.array("Q")
    keys.frombytes(raw)
    if not _LITTLE_ENDIAN:
        keys.byteswap()
    return tuple(keys)


class PeerLink:
    """One replica's side of the channel. routed() and breaker_changed() are called on the event
    loop and never wait; on_routed and on_breaker receive what the other replicas said."""

    def __init__(self, redis_url: str, publish_client, *,
                 on_routed: Callable[[str, tuple[int, ...], float | None], None],
                 on_breaker: Callable[[str, str], None], breaker_reset_s: float,
                 own_load: Callable[[], Mapping[str, tuple[int, int, int]]],
                 on_load: Callable[[str, Mapping[str, tuple[int, int, int]]], None],
                 expire_loads: Callable[[float], None]) -> None:
        self.replica_id = os.urandom(6).hex()
        self._url = redis_url
        self._client = publish_client  # the gateway's pooled client (short timeouts)
        self._on_routed = on_routed
        self._on_breaker = on_breaker
        self._breaker_reset_ms = max(1, int(breaker_reset_s * 1000))
        self._own_load, self._on_load, self._expire_loads = own_load, on_load, expire_loads
        self._pending: list[list] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._down: set[str] = set()  # "publish" and/or "subscribe" while they fail
        self.records_dropped = 0
        self.records_received = 0
        self._subscriber = None  # the subscribe loop's own client while it has one
        self._subscribed = asyncio.Event()  # set once the subscription first stands
        self._first_subscribe_tried = asyncio.Event()  # it stood, or its first attempt failed
        self._closing = False

    @property
    def state(self) -> str:
        """"redis" while records flow both ways, "local" while Redis fails for either (or before
        the subscription first stands)."""
        return "local" if self._down or not self._subscribed.is_set() else "redis"

    async def start(self, known_workers: Iterable[str]) -> None:
        """Read the breakers other replicas hold open, then publish and listen in the background;
        return once subscribed (or once the first attempt failed, or after FIRST_SUBSCRIBE_WAIT_S)."""
        await self._read_open_breakers(known_workers)
        self._tasks = [asyncio.create_task(self._publish_loop(), name="peers-publish"),
                       asyncio.create_task(self._subscribe_loop(), name="peers-subscribe"),
                       asyncio.create_task(self._load_loop(), name="peers-load")]
        try:
            await asyncio.wait_for(self._first_subscribe_tried.wait(), FIRST_SUBSCRIBE_WAIT_S)
        except TimeoutError:
            pass
        if not self._subscribed.is_set():
            log.warning("not subscribed to %s yet: routing on this replica's own decisions until Redis answers",
                        CHANNEL)

    async def aclose(self) -> None:
        """Stop the tasks, never waiting long: a read still blocked on the subscriber's socket after
        STOP_WAIT_S of cancels has its connection closed under it."""
        self._closing = True
        pending = await stop_tasks(self._tasks, timeout_s=STOP_WAIT_S)
        if pending and self._subscriber is not None:
            await asyncio.wait([asyncio.ensure_future(self._subscriber.aclose())], timeout=STOP_WAIT_S)
            pending = await stop_tasks(pending, timeout_s=STOP_WAIT_S)
        if pending:
            log.warning("peer link: %s did not stop", ", ".join(t.get_name() for t in pending))
        self._tasks = []

    # -- what this replica says -----------------------------------------------------------------

    def routed(self, worker_id: str, keys: tuple[int, ...], ttl_s: float | None) -> None:
        self._enqueue([_DISPATCH, worker_id, _pack_keys(keys), ttl_s])

    def breaker_changed(self, worker_id: str, state: str) -> None:
        self._enqueue([_BREAKER, worker_id, state])

    async def _load_loop(self) -> None:
        """Report this replica's own load while it changes, refresh a standing one, expire silent peers'."""
        loop = asyncio.get_running_loop()
        last: dict = {}
        sent_at = 0.0
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            self._expire_loads(LOAD_EXPIRY_S)
            report = {worker: counts for worker, counts in self._own_load().items() if any(counts)}
            now = loop.time()
            if report != last or (report and now - sent_at >= LOAD_REFRESH_S):
                self._enqueue([_LOAD, "", report])
                last, sent_at = report, now

    def _enqueue(self, record: list) -> None:
        pending = self._pending
        if len(pending) >= MAX_PENDING:
            del pending[: len(pending) - MAX_PENDING + 1]
            self.records_dropped += 1
        pending.append(record)
        self._wake.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(PUBLISH_INTERVAL_S)  # gather what the next decisions add
            self._wake.clear()
            batch, self._pending = self._pending, []
            try:
                await self._publish(batch)
            except REDIS_ERRORS as exc:
                self._set_down("publish", exc)
                await wait_until_redis_answers(self._client, RETRY_INTERVAL_S)
                # what was decided meanwhile is stale by now: the others have routed on their own
                self.records_dropped += len(batch) + len(self._pending)
                self._pending = []
                self._set_up("publish")

    async def _publish(self, batch: list[list]) -> None:
        message = msgpack.packb([self.replica_id, batch], use_bin_type=True)
        opened = [record[1] for record in batch if record[0] == _BREAKER and record[2] == "open"]
        closed = [record[1] for record in batch if record[0] == _BREAKER and record[2] == "closed"]
        if not opened and not closed:
            await self._client.publish(CHANNEL, message)
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in opened:
                pipe.set(BREAKER_KEY_PREFIX + worker_id, "open", px=self._breaker_reset_ms)
            for worker_id in closed:
                pipe.delete(BREAKER_KEY_PREFIX + worker_id)
            pipe.publish(CHANNEL, message)
            await pipe.execute()

    # -- what the others say --------------------------------------------------------------------

    async def _subscribe_loop(self) -> None:
        import redis.asyncio

        while not self._closing:
            # its own connection, without the request path's read timeout: a quiet channel is not an error
            client = self._subscriber = redis.asyncio.Redis.from_url(self._url, socket_connect_timeout=0.5,
                                                                     health_check_interval=5)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is None:
                            continue
                        if message["type"] == "message":
                            self._apply(message["data"])
                        elif message["type"] == "subscribe":  # Redis confirmed: what is published now reaches us
                            self._set_up("subscribe")
                            self._subscribed.set()
                            self._first_subscribe_tried.set()
            except REDIS_ERRORS as exc:
                self._set_down("subscribe", exc)
                self._first_subscribe_tried.set()
            finally:
                self._subscriber = None
                await client.aclose()
            if not self._closing:
                await asyncio.sleep(RETRY_INTERVAL_S)

    def _apply(self, data: bytes) -> None:
        try:
            sender, batch = msgpack.unpackb(data, raw=False)
            if sender == self.replica_id:
                return
            for kind, worker_id, value, *rest in batch:
                self.records_received += 1
                if kind == _DISPATCH:
                    self._on_routed(worker_id, _unpack_keys(value), *rest[:1])
                elif kind == _BREAKER:
                    self._on_breaker(worker_id, value)
                elif kind == _LOAD:
                    self._on_load(sender, {w: tuple(counts) for w, counts in value.items()})
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            log.warning("ignored a malformed message on %s: %s", CHANNEL, exc)

    async def _read_open_breakers(self, workers: Iterable[str]) -> None:
        names = list(workers)
        if not names:
            return
        try:
            values = await self._client.mget([BREAKER_KEY_PREFIX + name for name in names])
        except REDIS_ERRORS as exc:
            self._set_down("publish", exc)
            return
        for name, value in zip(names, values):
            if value is not None:
                log.info("worker %s: another replica holds its breaker open", name)
                self._on_breaker(name, "open")

    def _set_down(self, part: str, exc: BaseException) -> None:
        if part not in self._down:
            was = self.state
            self._down.add(part)
            if was != self.state:
                log.warning("Redis unreachable (%s): routing decisions, load and breaker changes are not shared "
                            "with other replicas until it answers", exc)

    def _set_up(self, part: str) -> None:
        if part in self._down:
            self._down.discard(part)
            if not self._down:
                log.info("routing decisions, load and breaker changes are shared with other replicas again")
