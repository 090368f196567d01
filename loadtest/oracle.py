"""Oracle prefix-cache hit rate: the upper bound with an infinite cache and perfect routing.

Tokens are the whitespace-separated words of a request's prompt text (RequestSpec.prompt_text),
cut into blocks of `block_size_tokens`; like a paged KV cache, only full blocks can be shared. For
each request in arrival order, shared = the longest run of leading blocks that any earlier request
also started with; hit rate = sum(shared tokens) / sum(prompt tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from loadtest.types import RequestSpec

DEFAULT_ORACLE_BLOCK_SIZE = 16  # tokens, where the workers' own block size is not known (`bench run`)


@dataclass(frozen=True, slots=True)
class OracleResult:
    """Totals behind the oracle hit rate, in (approximate) tokens."""

    prompt_tokens: int
    shared_tokens: int

    @property
    def hit_rate(self) -> float | None:
        return self.shared_tokens / self.prompt_tokens if self.prompt_tokens else None


def oracle_hit_rate(specs: Sequence[RequestSpec], block_size_tokens: int = 16) -> OracleResult:
    """Replay the prompts in arrival order against a set of every block-prefix seen so far."""
    if block_size_tokens < 1:
        raise ValueError("block_size_tokens must be >= 1")
    return oracle_over_tokens([s.prompt_text().split() for s in arrival_order(specs)], block_size_tokens)


def oracle_over_tokens(prompts: Sequence[Sequence[str]], block_size_tokens: int) -> OracleResult:
    """The oracle over prompts already tokenized (and already in arrival order)."""
    seen: set[int] = set()
    total = shared = 0
    for tokens in prompts:
        total += len(tokens)
        key = 0
        matching = True
        for start in range(0, len(tokens) - block_size_tokens + 1, block_size_tokens):
            key = hash((key, tuple(tokens[start:start + block_size_tokens])))
            if matching and key in seen:
                shared += block_size_tokens
            else:
                matching = False
                seen.add(key)
    return OracleResult(prompt_tokens=total, shared_tokens=shared)


def static_partition_hit_rate(specs: Sequence[RequestSpec], num_workers: int, capacity_tokens: int,
                              block_size_tokens: int = 16) -> OracleResult:
    """The hit rate of a static partition with caches of a real size: each prefix group (a tenant, a
    conversation: RequestSpec.prefix_group; else the request alone) stays on one worker, the groups
    dealt out round robin in order of first arrival; each worker an LRU cache of capacity_tokens //
    block_size_tokens blocks, a request's blocks becoming its most recent. Replayed in arrival order
    one request at a time (no request pins another's blocks): the reference a cache-aware router
    should beat where the fleet's cache cannot hold every hot prefix."""
    if num_workers < 1 or block_size_tokens < 1:
        raise ValueError("num_workers and block_size_tokens must be >= 1")
    capacity = max(1, capacity_tokens // block_size_tokens)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_workers)]
    owner: dict[str, int] = {}
    total = shared = 0
    for spec in arrival_order(specs):
        tokens = spec.prompt_text().split()
        cache = caches[owner.setdefault(spec.prefix_group or f"request-{spec.index}", len(owner) % num_workers)]
        total += len(tokens)
        key, matching = 0, True
        for start in range(0, len(tokens) - block_size_tokens + 1, block_size_tokens):
            key = hash((key, tuple(tokens[start:start + block_size_tokens])))
            if matching and key in cache:
                shared += block_size_tokens
                cache.move_to_end(key)
            else:
                matching = False
                cache[key] = None
                cache.move_to_end(key)
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return OracleResult(prompt_tokens=total, shared_tokens=shared)


def arrival_order(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """By arrival offset when every spec has one (stable), else in list order."""
    if specs and all(s.arrival_offset_s is not None for s in specs):
        return sorted(specs, key=lambda s: s.arrival_offset_s)
    return list(specs)
