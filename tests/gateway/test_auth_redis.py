"""API keys kept in Redis (gateway/auth.py KeyStore) against a real redis-server that the tests stop,
hang and start: bounded caches, one lookup per key per TTL, bounded staleness and no per-request
wait while Redis is down, recovery without a restart; and a gateway process living through it."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import httpx
import pytest
import redis.asyncio

from gateway.auth import FOUND_TTL_S, NOT_FOUND_TTL_S, STALE_GRACE_S, KeyStore, KeysUnavailable, TtlLru
from kvgate.clock import ManualClock
from kvgate.config import AuthConfig
from kvgate.keys import REDIS_KEYS_HASH, hash_key
from tests.conftest import free_port
from tests.gateway.conftest import MODEL, gateway_config, start_gateway, worker_entry
from tests.gateway.test_trace_propagation import recording_worker
from tests.loadtest.fake_upstream import serve_in_thread
from tests.redis_server import RedisServer

KEY = "kvg-redis-held-key"
NO_CONFIG_KEYS = AuthConfig(keys=(), dev_key_env=None)


def run(server: RedisServer, scenario: Callable[[KeyStore, ManualClock], Awaitable[None]], **limits) -> None:
    """scenario(store, clock) on a KeyStore using server, with the gateway's Redis timeouts
    (gateway/core.py), a manual clock and a background PING every 0.05 s while Redis is down."""
    async def main() -> None:
        clock = ManualClock()
        client = redis.asyncio.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        store = KeyStore(NO_CONFIG_KEYS, {}, redis_client=client, clock=clock, retry_interval_s=0.05, **limits)
        try:
            await scenario(store, clock)
        finally:
            await store.aclose()
            await client.aclose()

    asyncio.run(main())


def hget_calls(server: RedisServer) -> int:
    return server.client().info("commandstats").get("cmdstat_hget", {}).get("calls", 0)


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def test_a_full_cache_drops_its_least_recently_used_entry():
    cache: TtlLru[str] = TtlLru(max_entries=3)
    for name in "abc":
        cache.put(name, name.upper(), expires_s=10.0)
    assert cache.get("a") == ("A", 10.0)  # a is now the most recently used
    for i in range(10_000):
        cache.put(f"k{i}", "x", expires_s=10.0)
    assert len(cache) == 3 and cache.get("a") is None
    cache.put("z", "Z", expires_s=1.0)
    assert cache.get("z") == ("Z", 1.0)  # expired or not, get() says when: the caller judges staleness


def test_random_unknown_keys_leave_the_caches_at_their_bound(redis_server):
    async def scenario(store: KeyStore, clock: ManualClock) -> None:
        for _ in range(2_000):
            assert await store.tenant_for("kvg-" + secrets.token_urlsafe(32)) is None
        assert len(store.not_found) == 64 and len(store.found) == 0

    run(redis_server, scenario, max_not_found_entries=64)


def test_a_repeated_unknown_key_is_looked_up_once_per_ttl(redis_server):
    async def scenario(store: KeyStore, clock: ManualClock) -> None:
        before = hget_calls(redis_server)
        for _ in range(50):
            assert await store.tenant_for("kvg-wrong") is None
        assert hget_calls(redis_server) == before + 1
        at_once = await asyncio.gather(*(store.tenant_for("kvg-also-wrong") for _ in range(20)))
        assert at_once == [None] * 20 and hget_calls(redis_server) == before + 2  # one lookup shared
        clock.advance(NOT_FOUND_TTL_S)
        assert await store.tenant_for("kvg-wrong") is None
        assert hget_calls(redis_server) == before + 3

    run(redis_server, scenario)


def test_a_key_revoked_in_redis_stops_working_after_the_ttl(redis_server):
    redis_server.client().hset(REDIS_KEYS_HASH, hash_key(KEY), "team-r")

    async def scenario(store: KeyStore, clock: ManualClock) -> None:
        assert await store.tenant_for(KEY) == "team-r"
        redis_server.client().hdel(REDIS_KEYS_HASH, hash_key(KEY))
        assert await store.tenant_for(KEY) == "team-r"  # cached
        clock.advance(FOUND_TTL_S)
        assert await store.tenant_for(KEY) is None

    run(redis_server, scenario)


def test_redis_down_a_cached_key_is_served_for_the_grace_period_then_refused(redis_server):
    redis_server.client().hset(REDIS_KEYS_HASH, hash_key(KEY), "team-r")

    async def scenario(store: KeyStore, clock: ManualClock) -> None:
        assert await store.tenant_for(KEY) == "team-r"
        redis_server.stop()
        clock.advance(FOUND_TTL_S + 1)
        assert await store.tenant_for(KEY) == "team-r"  # past its TTL, within the grace period
        assert store.redis_down
        with pytest.raises(KeysUnavailable):
            await store.tenant_for("kvg-never-seen")  # only Redis could vouch for it
        clock.advance(STALE_GRACE_S)
        with pytest.raises(KeysUnavailable):
            await store.tenant_for(KEY)  # a key revoked meanwhile would stop working here at the latest

    run(redis_server, scenario)


def test_a_hung_redis_costs_one_timeout_not_one_per_request(redis_server):
    redis_server.client().hset(REDIS_KEYS_HASH, hash_key(KEY), "team-r")

    async def scenario(store: KeyStore, clock: ManualClock) -> None:
        assert await store.tenant_for(KEY) == "team-r"
        redis_server.hang()
        clock.advance(FOUND_TTL_S)
        assert await store.tenant_for(KEY) == "team-r"  # waited out the 0.5 s socket timeout once
        started = time.monotonic()
        for i in range(20):
            assert await store.tenant_for(KEY) == "team-r"
            with pytest.raises(KeysUnavailable):
                await store.tenant_for(f"kvg-unknown-{i}")
        assert time.monotonic() - started < 0.25  # 40 lookups, none waiting on Redis
        redis_server.resume()

    run(redis_server, scenario)


def test_keys_are_looked_up_in_redis_again_once_it_is_back_without_a_restart(redis_server):
    async def scenario(store: KeyStore, clock: ManualClock) -> None:
        redis_server.stop()
        with pytest.raises(KeysUnavailable):
            await store.tenant_for(KEY)
        redis_server.start()  # empty: nothing is persisted
        redis_server.client().hset(REDIS_KEYS_HASH, hash_key(KEY), "team-r")
        await wait_until(lambda: not store.redis_down)
        assert await store.tenant_for(KEY) == "team-r"

    run(redis_server, scenario)


def completions(gateway_url: str, key: str) -> httpx.Response:
    return httpx.post(f"{gateway_url}/v1/completions", headers={"x-api-key": key}, timeout=30,
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 1})


def wait_for_ready(gateway_url: str, degraded: bool, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{gateway_url}/ready", timeout=5).json()
        if ("degraded" in body) == degraded:
            return body
        assert time.monotonic() < deadline, f"/ready still says {body}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_gateway_serves_through_a_redis_outage_says_so_in_ready_and_recovers(redis_server, tmp_path):
    redis_server.client().hset(REDIS_KEYS_HASH, hash_key(KEY), "team-r")
    with ExitStack() as stack:
        worker_url = stack.enter_context(serve_in_thread(recording_worker([]), free_port()))
        config = gateway_config([worker_entry("w0", worker_url)], None, redis={"url": redis_server.url})
        gateway = start_gateway(stack, config, tmp_path)
        assert completions(gateway.url, KEY).status_code == 200
        assert completions(gateway.url, "kvg-wrong").status_code == 401

        redis_server.stop()
        assert completions(gateway.url, KEY).status_code == 200  # cached: served on
        unknown = completions(gateway.url, "kvg-unknown-while-down")
        assert unknown.status_code == 503, unknown.text
        assert unknown.json()["error"]["code"] == "auth_unavailable" and unknown.headers["retry-after"]
        ready = wait_for_ready(gateway.url, degraded=True)
        assert ready["status"] == "ready" and any("redis unreachable" in d for d in ready["degraded"])

        redis_server.start()
        redis_server.client().hset(REDIS_KEYS_HASH, hash_key("kvg-new-key"), "team-n")
        wait_for_ready(gateway.url, degraded=False)
        assert completions(gateway.url, "kvg-new-key").status_code == 200
