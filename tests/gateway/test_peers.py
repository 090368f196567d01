"""PeerLink (gateway/peers.py) on a real Redis: what one replica says reaches the others in
milliseconds and never itself; an open breaker is there for a replica that starts later; with Redis
gone the link says so and comes back on its own."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio

from gateway.peers import PeerLink
from loadtest.procs import free_port


class Heard:
    """One replica's side: what it reports as its own load, and what it heard from the others."""

    def __init__(self) -> None:
        self.routed: list[tuple[str, tuple[int, ...], float | None]] = []
        self.breakers: list[tuple[str, str]] = []
        self.own: dict[str, tuple[int, int, int]] = {}
        self.loads: dict[str, dict] = {}  # sender -> its last report
        self.expiries: list[float] = []

    def link(self, url: str, client) -> PeerLink:
        return PeerLink(url, client, on_routed=lambda w, keys, ttl_s: self.routed.append((w, keys, ttl_s)),
                        on_breaker=lambda w, state: self.breakers.append((w, state)), breaker_reset_s=30.0,
                        own_load=lambda: self.own, on_load=self.loads.__setitem__,
                        expire_loads=self.expiries.append)


async def until(condition, timeout_s: float = 2.0) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s
        await asyncio.sleep(0.005)
    return time.monotonic() - started


def test_decisions_and_breaker_changes_reach_the_other_replicas_and_not_the_sender(redis_server):
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=0.5)
        heard = [Heard() for _ in range(3)]
        links = [h.link(redis_server.url, client) for h in heard]
        for link in links:
            assert link.state == "local"  # not listening yet
            await link.start([])
            assert link.state == "redis"  # start() returns subscribed: what is said from now on is heard
        keys = (2**64 - 1, 0, 12345678901234567890)
        links[0].routed("w1", keys, 10.0)
        links[0].breaker_changed("w2", "open")
        took = await until(lambda: all(h.routed and h.breakers for h in heard[1:]))
        assert took < 0.5
        assert all(h.routed == [("w1", keys, 10.0)] and h.breakers == [("w2", "open")] for h in heard[1:])
        assert heard[0].routed == [] and heard[0].breakers == []
        # a replica that starts later finds the breaker open
        late = Heard()
        late_link = late.link(redis_server.url, client)
        await late_link.start(["w1", "w2"])
        assert late.breakers == [("w2", "open")]
        links[0].breaker_changed("w2", "closed")
        await until(lambda: heard[1].breakers[-1] == ("w2", "closed"))
        assert await client.get("kvgate:breaker:w2") is None
        for link in (*links, late_link):
            await link.aclose()
        await client.aclose()

    asyncio.run(scenario())


def test_without_redis_records_are_dropped_and_the_link_recovers_when_redis_returns(redis_server):
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        sender, receiver = Heard(), Heard()
        a, b = sender.link(redis_server.url, client), receiver.link(redis_server.url, client)
        await a.start([])
        await b.start([])
        await until(lambda: a.state == b.state == "redis")
        redis_server.stop()
        a.routed("w1", (1, 2, 3), None)  # never waits: only the background publish fails
        await until(lambda: a.state == "local" and b.state == "local", timeout_s=5)
        redis_server.start()
        await until(lambda: a.state == b.state == "redis", timeout_s=5)
        assert a.records_dropped == 1  # decided while Redis was gone: stale once it is back
        a.routed("w1", (4, 5), None)
        await until(lambda: receiver.routed == [("w1", (4, 5), None)])
        await a.aclose()
        await b.aclose()
        await client.aclose()

    asyncio.run(scenario())


def test_each_replica_reports_its_own_load_while_it_changes_and_the_others_hear_it(redis_server):
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=0.5)
        sender, receiver = Heard(), Heard()
        a, b = sender.link(redis_server.url, client), receiver.link(redis_server.url, client)
        await a.start([])
        await b.start([])
        sender.own = {"w1": (2, 300, 1), "w2": (0, 0, 0)}  # an idle worker is not reported
        await until(lambda: receiver.loads.get(a.replica_id) == {"w1": (2, 300, 1)})
        sender.own = {"w1": (0, 0, 0), "w2": (0, 0, 0)}  # all done: an empty report takes it back
        await until(lambda: receiver.loads.get(a.replica_id) == {})
        assert a.replica_id not in sender.loads  # never told to itself
        assert receiver.expiries and set(receiver.expiries) == {1.5}  # silent peers are expired meanwhile
        await a.aclose()
        await b.aclose()
        await client.aclose()

    asyncio.run(scenario())


def test_a_replica_without_redis_starts_at_once_on_its_own_decisions():
    async def scenario():
        url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
        client = redis.asyncio.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        link = Heard().link(url, client)
        started = time.monotonic()
        await link.start(["w1"])
        assert time.monotonic() - started < 1.5  # the first failed attempt ends the wait
        assert link.state == "local"
        await link.aclose()
        await client.aclose()

    asyncio.run(scenario())
