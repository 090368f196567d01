"""Block key -> worker bitmask, as a cuckoo hash table in one numpy array.

Owns the storage behind the router's KV index (its confirmed layer): for every 64-bit block key
held by some worker, a bitmask of worker slots. Single-key updates (get/add_bits/remove_bits, the
KV-event path) use Python ints; a whole prompt's keys are looked up in a few vectorized numpy
operations (lookup, prefix_lengths / prefix_holders, the routing-decision path), and
remove_bits_many clears bits from many keys at once (a worker's whole cache). Where the C
extension router._mask_lookup is built, prefix_holders of a key list and add_bits on a one-word
table run there (same results; the numpy and Python paths stay for the rest and are tested).

Layout: a power-of-two number of slots, one row per slot, [key, mask word 0, ..., word W-1]
(W = ceil(highest bit used / 64), widened on demand; 8 * (1 + W) bytes a slot). Each key has
two candidate slots, from its low and high 32 bits (keys are xxh3 outputs, so those bits are
uniform); an insert that finds both taken moves occupants to their other slot (cuckoo hashing).
One slot per key, not buckets of several, keeps a prompt lookup to one gather and two
comparisons (4-slot buckets measured 20-50% slower there); the price is a load factor under
1/2 (the table doubles past MAX_LOAD). A free slot has an all-zero mask and holds a filler key
that cannot hash to it, so it never matches a lookup: every u64, 0 included, is a valid key.
Keys that cannot be placed at low load (only adversarial key sets) go to a small overflow dict,
which the vectorized path checks only when it is non-empty.

Not thread-safe: one thread (the router's event loop) owns a table.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat
from operator import rshift

import numpy as np

try:
    from router._mask_lookup import add_bits as _add_bits_c, prefix_holders as _prefix_holders_c
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _add_bits_c = _prefix_holders_c = None

COMPILED_WALK: bool = _prefix_holders_c is not None
"""Whether prefix_holders walks a list of keys in C (else numpy)."""

__all__ = ["COMPILED_WALK", "MAX_LOAD", "MaskTable", "as_keys", "prefix_holders_of"]

MAX_LOAD = 0.48  # keys per slot before doubling; two-choice cuckoo placement fails past 1/2
_FAIL_GROW_LOAD = 0.3  # a failed placement at a lower load goes to the overflow dict instead
_MAX_KICKS = 256
_BULK_MIN_KEYS = 64  # remove_bits_many: fewer keys go through remove_bits one by one
_M64 = (1 << 64) - 1
_FILL = 0x1_0000_0001  # filler of slot s: (s ^ 1) * _FILL, whose candidates are both s ^ 1

# 'L' converts Python ints faster than 'Q' (CPython's unsigned long path has no byte-array detour)
_U64_TYPECODE = "L" if array("L").itemsize == 8 else "Q"

_evens = np.arange(0, 2 * 1024, 2, dtype=np.intp)


def _even(n: int) -> np.ndarray:
    """0, 2, ..., 2n - 2 (a read-only slice of a shared cache)."""
    global _evens
    if n > len(_evens):
        _evens = np.arange(0, 4 * n, 2, dtype=np.intp)
    return _evens[:n]


def _fillers(num_slots: int, out: np.ndarray | None = None) -> np.ndarray:
    fillers = np.bitwise_xor(np.arange(num_slots, dtype=np.uint64), np.uint64(1), out=out)
    return np.multiply(fillers, np.uint64(_FILL), out=fillers)


def as_keys(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """keys as a contiguous uint64 array (out-of-range ints raise OverflowError).

    A list converts fastest; callers that look the same keys up more than once can convert once.
    """
    if isinstance(keys, np.ndarray):
        return np.ascontiguousarray(keys, dtype=np.uint64)
    if type(keys) is list:
        buf = array(_U64_TYPECODE)
        buf.fromlist(keys)
    else:
        buf = array(_U64_TYPECODE, keys)
    return np.frombuffer(buf, dtype=np.uint64) if buf else np.zeros(0, dtype=np.uint64)


class MaskTable:
    """uint64 key -> nonnegative int bitmask; a key is present iff its mask is nonzero."""

    __slots__ = ("_tab", "_mv", "_m", "_rows", "_words", "_count", "_max_fill", "_stash")

    def __init__(self, initial_slots: int = 1024) -> None:
        """initial_slots: rounded up to a power of two (at least 4)."""
        num_slots = 4
        while num_slots < initial_slots:
            num_slots *= 2
        self._count = 0
        self._stash: dict[int, int] = {}
        self._set_table(np.zeros((num_slots, 2), dtype=np.uint64), 1)
        self._tab[:, 0] = _fillers(num_slots)

    def _set_table(self, tab: np.ndarray, words: int) -> None:
        self._tab = tab
        self._mv = memoryview(tab.reshape(-1))  # Python-int access to single words
        self._m = len(tab) - 1
        self._rows = words + 1
        self._words = words
        self._max_fill = int(len(tab) * MAX_LOAD)

    # -- single keys ----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Keys with a nonzero mask."""
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held by the table array (the overflow dict, normally empty, is not counted)."""
        return self._tab.nbytes

    @property
    def words(self) -> int:
        """64-bit words per mask (lookup's second dimension); grows when a higher bit is added."""
        return self._words

    @property
    def num_slots(self) -> int:
        return len(self._tab)

    def reserve(self, num_keys: int) -> None:
        """Grow now, if needed, so that num_keys keys fit without another doubling.

        Doubling rebuilds the whole table (about 0.4 s at 1M keys): size it up front when the
        total capacity is known (e.g. the sum of the workers' KV block counts).
        """
        num_slots = len(self._tab)
        while int(num_slots * MAX_LOAD) < num_keys:
            num_slots *= 2
        if num_slots > len(self._tab):
            self._rebuild(num_slots)

    def get(self, key: int) -> int:
        """key's mask (0 if absent)."""
        m, mv, r = self._m, self._mv, self._rows
        o = (key & m) * r
        if mv[o] != key:
            o = ((key >> 32) & m) * r
            if mv[o] != key:
                return self._stash.get(key, 0) if self._stash else 0
        if r == 3:
            return mv[o + 1] | mv[o + 2] << 64
        return mv[o + 1] if r == 2 else self._read(o)

    def add_bits(self, key: int, bits: int) -> int:
        """OR bits into key's mask (inserting the key if bits != 0); returns the previous mask."""
        if bits >> (self._words << 6):
            self._widen(bits)  # (ValueError if bits < 0)
        if _add_bits_c is not None and self._rows == 2:  # one word: the usual cases in C
            prev = _add_bits_c(self._tab, key, bits, not self._stash and self._count < self._max_fill)
            if prev >= 0:
                return prev
            if prev == -2:  # went into a free candidate row
                self._count += 1
                return 0
        m, mv, r = self._m, self._mv, self._rows
        s = key & m
        o = s * r
        first = mv[o]
        if first != key:
            s2 = (key >> 32) & m
            o2 = s2 * r
            if mv[o2] != key:
                # absent: straight into a free candidate slot (the usual case, at load < 1/2)
                if r == 2 and bits and not self._stash and self._count < self._max_fill and key <= _M64:
                    if first != (s ^ 1) * _FILL:
                        o = o2 if mv[o2] == (s2 ^ 1) * _FILL else -1
                    if o >= 0:
                        mv[o] = key  # ValueError for a negative key, before anything changed
                        mv[o + 1] = bits
                        self._count += 1
                        return 0
                return self._add_absent(key, bits)
            o = o2
        if r == 2:
            prev = mv[o + 1]
            if bits & ~prev:
                mv[o + 1] = prev | bits
            return prev
        if r == 3:
            prev = mv[o + 1] | mv[o + 2] << 64
            if bits & ~prev:
                new = prev | bits
                mv[o + 1] = new & _M64
                mv[o + 2] = new >> 64
            return prev
        prev = self._read(o)
        if bits & ~prev:
            self._write(o, prev | bits)
        return prev

    def remove_bits(self, key: int, bits: int) -> int:
        """Clear bits in key's mask (the key is gone once it is 0); returns the previous mask."""
        if bits < 0:
            raise ValueError("bits must be >= 0")
        m, mv, r = self._m, self._mv, self._rows
        s = key & m
        o = s * r
        if mv[o] != key:
            s = (key >> 32) & m
            o = s * r
            if mv[o] != key:
                return self._remove_stashed(key, bits) if self._stash else 0
        if r == 2:
            prev = mv[o + 1]
            new = prev & ~bits
            if new != prev:
                if new:
                    mv[o + 1] = new
                else:
                    mv[o] = (s ^ 1) * _FILL
                    mv[o + 1] = 0
                    self._count -= 1
            return prev
        prev = (mv[o + 1] | mv[o + 2] << 64) if r == 3 else self._read(o)
        new = prev & ~bits
        if new == prev:
            return prev
        if new:
            self._write(o, new)
        else:
            mv[o] = (s ^ 1) * _FILL
            self._write(o, 0)
            self._count -= 1
        return prev

    def _read(self, o: int) -> int:
        mv = self._mv
        mask = 0
        for w in range(self._words):
            mask |= mv[o + 1 + w] << (w << 6)
        return mask

    def _write(self, o: int, mask: int) -> None:
        mv = self._mv
        for w in range(1, self._rows):
            mv[o + w] = mask & _M64
            mask >>= 64

    def _add_absent(self, key: int, bits: int) -> int:
        stash = self._stash
        if stash and key in stash:
            prev = stash[key]
            stash[key] = prev | bits
            return prev
        if bits == 0:
            return 0
        if not 0 <= key <= _M64:
            raise ValueError(f"key {key!r} is not a u64")
        if self._count >= self._max_fill:
            self._rebuild(2 * len(self._tab))
        self._count += 1
        homeless = self._place(key, bits)
        while homeless is not None:
            if self._count - len(self._stash) < len(self._tab) * _FAIL_GROW_LOAD:
                self._stash[homeless[0]] = homeless[1]
                break
            self._rebuild(2 * len(self._tab))
            homeless = self._place(*homeless)
        return 0

    def _remove_stashed(self, key: int, bits: int) -> int:
        prev = self._stash.get(key, 0)
        new = prev & ~bits
        if new != prev:
            if new:
                self._stash[key] = new
            else:
                del self._stash[key]
                self._count -= 1
        return prev

    def _place(self, key: int, mask: int) -> tuple[int, int] | None:
        """Put an absent key in the table; returns it back if no free slot is within reach.

        Cuckoo insertion: with both slots taken, follow the chain of occupants (each to its other
        slot) from both slots at once until one chain reaches a free slot, then shift that chain
        along by one. Nothing moves when both chains fail (cycle, or longer than _MAX_KICKS).
        """
        m, mv, r = self._m, self._mv, self._rows
        s = key & m
        if mv[s * r] != (s ^ 1) * _FILL:
            s2 = (key >> 32) & m
            if mv[s2 * r] == (s2 ^ 1) * _FILL:
                s = s2
            else:
                path = self._free_path(s, s2)
                if path is None:
                    return key, mask
                for dst, src in zip(path[:0:-1], path[-2::-1]):  # the free end first
                    mv[dst * r : dst * r + r] = mv[src * r : src * r + r]
                s = path[0]
        o = s * r
        mv[o] = key
        self._write(o, mask)
        return None

    def _free_path(self, a: int, b: int) -> list[int] | None:
        """Slots [start, ..., free slot], each the next occupant's other slot, from a or from b
        (whichever chain reaches a free slot first); None if both cycle or run past _MAX_KICKS."""
        m, mv, r = self._m, self._mv, self._rows
        chains = [[a], [b]] if a != b else [[a]]
        for _ in range(_MAX_KICKS):
            for chain in chains:
                s = chain[-1]
                key = mv[s * r]
                s ^= (key & m) ^ ((key >> 32) & m)  # the occupant's other slot
                if mv[s * r] == (s ^ 1) * _FILL:
                    chain.append(s)
                    return chain
                if s in chain:  # a cycle: this chain never reaches a free slot
                    chains.remove(chain)
                    if not chains:
                        return None
                    break
                chain.append(s)
        return None

    def _widen(self, bits: int) -> None:
        if bits < 0:
            raise ValueError("bits must be >= 0")
        words = (bits.bit_length() + 63) >> 6
        tab = np.zeros((len(self._tab), words + 1), dtype=np.uint64)
        tab[:, : self._rows] = self._tab
        self._set_table(tab, words)

    def _rebuild(self, num_slots: int) -> None:
        """Move every key into a new table of num_slots slots (vectorized, then cuckoo for the rest)."""
        old = self._tab
        rows = np.compress(old[:, 0] != _fillers(len(old)), old, axis=0)  # the live rows, [key, mask words]
        keys = rows[:, 0]
        tab = np.zeros((num_slots, self._rows), dtype=np.uint64)
        _fillers(num_slots, out=tab[:, 0])
        self._set_table(tab, self._words)
        m = np.uint64(self._m)
        owner = np.full(num_slots, -1, dtype=np.intp)
        pending = np.arange(len(keys))
        for shift in (np.uint64(0), np.uint64(32)):  # first slots, then second slots still free
            slots = ((keys[pending] >> shift) & m).astype(np.intp)
            free = owner[slots] < 0
            wanting, slots = pending[free], slots[free]
            owner[slots] = wanting  # one of the keys that want a slot gets it
            won = owner[slots] == wanting
            tab[slots[won]] = rows[wanting[won]]
            pending = np.concatenate((pending[~free], wanting[~won]))
        rest = [(int(keys[i]), _row_to_int(rows[i, 1:])) for i in pending]
        stash, self._stash = self._stash, {}
        for key, mask in rest + list(stash.items()):
            homeless = self._place(key, mask)
            if homeless is not None:
                self._stash[homeless[0]] = homeless[1]

    # -- whole prompts --------------------------------------------------------------------------

    def lookup(self, keys: Sequence[int] | np.ndarray) -> np.ndarray:
        """Masks of keys as a new (len(keys), words) uint64 array; absent keys give zero rows."""
        k = as_keys(keys)
        if not len(k):
            return np.zeros((0, self._words), dtype=np.uint64)
        rows, found = self._select(k)
        out = np.multiply(rows[:, 1:], found[:, None])
        if self._stash:
            self._patch_stash(k, out)
        return out

    def prefix_lengths(self, keys: Sequence[int] | np.ndarray) -> list[int]:
        """For each bit b < 64 * words: how many leading keys all have bit b in their masks.

        keys: a list of ints or a uint64 array. The lengths come from the running AND of the
        masks, which only loses bits, so each is where its bit is lost (or len(keys)).
        """
        lengths = [0] * (self._words << 6)
        bits, counts = self.prefix_holders(keys)
        for bit, n in zip(bits, counts):
            lengths[bit] = n
        return lengths

    def prefix_holders(self, keys: Sequence[int] | np.ndarray) -> tuple[list[int], list[int]]:
        """prefix_lengths without the zeros: (bits, lengths), every bit set in the first key's
        mask and how many leading keys all have it (the decision path: a few workers' lengths
        out of 64 * words bits).

        The pairs come in no particular order (see prefix_holders_of). A list or tuple of keys
        is walked in C (router._mask_lookup) while the overflow dict is empty.
        """
        if _prefix_holders_c is not None and not self._stash and isinstance(keys, (list, tuple)):
            return _prefix_holders_c(self._tab, keys)
        k = as_keys(keys)
        n = len(k)
        if not n:
            return [], []
        if self._stash:
            masks = self.lookup(k)
        else:
            rows, found = self._select(k)
            first_absent = int(found.argmin())
            if not found[first_absent]:
                n = first_absent  # the running AND is 0 from the first absent key on
                if not n:
                    return [], []
            masks = rows[:n, 1:]
        return prefix_holders_of(masks)

    # -- many keys at once ----------------------------------------------------------------------

    def remove_bits_many(self, keys: Sequence[int] | np.ndarray, bits: int) -> int:
        """remove_bits(key, bits) for every key (absent keys and repeats are fine), vectorized;
        returns how many keys are gone (their mask now 0).

        For dropping a worker's bit from all of its keys: a million of them in about 50 ms, where
        a loop of remove_bits takes 0.5 s. The vectorized pass also sweeps a flag per table slot,
        so up to num_slots / 512 keys (at least 64) go through remove_bits instead.
        """
        if bits < 0:
            raise ValueError("bits must be >= 0")
        k = as_keys(keys)
        bits &= (1 << (self._words << 6)) - 1  # higher bits are in no mask
        if not len(k) or not bits:
            return 0
        tab = self._tab
        if len(k) <= max(_BULK_MIN_KEYS, len(tab) >> 9):
            gone = 0
            for key in k.tolist():
                prev = self.remove_bits(key, bits)
                if prev and not prev & ~bits:
                    gone += 1
            return gone
        cand = (k.view(np.uint32) & self._m).astype(np.intp).reshape(-1, 2)  # both candidate slots
        first = tab[cand[:, 0], 0] == k
        second = tab[cand[:, 1], 0] == k
        hit = np.zeros(len(tab), dtype=bool)  # each slot once, in order (np.unique sorts: slower)
        hit[cand[first, 0]] = True
        hit[cand[second, 1]] = True
        slots = np.flatnonzero(hit)
        keep = np.array([~(bits >> (w << 6)) & _M64 for w in range(self._words)], dtype=np.uint64)
        masks = tab[slots, 1:] & keep
        tab[slots, 1:] = masks
        emptied = slots[~masks.any(axis=1)]
        tab[emptied, 0] = (emptied.astype(np.uint64) ^ np.uint64(1)) * np.uint64(_FILL)
        self._count -= len(emptied)
        gone = len(emptied)
        if self._stash:
            missing = k[~(first | second)]
            stashed = as_keys(list(self._stash))
            for key in stashed[np.isin(stashed, missing)].tolist():
                if self._remove_stashed(key, bits) & ~bits == 0:
                    gone += 1
        return gone

    def _select(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's row [key, mask words] (its second candidate if the key is there, else its
        first) and whether that row holds the key; the overflow dict is not consulted."""
        pairs = self._tab.take(k.view(np.uint32) & self._m, axis=0, mode="clip")  # both candidates
        rows = pairs.take(_even(len(k)) + (pairs[1::2, 0] == k), axis=0)
        return rows, rows[:, 0] == k

    def _patch_stash(self, k: np.ndarray, out: np.ndarray) -> None:
        for key, mask in self._stash.items():
            hits = np.flatnonzero(k == np.uint64(key))
            if len(hits):
                out[hits] = [(mask >> (w << 6)) & _M64 for w in range(self._words)]


def prefix_holders_of(masks: np.ndarray) -> tuple[list[int], list[int]]:
    """(bits, lengths) for an (n, words) uint64 array of the masks of n keys in order: each bit
    set in masks[0] and how many leading rows all have it, in no particular order.

    The running AND of the masks loses each bit once: the rows where it changes and the bits
    lost there come from numpy, and no Python loop runs over rows or bits (map in C over the
    lost values when each is one bit, the usual case; else numpy unpacks them).
    """
    n = len(masks)
    if not n:
        return [], []
    held = np.bitwise_and.accumulate(masks, axis=0)  # held[i]: bits of every row 0..i
    if held.shape[1] == 1:
        flat = held.reshape(-1)
        change = flat[:-1] ^ flat[1:]  # the bits lost after row i (length i + 1)
        at = np.flatnonzero(change)
        lost = change[at].tolist()
        ends = (at + 1).tolist()
        last = flat.item(n - 1)
        if last:
            lost.append(last)
            ends.append(n)
        if sum(map(int.bit_count, lost)) == len(lost):  # one bit lost at a time
            return list(map(int.bit_length, map(rshift, lost, repeat(1)))), ends
    # several bits lost at once, or several words: unpack the lost bits, one row per change
    at = np.flatnonzero((held[:-1] != held[1:]).any(axis=1))
    lost = np.concatenate((held[at] & ~held[at + 1], held[-1:])).astype("<u8", copy=False)
    ends = np.append(at + 1, n)
    lengths = ends @ np.unpackbits(lost.view(np.uint8), axis=1, bitorder="little")  # a bit is lost once
    bits = np.flatnonzero(lengths)
    return bits.tolist(), lengths[bits].tolist()


def _row_to_int(row: np.ndarray) -> int:
    mask = 0
    for w, word in enumerate(row.tolist()):
        mask |= word << (w << 6)
    return mask
