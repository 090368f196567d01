"""Physical KV blocks: reference counts, prefix caching by chained block key, LRU eviction, and the
KV events (BlockStored / BlockRemoved / AllBlocksCleared) that report every change to the cache.

A free block is either empty (no key) or cached (it holds a computed full block under its key and
can be reused by a later request until it is evicted). Allocation takes empty blocks first, then
evicts cached free blocks least-recently-freed first. A sequence frees its blocks tail first, so a
prefix chain loses its last blocks before its first ones.

Full-prompt hits: a request always computes at least its last token (the next token is sampled
from its logits), so the usable cached prefix is capped at (num_tokens - 1) // block_size blocks;
the block holding the last token is recomputed into a fresh block rather than shared.
"""

from __future__ import annotations

from collections import OrderedDict

from worker.engine.block_hash import extend_block_keys
from worker.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventSink
from worker.engine.sequence import Sequence


class BlockManager:
    """Hands out a fixed pool of num_blocks blocks of block_size tokens to sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        hash_seed: int = 0,
        enable_prefix_caching: bool = True,
        event_sink: KVEventSink | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self._event_sink = event_sink
        self._ref_counts = [0] * num_blocks
        self._block_key: list[int | None] = [None] * num_blocks
        self._block_by_key: dict[int, int] = {}
        # Empty free blocks, popped from the end; ordered so block 0 is handed out first.
        self._empty_free = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks, least recently freed first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0

    # ---- views -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: empty ones plus evictable cached ones."""
        return len(self._empty_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vllm:kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a key, in use or free."""
        return len(self._block_by_key)

    def cached_block_keys(self) -> frozenset[int]:
        return frozenset(self._block_by_key)

    def cached_blocks(self) -> dict[int, int]:
        """A copy of the prefix cache: block key -> block id."""
        return dict(self._block_by_key)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Every free block id (empty, then cached least recently freed first)."""
        return [*reversed(self._empty_free), *self._cached_free]

    # ---- allocation --------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached run of seq's leading full blocks, capped so that at
        least the last token is left to compute. No side effects beyond hashing seq's blocks."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if len(seq.block_keys) < max_blocks:
            extend_block_keys(seq.block_keys, seq.token_ids, self.block_size, self.hash_seed)
        hits: list[int] = []
        block_by_key = self._block_by_key
        for key in seq.block_keys[:max_blocks]:
            block_id = block_by_key.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int | None = None,
        cached_block_ids: list[int] | None = None,
    ) -> bool:
        """Whether allocate(seq, num_new_tokens, cached_block_ids) would succeed now."""
        cached_block_ids, num_new_tokens = self._plan(seq, num_new_tokens, cached_block_ids)
        return self._fits(num_new_tokens, cached_block_ids)

    def _plan(
        self, seq: Sequence, num_new_tokens: int | None, cached_block_ids: list[int] | None
    ) -> tuple[list[int], int]:
        if cached_block_ids is None:
            cached_block_ids = self.lookup_prefix(seq)
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - len(cached_block_ids) * self.block_size
        return cached_block_ids, num_new_tokens

    def _fits(self, num_new_tokens: int, cached_block_ids: list[int]) -> bool:
        num_tokens = len(cached_block_ids) * self.block_size + num_new_tokens
        num_new_blocks = self._num_blocks_for(num_tokens) - len(cached_block_ids)
        num_reclaimed = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        return num_new_blocks + num_reclaimed <= self.num_free_blocks

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int | None = None,
        cached_block_ids: list[int] | None = None,
    ) -> int | None:
        """Give a sequence without blocks its cached prefix plus room for num_new_tokens more.

        cached_block_ids defaults to lookup_prefix(seq); num_new_tokens defaults to the rest of
        seq's tokens. Sets seq.block_table and seq.num_computed_tokens; returns the number of
        cached tokens, or None (and changes nothing) if there are not enough free blocks.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        cached_block_ids, num_new_tokens = self._plan(seq, num_new_tokens, cached_block_ids)
        if not self._fits(num_new_tokens, cached_block_ids):
            return None
        num_cached_tokens = len(cached_block_ids) * self.block_size
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            self._ref_counts[block_id] += 1
        seq.block_table = list(cached_block_ids)
        seq.num_computed_tokens = num_cached_tokens
        seq.num_registered_blocks = len(cached_block_ids)
        self._grow(seq, num_cached_tokens + num_new_tokens)
        self.prefix_cache_queries_tokens += seq.num_tokens
        self.prefix_cache_hits_tokens += num_cached_tokens
        return num_cached_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's block table cover num_computed_tokens + num_new_tokens tokens.

        Returns False (and changes nothing) if there are not enough free blocks.
        """
        num_tokens = seq.num_computed_tokens + num_new_tokens
        num_new_blocks = self._num_blocks_for(num_tokens) - len(seq.block_table)
        if num_new_blocks > self.num_free_blocks:
            return False
        if num_new_blocks > 0:
            self._grow(seq, num_tokens)
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        table = seq.block_table
        removed: list[int] = []
        for _ in range(self._num_blocks_for(num_tokens) - len(table)):
            block_id = self._take_free_block(removed)
            self._ref_counts[block_id] = 1
            table.append(block_id)
        if removed:
            self._emit(BlockRemoved(removed))

    def _take_free_block(self, removed_keys: list[int]) -> int:
        if self._empty_free:
            return self._empty_free.pop()
        block_id, _ = self._cached_free.popitem(last=False)
        key = self._block_key[block_id]
        if key is not None:
            del self._block_by_key[key]
            self._block_key[block_id] = None
            removed_keys.append(key)
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tail first; computed full blocks stay cached until evicted."""
        for block_id in reversed(seq.block_table):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                if self._block_key[block_id] is None:
                    self._empty_free.append(block_id)
                else:
                    self._cached_free[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ---- prefix cache ------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly computed full blocks under their keys and report them.

        Call after seq.num_computed_tokens advanced. A block whose key another block already
        holds (two requests computed the same prefix at once) stays unregistered.
        """
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        num_full = seq.num_computed_tokens // block_size
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        keys = seq.block_keys
        if len(keys) < num_full:
            extend_block_keys(keys, seq.token_ids, block_size, self.hash_seed)
        run_start: int | None = None
        for index in range(start, num_full):
            block_id = seq.block_table[index]
            key = keys[index]
            if self._block_key[block_id] is None and key not in self._block_by_key:
                self._block_key[block_id] = key
                self._block_by_key[key] = block_id
                if run_start is None:
                    run_start = index
            elif run_start is not None:
                self._emit_stored(seq, run_start, index)
                run_start = None
        if run_start is not None:
            self._emit_stored(seq, run_start, num_full)
        seq.num_registered_blocks = num_full

    def _emit_stored(self, seq: Sequence, first: int, end: int) -> None:
        if self._event_sink is None:
            return
        size = self.block_size
        self._event_sink(
            BlockStored(
                block_hashes=seq.block_keys[first:end],
                parent_block_hash=seq.block_keys[first - 1] if first > 0 else None,
                token_ids=seq.token_ids[first * size : end * size],
                block_size=size,
            )
        )

    def reset_prefix_cache(self) -> None:
        """Forget every key (blocks in use stay allocated, just unshareable) and report it."""
        for block_id in self._block_by_key.values():
            self._block_key[block_id] = None
        self._block_by_key.clear()
        self._empty_free.extend(reversed(self._cached_free))
        self._cached_free.clear()
        self._emit(AllBlocksCleared())

    def _emit(self, event: KVEvent) -> None:
        if self._event_sink is not None:
            self._event_sink(event)
