"""Token buckets shared by gateway replicas: RedisBuckets (one atomic Lua script per call) and
SharedBuckets, which falls back to local buckets, each replica's share, while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis
import redis.asyncio

from admission.token_bucket import BucketSpec, LocalBuckets, Taken
from kvgate.tasks import stop_tasks

# LocalBuckets' take/adjust on a hash {tokens, updated_us}. KEYS[1]: the bucket.
# ARGV: rate_per_s, burst, amount, op ("take" or "adjust"). Returns the wait in seconds and the tokens
# left, as strings (Redis would truncate a Lua number to an integer).
_BUCKET_LUA = """
local rate_per_s = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local function num(x) return string.format('%.17g', x) end

-- Now by the Redis server's clock, so every replica measures refill on the same clock.
local server_time = redis.call('TIME')
local now_us = tonumber(server_time[1]) * 1000000 + tonumber(server_time[2])

-- Load the bucket; a missing key is a full bucket (never used, or expired once full).
local saved = redis.call('HMGET', KEYS[1], 'tokens', 'updated_us')
local tokens, updated_us = tonumber(saved[1]), tonumber(saved[2])
if tokens == nil or updated_us == nil then
  tokens, updated_us = burst, now_us
elseif now_us > updated_us then
  -- Refill for the time since the last call, never past the burst.
  tokens = math.min(burst, tokens + (now_us - updated_us) / 1e6 * rate_per_s)
  updated_us = now_us
end

local wait_s = 0
if ARGV[4] == 'take' then
  -- Grant when the tokens are there, or when the bucket is full (an oversized request leaves debt);
  -- else take nothing and say how long until it would be granted.
  if tokens >= amount or tokens >= burst then
    tokens = tokens - amount
  else
    wait_s = (math.min(amount, burst) - tokens) / rate_per_s
  end
else
  -- Adjust: take (> 0) or give back (< 0) without a check, never past the burst.
  tokens = math.min(burst, tokens - amount)
end

-- Save, and let the key expire when the bucket would be full again (a missing key reads as full).
redis.call('HSET', KEYS[1], 'tokens', num(tokens), 'updated_us', num(updated_us))
redis.call('PEXPIRE', KEYS[1], num(math.max(1, math.ceil((burst - tokens) / rate_per_s * 1000))))
return {num(wait_s), num(tokens)}
"""

# What a dead, unreachable or hung Redis raises (TimeoutError is an OSError).
REDIS_ERRORS = (redis.RedisError, OSError)


async def wait_until_redis_answers(client, interval_s: float) -> None:
    """PING every interval_s until Redis answers (the recovery probe of a replica serving on local state)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await client.ping()
        except REDIS_ERRORS:
            continue
        return


class RedisBuckets:
    """LocalBuckets' semantics in Redis: every replica sees one bucket per key; errors reach the caller."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = "kvgate:bucket:") -> None:
        self._client = client
        self._prefix = prefix
        self._script = client.register_script(_BUCKET_LUA)  # EVALSHA; loads the script on NOSCRIPT

    async def take(self, key: str, spec: BucketSpec, amount: float) -> Taken:
        return await self._run(key, spec, amount, "take")

    async def adjust(self, key: str, spec: BucketSpec, amount: float) -> None:
        await self._run(key, spec, amount, "adjust")

    async def ping(self) -> None:
        await self._client.ping()

    async def _run(self, key: str, spec: BucketSpec, amount: float, op: str) -> Taken:
        wait_s, left = await self._script(keys=[self._prefix + key], args=[spec.rate_per_s, spec.burst, amount, op])
        return Taken(float(wait_s), float(left))


class SharedBuckets:
    """RedisBuckets while Redis answers; on a Redis error, local buckets with each spec scaled by
    1/replicas, and no Redis call on the request path until a background PING (every
    retry_interval_s) answers. Each outage starts fresh local buckets (full: one replica's share)
    and drops them on recovery; what was taken locally is not written back to Redis."""

    def __init__(
        self,
        redis_buckets: RedisBuckets,
        replicas: int,
        clock: Callable[[], float] = time.monotonic,
        retry_interval_s: float = 1.0,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self._redis = redis_buckets
        self._share = 1.0 / replicas
        self._clock = clock
        self._retry_interval_s = retry_interval_s
        self._on_change = on_change
        self._local: LocalBuckets | None = None  # this outage's buckets; None while Redis answers
        self._probe: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        """"redis" while the limits are shared, "local" while this replica limits on its own."""
        return "redis" if self._local is None else "local"

    async def take(self, key: str, spec: BucketSpec, amount: float) -> Taken:
        local = self._local
        if local is None:
            try:
                return await self._redis.take(key, spec, amount)
            except REDIS_ERRORS:
                local = self._go_local()
        return local.taken_now(key, spec.scaled(self._share), amount)

    async def adjust(self, key: str, spec: BucketSpec, amount: float) -> None:
        local = self._local
        if local is None:
            try:
                await self._redis.adjust(key, spec, amount)
                return
            except REDIS_ERRORS:
                local = self._go_local()
        local.adjust_now(key, spec.scaled(self._share), amount)

    async def aclose(self) -> None:
        """Stop the probe (at shutdown); the Redis client is its owner's to close."""
        await stop_tasks([self._probe])
        self._probe = None

    def _go_local(self) -> LocalBuckets:
        if self._local is None:
            self._local = LocalBuckets(self._clock)
            self._notify("local")
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_redis_answers(), name="redis-buckets-probe")
        return self._local

    async def _probe_until_redis_answers(self) -> None:
        await wait_until_redis_answers(self._redis, self._retry_interval_s)
        self._local = None
        self._notify("redis")

    def _notify(self, state: str) -> None:
        if self._on_change is not None:
            self._on_change(state)
