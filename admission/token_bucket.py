"""Token buckets: the local (one gateway process) store, and the interface a shared store meets.

A bucket holds up to `burst` tokens and refills at `rate_per_s`. take(n) grants when n tokens are
there; a request larger than the whole burst is granted when the bucket is full, leaving it in
debt (a tokens-per-minute limit must still admit one long prompt, then make the next ones wait).
adjust(n) settles after the fact without a check: a reservation that turned out too large gives
tokens back (n < 0), one too small takes more (n > 0, possibly into debt).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """rate_per_s tokens a second, at most burst at once."""

    rate_per_s: float
    burst: float

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0:
            raise ValueError("bucket rate_per_s must be > 0")
        if self.burst < 1:
            raise ValueError("bucket burst must be >= 1")

    def scaled(self, fraction: float) -> BucketSpec:
        """This bucket's share for one of several replicas (rate and burst times fraction)."""
        return BucketSpec(self.rate_per_s * fraction, max(1.0, self.burst * fraction))


class Taken(NamedTuple):
    """A take's answer: wait_s 0.0 when granted, else the seconds until it would be (nothing is taken);
    left, the tokens in the bucket after it (below 0: in debt)."""

    wait_s: float
    left: float


class TokenBuckets(Protocol):
    """Named buckets (one per tenant and limit). Both calls answer without waiting on anything slow."""

    async def take(self, key: str, spec: BucketSpec, amount: float) -> Taken:
        """Take amount, if it is there (see Taken)."""

    async def adjust(self, key: str, spec: BucketSpec, amount: float) -> None:
        """Take amount (> 0) or give it back (< 0) without a check."""


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_s: float


class LocalBuckets:
    """Buckets in this process's memory: exact for one gateway; the embedded default."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take_now(self, key: str, spec: BucketSpec, amount: float) -> float:
        bucket = self._refilled(key, spec)
        if bucket.tokens >= amount or bucket.tokens >= spec.burst:
            bucket.tokens -= amount
            return 0.0
        return (min(amount, spec.burst) - bucket.tokens) / spec.rate_per_s

    def adjust_now(self, key: str, spec: BucketSpec, amount: float) -> None:
        bucket = self._refilled(key, spec)
        bucket.tokens = min(spec.burst, bucket.tokens - amount)

    def taken_now(self, key: str, spec: BucketSpec, amount: float) -> Taken:
        wait_s = self.take_now(key, spec, amount)
        return Taken(wait_s, self._buckets[key].tokens)

    async def take(self, key: str, spec: BucketSpec, amount: float) -> Taken:
        return self.taken_now(key, spec, amount)

    async def adjust(self, key: str, spec: BucketSpec, amount: float) -> None:
        self.adjust_now(key, spec, amount)

    def _refilled(self, key: str, spec: BucketSpec) -> _Bucket:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(spec.burst, now)
        elif now > bucket.updated_s:
            bucket.tokens = min(spec.burst, bucket.tokens + (now - bucket.updated_s) * spec.rate_per_s)
            bucket.updated_s = now
        return bucket
