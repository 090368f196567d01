"""The worker registry (kvgate/registry.py) against a real Redis: a heartbeat announces a worker only
while its /health answers, with a TTL; a clean stop withdraws it; a lapsed record leaves the list;
Redis failures never reach the worker; the address a worker advertises."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import pytest
import redis.asyncio

from kvgate.registry import WORKERS_SET, Heartbeat, WorkerRecord, advertised_urls, read_registry, record_key
from tests.processes import fake_worker_process, running


def registry(url: str) -> dict[str, WorkerRecord]:
    async def read():
        client = redis.asyncio.Redis.from_url(url)
        try:
            return await read_registry(client)
        finally:
            await client.aclose()

    return asyncio.run(read())


@pytest.mark.slow
def test_a_healthy_worker_is_announced_with_a_ttl_and_withdrawn_when_it_stops(redis_server):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        beat = Heartbeat(redis_server.url, "w-1", "default", worker.url + "/", model="tiny",
                         kv_events_endpoint="tcp://10.0.0.7:5557", ttl_s=3.0, interval_s=0.5)
        assert beat.beat()
        assert registry(redis_server.url) == {
            "w-1": WorkerRecord("w-1", "default", worker.url, "tiny", "tcp://10.0.0.7:5557")}
        ttl_ms = redis_server.client().pttl(record_key("w-1"))
        assert 2000 < ttl_ms <= 3000
        beat.start()
        beat.stop()
        assert registry(redis_server.url) == {}
        assert redis_server.client().smembers(WORKERS_SET) == set()


def test_a_worker_whose_health_fails_is_not_announced(redis_server):
    beat = Heartbeat(redis_server.url, "w-2", "default", "http://127.0.0.1:9", model="tiny", ttl_s=3.0,
                     interval_s=1.0)
    assert not beat.beat()
    assert registry(redis_server.url) == {}


@pytest.mark.slow
def test_a_record_that_lapses_leaves_the_list(redis_server):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        beat = Heartbeat(redis_server.url, "w-3", "default", worker.url, model="tiny", ttl_s=0.3, interval_s=0.1)
        assert beat.beat()
        time.sleep(0.4)
        assert registry(redis_server.url) == {}
        assert redis_server.client().smembers(WORKERS_SET) == set()  # the reader removed the lapsed name


@pytest.mark.slow
def test_redis_down_never_reaches_the_worker_and_the_next_beat_after_it_returns_announces(redis_server):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        beat = Heartbeat(redis_server.url, "w-4", "default", worker.url, model="tiny", ttl_s=3.0, interval_s=0.5)
        redis_server.stop()
        assert not beat.beat()
        redis_server.start()
        assert beat.beat()
        assert "w-4" in registry(redis_server.url)


def test_a_malformed_record_is_skipped(redis_server):
    client = redis_server.client()
    client.sadd(WORKERS_SET, "odd")
    client.set(record_key("odd"), b"{not json")
    assert registry(redis_server.url) == {}


def test_the_interval_must_be_below_the_ttl(redis_server):
    with pytest.raises(ValueError, match="below the TTL"):
        Heartbeat(redis_server.url, "w", "default", "http://127.0.0.1:1", ttl_s=2.0, interval_s=2.0)


@pytest.mark.parametrize("host, kv, advertise, expected", [
    ("127.0.0.1", None, None, ("http://127.0.0.1:8001", None)),
    ("0.0.0.0", "tcp://0.0.0.0:5557", "10.1.2.3", ("http://10.1.2.3:8001", "tcp://10.1.2.3:5557")),
    ("127.0.0.1", "5557", None, ("http://127.0.0.1:8001", "tcp://127.0.0.1:5557")),
    ("0.0.0.0", "tcp://10.9.9.9:5557", "10.1.2.3", ("http://10.1.2.3:8001", "tcp://10.1.2.3:5557")),
    ("::", "tcp://*:5557", "fd00::7", ("http://[fd00::7]:8001", "tcp://[fd00::7]:5557")),
    ("127.0.0.1", "ipc:///tmp/kv", None, ("http://127.0.0.1:8001", "ipc:///tmp/kv")),
])
def test_the_advertised_address_is_the_one_gateways_can_reach(host, kv, advertise, expected):
    assert advertised_urls(host, 8001, kv, advertise) == expected


def test_a_wildcard_listen_address_without_an_advertised_host_names_this_machine():
    import socket

    url, kv = advertised_urls("0.0.0.0", 8001, "tcp://0.0.0.0:5557", None)
    assert url == f"http://{socket.getfqdn()}:8001" and kv == f"tcp://{socket.getfqdn()}:5557"
