"""Who holds which block keys: confirmed (from KV events) and predicted (from recent decisions).

Each layer maps block key -> bitmask of workers; the worker in slot s owns bit s in both.

Confirmed (up to millions of keys, changed one key at a time by KV events) lives in a MaskTable,
a numpy hash table: a routing decision looks a prompt's keys up in a few vectorized operations
instead of walking a dict of a million ints (cache misses, a Python-level loop). Predicted (the
router's own recent decisions, expiring after a TTL: thousands of keys, often a whole new
prompt's worth per decision) stays a plain dict, so recording a decision costs dict stores, not
a table insert per key; a decision walks it only when it holds the prompt's first key.

Both layers are bounded: confirmed by each worker's max_blocks (oldest evicted first), predicted
by max_predicted_bytes: past it, the predictions due to expire first go early.

Eviction: for a worker whose KV capacity is known (add_worker's max_blocks), the index also keeps
an allocation clock (blocks the worker has stored, from its events), the keys pinned by requests
routed there and not yet ended (record_prediction pins, release unpins), and for other keys the
clock when each was last stored or freed. An engine's prefix cache evicts the least recently
freed block when it needs one, so a key freed more allocations ago than the worker can make
before it must evict it is about to go, or gone. match(eviction_horizon=...) counts a worker's
prefix only up to its first such key, confirmed or predicted (ages grow along a chain: a prompt
uses every block of its prefix).

Landed predictions: a prediction counts as cached (landed_prefix) once its request has computed
its prompt (prediction_landed, at its first token); an eviction event for a key a landed
prediction covers ends that prediction there.
"""

from __future__ import annotations

import heapq
from collections import Counter
import math
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, islice, repeat
from operator import ge, itemgetter, ne, or_

from router.block_keys import chain_block_keys, model_seed
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from router.mask_table import COMPILED_WALK, MaskTable, as_keys

_INT_BYTES = sys.getsizeof(2**63)  # a 64-bit int object
_PREDICTION_SLOT_BYTES = 40  # a key in a prediction's tuple: its slot, and its int when not shared
_PREDICTED_ENTRY_BYTES = 160  # a key predicted at a worker: its expiry entry, its mask entry and int
PREDICTED_KEY_BYTES = _PREDICTION_SLOT_BYTES + _PREDICTED_ENTRY_BYTES
"""What a predicted key of a prompt new to the worker takes (a prompt predicted again, such as a
shared system prompt, takes _PREDICTION_SLOT_BYTES a key for its tuple)."""
DEFAULT_MAX_PREDICTED_BYTES = 32 * 1024 * 1024  # ~170k keys of new prompts: 650 of 4,096 tokens in 16-token blocks


@dataclass(slots=True)
class _Worker:
    slot: int
    bit: int  # 1 << slot, in both layers
    seed: int
    max_blocks: int
    blocks: dict[Hashable, int] = field(default_factory=dict)  # engine hash -> key, oldest first
    extra_refs: dict[int, int] = field(default_factory=dict)  # key -> further engine hashes (rare)
    predicted: dict[int, float] = field(default_factory=dict)  # key -> expiry (clock seconds)
    models_eviction: bool = False  # its capacity is known: the three fields below are kept
    blocks_allocated: int = 0  # blocks it has stored so far (KV events): its allocation clock
    last_used: dict[int, int] = field(default_factory=dict)  # key -> blocks_allocated when last stored or freed
    in_use: Counter[int] = field(default_factory=Counter)  # key -> requests routed here that hold it (pinned)
    event_block_size: int | None = None  # the block size its last BlockStored event carried


@dataclass(slots=True)
class IndexCounters:
    """Monotonic counters, exported as metrics by the gateway."""

    events_applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_evicted: int = 0
    workers_cleared: int = 0
    stored_unknown_parent: int = 0
    events_skipped_lora: int = 0
    events_skipped_medium: int = 0
    predictions_evicted: int = 0  # dropped before their expiry to stay within max_predicted_bytes


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Memory report: entries per worker and an approximate size of the whole index.

    num_keys: entries in both layers: confirmed keys plus predicted keys (a key in both layers
    counts in each; finding the overlap would cost a lookup per predicted key).
    approx_bytes: the confirmed table's array, the predicted dict, the workers' engine-hash and
    expiry dicts, the predictions' key tuples, and the int objects in them.
    """

    num_keys: int
    blocks_per_worker: dict[str, int]
    predicted_per_worker: dict[str, int]
    approx_bytes: int


class KvIndex:
    """Two layers over chained block keys, each a map key -> bitmask (one bit per worker).

    Confirmed entries come from BlockStored/BlockRemoved/AllBlocksCleared; each worker keeps its
    engine-hash -> key map (capped at max_blocks, oldest evicted first). Predicted entries are the
    router's own recent decisions and expire after predicted_ttl_s; they take at most
    max_predicted_bytes (estimated: PREDICTED_KEY_BYTES a key new to its worker, less for a key
    predicted again): the predictions due to expire first are dropped early to make room, and
    a prediction longer than max_predicted_keys keeps its leading keys.
    """

    def __init__(
        self,
        *,
        predicted_ttl_s: float = 2.0,
        default_max_blocks: int = 262_144,
        max_predicted_bytes: int = DEFAULT_MAX_PREDICTED_BYTES,
        indexed_media: frozenset[str] | None = frozenset({"GPU"}),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if predicted_ttl_s <= 0:
            raise ValueError("predicted_ttl_s must be > 0")
        if default_max_blocks < 1:
            raise ValueError("default_max_blocks must be >= 1")
        if max_predicted_bytes < PREDICTED_KEY_BYTES:
            raise ValueError(f"max_predicted_bytes must be >= {PREDICTED_KEY_BYTES} (one key)")
        self.predicted_ttl_s = predicted_ttl_s
        self.default_max_blocks = default_max_blocks
        self.max_predicted_bytes = max_predicted_bytes
        self.max_predicted_keys = max_predicted_bytes // PREDICTED_KEY_BYTES
        self.indexed_media = indexed_media
        self.counters = IndexCounters()
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._worker_of_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._confirmed = MaskTable()
        self._predicted: dict[int, int] = {}
        self._landed: dict[int, int] = {}  # predicted keys whose request has computed its prompt there
        self._expiry_heap: list[tuple[float, int, str, Sequence[int]]] = []
        self._heap_seq = 0
        self._num_heap_keys = 0  # keys of the predictions in the heap (their tuples)
        self._num_predicted_entries = 0  # keys predicted per worker, summed (the expiry dicts)

    # -- workers -------------------------------------------------------------------------------

    def add_worker(self, worker_id: str, *, model_name: str, max_blocks: int | None = None) -> None:
        """Register a worker; max_blocks should be its KV block count (None: default_max_blocks)."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already indexed")
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        slot = heapq.heappop(self._free_slots) if self._free_slots else self._take_slot()
        cap = max_blocks if max_blocks is not None else self.default_max_blocks
        self._workers[worker_id] = _Worker(slot, 1 << slot, model_seed(model_name), cap,
                                           models_eviction=max_blocks is not None)
        self._worker_of_slot[slot] = worker_id

    def set_capacity(self, worker_id: str, max_blocks: int) -> None:
        """The worker's KV capacity, learned after it was added: its confirmed blocks are capped
        at it (oldest first), and its evictions modeled from now on; what it holds now counts as
        freed now."""
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        worker = self._worker(worker_id)
        while len(worker.blocks) > max_blocks:
            self._unref(worker, worker.blocks.pop(next(iter(worker.blocks))))
            self.counters.blocks_evicted += 1
        if not worker.models_eviction:
            worker.last_used = dict.fromkeys(worker.blocks.values(), worker.blocks_allocated)
        worker.max_blocks, worker.models_eviction = max_blocks, True

    def event_block_size(self, worker_id: str) -> int | None:
        """The block size of the worker's last stored blocks (None before any), as its events said."""
        return self._worker(worker_id).event_block_size

    def reserve(self, num_blocks: int) -> None:
        """Make room for num_blocks confirmed keys now (capped at RESERVE_LIMIT_BLOCKS): the table
        doubles as it fills, and each doubling pauses its thread for a time that grows with its
        size (~0.45 s at a million keys), so a known fleet capacity is best reserved at start."""
        self._confirmed.reserve(min(num_blocks, RESERVE_LIMIT_BLOCKS))

    def remove_worker(self, worker_id: str) -> None:
        """Drop everything known about a worker, confirmed and predicted."""
        worker = self._worker(worker_id)
        self.clear_worker(worker_id)
        _clear_bit(self._predicted, worker.predicted, worker.bit)
        _clear_bit(self._landed, worker.predicted, worker.bit)
        self._num_predicted_entries -= len(worker.predicted)
        del self._workers[worker_id]
        del self._worker_of_slot[worker.slot]
        heapq.heappush(self._free_slots, worker.slot)

    def clear_worker(self, worker_id: str) -> None:
        """Forget a worker's confirmed blocks (AllBlocksCleared, restart, unrecoverable gap)."""
        worker = self._worker(worker_id)
        if worker.blocks:  # one vectorized pass, however many blocks it held
            self._confirmed.remove_bits_many(as_keys(list(worker.blocks.values())), worker.bit)
        worker.blocks = {}
        worker.extra_refs = {}
        worker.last_used = {}  # whatever was predicted there is gone with the rest
        worker.in_use = Counter()
        self.counters.workers_cleared += 1

    # -- confirmed layer -----------------------------------------------------------------------

    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> int:
        """Apply a batch of decoded events in order; returns how many were applied."""
        worker = self._worker(worker_id)
        applied = 0
        for event in events:
            if isinstance(event, BlockStored):
                self._apply_stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._apply_removed(worker, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(worker_id)
            else:
                raise TypeError(f"not a KV event: {event!r}")
            applied += 1
        self.counters.events_applied += applied
        return applied

    def _skips(self, medium: str | None) -> bool:
        media = self.indexed_media
        return media is not None and medium is not None and medium not in media

    def _apply_stored(self, worker: _Worker, event: BlockStored) -> None:
        # the KV-event hot path (hundreds of thousands of events a second): kept flat on purpose
        counters = self.counters
        if event.lora_id is not None:
            counters.events_skipped_lora += 1
            return
        if event.medium is not None and self._skips(event.medium):
            counters.events_skipped_medium += 1
            return
        blocks = worker.blocks
        parent = event.parent_block_hash
        if parent is None:
            parent_key = worker.seed
        else:
            parent_key = blocks.get(parent)
            if parent_key is None:
                counters.stored_unknown_parent += 1
                return
        hashes, tokens, block_size = event.block_hashes, event.token_ids, event.block_size
        worker.event_block_size = block_size
        covered = len(hashes) * block_size
        keys = chain_block_keys(tokens if len(tokens) == covered else tokens[:covered], block_size, parent_key)
        bit, add_bits = worker.bit, self._confirmed.add_bits
        for engine_hash, key in zip(hashes, keys):
            old_key = blocks.pop(engine_hash, None)
            if old_key is not None:
                if old_key == key:
                    blocks[engine_hash] = key  # stored again: now the youngest entry
                    continue
                self._unref(worker, old_key)
            blocks[engine_hash] = key
            if add_bits(key, bit) & bit:
                worker.extra_refs[key] = worker.extra_refs.get(key, 0) + 1
            if len(blocks) > worker.max_blocks:
                self._unref(worker, blocks.pop(next(iter(blocks))))
                counters.blocks_evicted += 1
        counters.blocks_stored += len(keys)
        if worker.models_eviction:
            worker.blocks_allocated += len(keys)
            worker.last_used.update(zip(keys, repeat(worker.blocks_allocated)))
            _bound_last_used(worker)

    def _apply_removed(self, worker: _Worker, event: BlockRemoved) -> None:
        if self._skips(event.medium):
            self.counters.events_skipped_medium += 1
            return
        blocks, landed, bit = worker.blocks, self._landed, worker.bit
        for engine_hash in event.block_hashes:
            key = blocks.pop(engine_hash, None)
            if key is not None:
                self._unref(worker, key)
                self.counters.blocks_removed += 1
                if landed.get(key, 0) & bit:  # computed by a predicted request, now evicted: no longer predicted
                    self._forget_predicted(worker, key)

    def _forget_predicted(self, worker: _Worker, key: int) -> None:
        if worker.predicted.pop(key, None) is not None:
            self._num_predicted_entries -= 1
        _clear_bit(self._predicted, (key,), worker.bit)
        _clear_bit(self._landed, (key,), worker.bit)

    def _unref(self, worker: _Worker, key: int) -> None:
        extra = worker.extra_refs.get(key)
        if extra:
            if extra == 1:
                del worker.extra_refs[key]
            else:
                worker.extra_refs[key] = extra - 1
            return
        self._confirmed.remove_bits(key, worker.bit)

    # -- predicted layer -----------------------------------------------------------------------

    def record_prediction(
        self, worker_id: str, keys: Sequence[int], ttl_s: float | None = None, *, num_predicted: int = 0,
        pin: bool = True,
    ) -> float | None:
        """Remember that worker_id was just sent a prompt with these keys (for ttl_s seconds);
        returns the prediction's expiry (None for no keys), which withdraw_prediction takes.

        num_predicted: how many leading keys match() just reported predicted for this worker;
        their expiry is refreshed without touching the shared masks again. keys is kept until
        the prediction expires: pass a tuple (the collector does not track tuples of ints).
        Only the first max_predicted_keys are kept (a prefix of a chain is a prediction too).
        pin=False for a request this router will not see end (another gateway replica's): its
        blocks are not counted in use here, since no release() would follow; they count as used
        now instead, so match() keeps them until the worker's allocations age them out, as it keeps
        this router's own (a key never seen counts as evicted: without this, a replica would see
        nothing of a prefix a peer has just sent to a worker until the worker's events came).
        """
        worker = self._worker(worker_id)
        if not keys:
            return None
        if worker.models_eviction:
            if pin:  # the request holds every block of its prompt there until it ends
                worker.in_use.update(keys)
            else:
                worker.last_used.update(zip(keys, repeat(worker.blocks_allocated)))
                _bound_last_used(worker)
        if len(keys) > self.max_predicted_keys:
            keys = tuple(keys[: self.max_predicted_keys])
        now = self._clock()
        self._expire(now)
        if self._evict_for(len(keys)):
            num_predicted = 0  # what match() saw predicted may have gone with them
        expiry = now + (ttl_s if ttl_s is not None else self.predicted_ttl_s)
        num_entries = len(worker.predicted)
        worker.predicted.update(zip(keys, repeat(expiry)))
        self._num_predicted_entries += len(worker.predicted) - num_entries
        if num_predicted < len(keys):  # the rest are usually new to the worker: OR its bit in, in C
            masks, rest = self._predicted, keys[num_predicted:] if num_predicted else keys
            masks.update(zip(rest, map(or_, map(masks.get, rest, repeat(0)), repeat(worker.bit))))
        self._heap_seq += 1
        heapq.heappush(self._expiry_heap, (expiry, self._heap_seq, worker_id, keys))
        self._num_heap_keys += len(keys)
        return expiry

    def withdraw_prediction(self, worker_id: str, keys: Sequence[int], expiry: float) -> int:
        """Forget keys predicted for worker_id by a request it did not serve (it refused or failed
        it, or the client left first). Pass the keys that request added, not those it only
        refreshed; a key predicted again since (another expiry) stays. Returns how many went."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        expiries = worker.predicted
        gone = [key for key in keys if expiries.get(key) == expiry]
        for key in gone:
            del expiries[key]
        self._num_predicted_entries -= len(gone)
        if gone:
            _clear_bit(self._predicted, gone, worker.bit)
            _clear_bit(self._landed, gone, worker.bit)
        return len(gone)

    def release(self, worker_id: str, keys: Sequence[int]) -> None:
        """A request routed to worker_id with keys (record_prediction) has ended: its blocks there
        are free, and evictable from now on, least recently freed first. An engine frees a
        request's blocks tail first (vLLM, and worker/engine/block_manager.py), so of the blocks
        freed here the deepest goes first: each is made one allocation older than the one before
        it in the chain. With a cache nearly full, a prompt's blocks are a large part of what is
        free, and its tail is evicted well before its head."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.models_eviction:
            return
        in_use, last_used, now = worker.in_use, worker.last_used, worker.blocks_allocated
        for key in keys:
            count = in_use.get(key, 0)
            if count > 1:
                in_use[key] = count - 1
            elif count:
                del in_use[key]
                last_used[key] = now
                now -= 1

    def blocks_in_use(self, worker_id: str) -> int:
        """Distinct prompt blocks the requests routed to worker_id hold now (0 without a known capacity)."""
        return len(self._workers[worker_id].in_use)

    def prediction_landed(self, worker_id: str, keys: Sequence[int]) -> None:
        """The request predicted with keys has computed its prompt at worker_id (its first token
        came): those of its keys still predicted there are now cached, not just on their way."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        predicted, landed, bit = worker.predicted, self._landed, worker.bit
        for key in keys:
            if key in predicted:
                landed[key] = landed.get(key, 0) | bit

    def landed_prefix(self, worker_id: str, keys: Sequence[int], length: int) -> int:
        """How many of keys[:length] (a predicted prefix match() reported) lead as landed at worker_id:
        predicted by a request that has computed its prompt there. A prediction still in prefill is
        not cached yet: a request beside it computes the prefix again."""
        bit, get = self._workers[worker_id].bit, self._landed.get
        lo, hi = 0, length  # keys[:lo] landed; keys[hi:] unknown
        if length and get(keys[length - 1], 0) & bit:
            return length
        while lo < hi:
            mid = (lo + hi) // 2
            if get(keys[mid], 0) & bit:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _expire(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            self._retire(heapq.heappop(heap), now)

    @property
    def predicted_bytes(self) -> int:
        """The predicted layer's estimated size, which max_predicted_bytes bounds."""
        return _PREDICTION_SLOT_BYTES * self._num_heap_keys + _PREDICTED_ENTRY_BYTES * self._num_predicted_entries

    def _evict_for(self, num_keys: int) -> int:
        """Make room for a prediction of num_keys (before adding it, so the layer never exceeds
        its budget even for a moment): drop the predictions due to expire first while it would
        not fit. Returns how many went."""
        heap = self._expiry_heap
        evicted = 0
        while heap and self.predicted_bytes + PREDICTED_KEY_BYTES * num_keys > self.max_predicted_bytes:
            entry = heapq.heappop(heap)
            self._retire(entry, entry[0])
            evicted += 1
        self.counters.predictions_evicted += evicted
        return evicted

    def _retire(self, entry: tuple[float, int, str, Sequence[int]], cutoff: float) -> None:
        """Forget a popped prediction's keys whose expiry is at or before cutoff."""
        _, _, worker_id, keys = entry
        self._num_heap_keys -= len(keys)
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        expiries = worker.predicted
        if expiries.get(keys[-1], 0.0) > cutoff:
            # keys[-1] was predicted again since: that prompt began with all of these keys
            # (chained keys name their whole prefix), and its own entry expires them later
            return
        stale = list(compress(keys, map(ge, repeat(cutoff), map(expiries.get, keys, repeat(math.inf)))))
        if stale:
            num_entries = len(expiries)
            for key in stale:
                expiries.pop(key, None)
            self._num_predicted_entries -= num_entries - len(expiries)
            _clear_bit(self._predicted, stale, worker.bit)
            _clear_bit(self._landed, stale, worker.bit)

    # -- lookup --------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], eviction_horizon: Callable[[str, int], int | None] | None = None
              ) -> dict[str, tuple[int, int]]:
        """{worker: (confirmed_prefix_blocks, predicted_prefix_blocks)} for workers holding keys[0].

        A prefix length n means the worker holds keys 0..n-1; absent workers hold (0, 0).
        eviction_horizon(worker, pinned_blocks): for a worker whose capacity is known, how many more
        blocks it can allocate before it evicts a block it could hold now (its free blocks, less those
        the work queued ahead will take; None: not known), given the blocks the requests routed there
        pin now (blocks_in_use); keys last used longer ago than that are not counted. Asked only of the
        workers that hold keys[0].
        """
        self._expire(self._clock())
        names = self._worker_of_slot
        if len(keys) <= _SMALL_PROMPT_KEYS and not COMPILED_WALK:  # per-key gets beat numpy's fixed cost
            held = _running_and(self._confirmed.get, keys)
            result = {names[slot]: (length, 0) for slot, length in _lengths_of(held).items()}
        else:
            slots, lengths = self._confirmed.prefix_holders(keys)
            # built in C: {name of slot: (length, 0)}
            result = dict(zip(map(names.__getitem__, slots), zip(lengths, repeat(0))))
        predicted = self._predicted
        if predicted and keys and keys[0] in predicted:
            for slot, length in _predicted_prefix_lengths(keys, predicted).items():
                name = names[slot]
                result[name] = (result.get(name, _NONE)[0], length)
        if eviction_horizon is not None and result:
            workers, evicted = self._workers, None
            for name, (confirmed, predicted_len) in result.items():
                worker = workers[name]
                if not worker.models_eviction:
                    continue
                in_use = worker.in_use
                horizon = eviction_horizon(name, len(in_use))
                if horizon is None:
                    continue
                length = confirmed if confirmed > predicted_len else predicted_len
                oldest, deepest = worker.blocks_allocated - horizon, keys[length - 1]
                if deepest in in_use or worker.last_used.get(deepest, _NEVER_USED) > oldest:
                    continue  # the usual case: the whole prefix is fresh (_fresh_prefix's first check)
                fresh = _fresh_prefix(keys, length, worker.last_used, in_use, oldest)
                if fresh < length:  # changed after the loop: a dict is not resized while it is walked
                    evicted = evicted or []
                    evicted.append((name, min(confirmed, fresh), min(predicted_len, fresh)))
            for name, confirmed, predicted_len in evicted or ():
                if confirmed or predicted_len:
                    result[name] = (confirmed, predicted_len)
                else:
                    del result[name]
        return result

    # -- report --------------------------------------------------------------------------------

    def stats(self) -> IndexStats:
        """Entries per worker and approximate bytes (table array + dict tables + int objects), in
        O(workers): the gateway exports it every health round."""
        blocks = {w: len(s.blocks) for w, s in self._workers.items()}
        predicted = {w: len(s.predicted) for w, s in self._workers.items()}
        table_bytes = self._confirmed.nbytes + sys.getsizeof(self._predicted) + 8 * self._num_heap_keys
        for state in self._workers.values():
            table_bytes += sys.getsizeof(state.blocks) + sys.getsizeof(state.predicted)
        int_bytes = _INT_BYTES * (2 * sum(blocks.values()) + len(self._predicted) + 2 * sum(predicted.values()))
        return IndexStats(len(self._confirmed) + len(self._predicted), blocks, predicted, table_bytes + int_bytes)

    def _worker(self, worker_id: str) -> _Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"worker {worker_id!r} is not indexed") from None

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1


_NONE = (0, 0)
_NEVER_USED = -(1 << 62)  # below any clock value
_LAST_USED_SLACK, _LAST_USED_MIN = 4, 4096  # last_used is pruned past SLACK x max_blocks + MIN keys
RESERVE_LIMIT_BLOCKS = 1 << 20  # reserve() allocates for at most this many keys (~64 MiB)
_SMALL_PROMPT_KEYS = 48  # without the C walk: the crossover of per-key gets vs one numpy lookup (~25 µs)


def _predicted_prefix_lengths(keys: Sequence[int], masks: dict[int, int]) -> dict[int, int]:
    """{bit index: number of leading keys whose mask has that bit}, for bits set in keys[0]'s mask,
    in the predicted layer.

    A prediction is a prompt's whole key chain, and a key is kept while any prediction holding it
    lives, so a worker predicted to hold a key holds every key before it (a chained key names its
    whole prefix): each key's mask is a subset of the one before. A worker's length is then the last
    key that still has its bit, found by bisection: a few lookups per distinct length, not one per
    key (record_prediction's contract: whole chains from a prompt's first block).
    """
    get = masks.get
    lengths: dict[int, int] = {}
    first = get(keys[0], 0) if keys else 0
    pending = [(first, 1, len(keys))] if first else []  # bits whose lengths are all in [lo, hi]
    while pending:
        bits, lo, hi = pending.pop()
        while lo < hi:
            mid = (lo + hi + 1) // 2
            longer = bits & get(keys[mid - 1], 0)  # these hold keys[mid - 1]: length >= mid
            if longer and longer != bits:
                pending.append((longer, mid, hi))
                bits, hi = bits & ~longer, mid - 1
            elif longer:
                lo = mid
            else:
                hi = mid - 1
        _record(bits, lo, lengths)
    return lengths


def _fresh_prefix(keys: Sequence[int], length: int, last_used: Mapping[int, int], in_use: Mapping[int, int],
                  oldest: int) -> int:
    """How many of keys[:length] lead in use by a request, or last used after oldest (clock values
    fall along a chain, so by bisection; a key never seen counts as evicted). Runs for each worker
    holding a prompt's first key, each decision: the usual answer, the whole prefix, takes one check."""
    if length == 0:
        return 0
    get = last_used.get
    key = keys[length - 1]
    if key in in_use or get(key, _NEVER_USED) > oldest:
        return length
    lo, hi = 0, length - 1  # keys[:lo] are fresh, keys[hi] is not
    while lo < hi:
        mid = (lo + hi) // 2
        key = keys[mid]
        if key in in_use or get(key, _NEVER_USED) > oldest:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _bound_last_used(worker: _Worker) -> None:
    if len(worker.last_used) > _LAST_USED_SLACK * worker.max_blocks + _LAST_USED_MIN:
        _forget_evicted(worker)


def _forget_evicted(worker: _Worker) -> None:
    """Drop last-use entries older than the worker's whole capacity: they are evicted whatever the
    horizon; and past max_blocks entries, the least recently used (an LRU cache holds no more than
    its max_blocks most recent): keys other replicas sent there count as used now, and while the
    worker's own events lag or stop, its allocations age none of them."""
    oldest = worker.blocks_allocated - worker.max_blocks
    last_used = {key: used for key, used in worker.last_used.items() if used >= oldest}
    if len(last_used) > worker.max_blocks:
        last_used = dict(sorted(last_used.items(), key=itemgetter(1))[-worker.max_blocks:])
    worker.last_used = last_used


def _lengths_of(held: list[int]) -> dict[int, int]:
    """{bit index: prefix length} from running-AND masks (each a subset of the one before)."""
    lengths: dict[int, int] = {}
    if not held:
        return lengths
    for i in compress(count(1), map(ne, held, islice(held, 1, None))):
        _record(held[i - 1] & ~held[i], i, lengths)
    _record(held[-1], len(held), lengths)
    return lengths


def _running_and(get: Callable[[int], int], keys: Sequence[int]) -> list[int]:
    """Running AND of get(key) over the leading keys, while it is nonzero."""
    held: list[int] = []
    active = -1
    for key in keys:
        active &= get(key)
        if not active:
            break
        held.append(active)
    return held


def _record(bits: int, length: int, lengths: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        lengths[low.bit_length() - 1] = length
        bits ^= low


def _clear_bit(masks: dict[int, int], keys: Iterable[int], bit: int) -> None:
    for key in keys:
        mask = masks.get(key, 0) & ~bit
        if mask:
            masks[key] = mask
        else:
            masks.pop(key, None)
