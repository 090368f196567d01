"""One pool's retry budget shared by gateway replicas through Redis: RedisRetryCounts (the fleet's
per-second counts, one Lua script per sync) and SharedRetryBudget, which decides on the request path
from the last sync and falls back to this replica's share of the budget while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio

from admission.redis_buckets import REDIS_ERRORS, wait_until_redis_answers
from admission.retry_budget import RetryBudget, RetryBudgetConfig
from kvgate.tasks import stop_tasks

# KEYS[1]: the pool's key prefix (with a {hash tag}, so all its seconds share one cluster slot); each
# second is a hash {requests, retries} under it. ARGV: requests and retries to add, window_s.
# Adds to the current second and returns the window's sums {requests, retries}.
_SYNC_LUA = """
local add_requests, add_retries, window_s = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])

-- The second by the Redis server's clock, so every replica counts in the same seconds.
local now_s = tonumber(redis.call('TIME')[1])
local current = KEYS[1] .. now_s
if add_requests > 0 then redis.call('HINCRBY', current, 'requests', add_requests) end
if add_retries > 0 then redis.call('HINCRBY', current, 'retries', add_retries) end
if add_requests > 0 or add_retries > 0 then
  -- Kept just past the last window that holds it (a missing second reads as zeros).
  redis.call('EXPIRE', current, window_s + 1)
end

local requests, retries = 0, 0
for second = now_s - window_s + 1, now_s do
  local counts = redis.call('HMGET', KEYS[1] .. second, 'requests', 'retries')
  requests = requests + (tonumber(counts[1]) or 0)
  retries = retries + (tonumber(counts[2]) or 0)
end
return {requests, retries}
"""


class RedisRetryCounts:
    """A pool's requests and retries per second in Redis, summed over the window; errors reach the caller."""

    def __init__(self, client: redis.asyncio.Redis, pool: str, window_s: int,
                 prefix: str = "kvgate:retry_budget:") -> None:
        self._client = client
        self._key_prefix = f"{prefix}{{{pool}}}:"
        self._window_s = window_s
        self._script = client.register_script(_SYNC_LUA)  # EVALSHA; loads the script on NOSCRIPT

    async def add_and_sum(self, requests: int, retries: int) -> tuple[int, int]:
        """Add this replica's counts to the current second; the fleet's (requests, retries) in the window."""
        summed = await self._script(keys=[self._key_prefix], args=[requests, retries, self._window_s])
        return int(summed[0]), int(summed[1])

    async def ping(self) -> None:
        await self._client.ping()


@dataclass(slots=True)
class _Counts:
    """Requests and retries this replica counted that the fleet's view does not hold yet."""

    requests: int = 0
    retries: int = 0


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet's window as one sync read it, and the retries this replica may spend on it:
    share = (allowed retries - retries) / replicas, negative when the fleet is over its budget; a
    positive share is rounded to whole retries at random, up with the probability of its fraction."""

    requests: int
    retries: int
    share: float


class SharedRetryBudget:
    """RetryBudget's interface over the whole fleet's counts: retries <= ratio x all replicas' requests
    + the floor, fleet-wide, as if one gateway counted. Nothing on the request path touches Redis:
    record_request() and try_spend() count locally, and a background task (start()) flushes the
    counts and reads the fleet's window every sync_interval_s, in one round trip (RedisRetryCounts).

    Between two syncs, try_spend() grants while this replica's retries not yet in its view stay
    within its share + ratio x its own requests not yet in the view: its own new requests are nobody
    else's to spend, and what was left at the sync is split N ways, so no replica can spend the
    fleet's whole budget between two syncs, and N replicas reading the same view spend at most what
    one budget allows.
    Staleness: while state is "redis", the view is at most sync_interval_s + sync_timeout_s old (a
    sync that takes longer fails), and a share is spent once: an old view only holds a replica back.
    Overspend, bounded: replicas read the window at different moments, so a view misses what the
    others spent since their own last flush. At any moment the fleet's retries exceed one budget by
    at most what reached Redis between the oldest and the newest of the replicas' last syncs (one
    sync period apart while all answer): those retries, plus ratio x those requests, plus under one
    retry per replica from the random rounding of shares (none on average; the next view's share is
    lower by it). Under steady pressure that is about sync_interval_s / window_s of the budget; a
    headroom saved up while healthy and spent at once by replicas out of step overshoots by a
    quarter of it with two replicas, a third with four, about half with many (simulated; two and
    four in tests/admission/test_shared_retry_budget.py).

    A sync that fails (a Redis error, or no answer within sync_timeout_s) turns the replica local:
    it decides on its own window (kept all along: its own requests and retries) with the floor
    scaled by 1/replicas, makes no Redis call until a PING every retry_interval_s answers, then
    syncs again. What it counted while local is not written back to Redis. `state` says which."""

    def __init__(
        self,
        counts: RedisRetryCounts,
        config: RetryBudgetConfig,
        replicas: int,
        clock: Callable[[], float] = time.monotonic,
        sync_interval_s: float = 0.1,
        sync_timeout_s: float = 0.5,
        retry_interval_s: float = 1.0,
        on_change: Callable[[str], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.config = config
        self.refused = 0
        self._counts = counts
        self._replicas = replicas
        self._sync_interval_s = sync_interval_s
        self._sync_timeout_s = sync_timeout_s
        self._retry_interval_s = retry_interval_s
        self._on_change = on_change
        self._rng = rng or random.Random()
        self._local = RetryBudget(config.floor_scaled(1.0 / replicas), clock)  # this replica's own window
        self._view: FleetView | None = None  # the last sync's; None while deciding locally
        self._pending = _Counts()  # counted since the last flush began
        self._sending = _Counts()  # in the flush under way
        self._counting = True  # False from a failed sync to the next attempt: an outage is not written back
        self._reported: str | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        """"redis" while deciding on the fleet's counts, "local" while on this replica's share alone
        (before the first sync, and while Redis is unreachable)."""
        return "local" if self._view is None else "redis"

    @property
    def view(self) -> FleetView | None:
        """The last sync's view of the fleet; None while deciding locally."""
        return self._view

    def record_request(self) -> None:
        self._local.record_request()
        if self._counting:
            self._pending.requests += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and counted as refused) when it is spent. Never waits."""
        if self._view is None:
            granted = self._local.try_spend()
        else:
            granted = self._within_share(self._view)
            if granted:
                self._local.record_retry()
        if not granted:
            self.refused += 1
            return False
        if self._counting:
            self._pending.retries += 1
        return True

    async def sync(self) -> bool:
        """One round trip: flush the counts since the last flush, read the fleet's window. False when
        Redis did not answer (the replica is local from then on)."""
        self._sending, self._pending = self._pending, _Counts()
        self._counting = True
        try:
            async with asyncio.timeout(self._sync_timeout_s):
                requests, retries = await self._counts.add_and_sum(self._sending.requests, self._sending.retries)
        except REDIS_ERRORS:  # TimeoutError is an OSError
            self._go_local()
            return False
        finally:
            self._sending = _Counts()
        headroom = self.config.allowed_retries(requests) - retries
        self._view = FleetView(requests, retries, self._whole_retries(headroom / self._replicas))
        self._report()
        return True

    async def start(self) -> None:
        """Start syncing in the background (the first sync at once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._sync_forever(), name="retry-budget-sync")

    async def aclose(self) -> None:
        """Stop syncing (at shutdown); the Redis client is its owner's to close."""
        await stop_tasks([self._task])
        self._task = None

    def _within_share(self, view: FleetView) -> bool:
        unseen_requests = self._pending.requests + self._sending.requests
        unseen_retries = self._pending.retries + self._sending.retries
        return unseen_retries + 1 <= view.share + self.config.ratio * unseen_requests

    def _whole_retries(self, share: float) -> float:
        """A positive share rounded down or up at random, its expectation kept: where a share is under
        one retry (more replicas than retries left), the fleet still spends its headroom."""
        if share <= 0:
            return share
        whole = math.floor(share)
        return whole + 1 if self._rng.random() < share - whole else whole

    async def _sync_forever(self) -> None:
        while True:
            if await self.sync():
                await asyncio.sleep(self._sync_interval_s)
            else:
                await wait_until_redis_answers(self._counts, self._retry_interval_s)

    def _go_local(self) -> None:
        self._view = None
        self._counting = False
        self._pending = _Counts()
        self._report()

    def _report(self) -> None:
        if self.state != self._reported:
            self._reported = self.state
            if self._on_change is not None:
                self._on_change(self.state)
