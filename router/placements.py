"""Where each prefix was placed last: a bounded memory that outlives the workers' caches.

The index forgets a prefix once its blocks are evicted and its prediction has expired; a cache-aware
policy then has nothing to say where the prefix belongs, and load alone places it, often on a worker
whose cache holds other prefixes: two caches end up with copies, and each evicts more. Placements
remembers, for a few depths of each routed prompt (blocks 1, 2, 4, 8, ...: keys[2^k - 1]), the worker
it went to last. A prompt's home is the worker of the deepest remembered depth it shares: for a
conversation, the worker of its own last turn rather than that of the system prompt it shares, where
its own turns reach a remembered depth; a conversation with a session id is remembered as such.

It also counts, per worker, the prefixes that call it home, among the most recently placed max_prefixes:
a conversation (its session id) counts as one prefix of its own, any other prompt by its first block. A
policy placing a prefix no worker holds, or a conversation's first turn, uses the counts to keep each
worker's share of prefixes even (each cache then holds its share), as a load snapshot cannot: a prefix
or a conversation, once placed, brings its later prompts with it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

DEFAULT_MAX_ENTRIES = 65_536  # ~10 MiB: depths of ~6,000 prompts of 4,096 tokens in 16-token blocks
DEFAULT_MAX_PREFIXES = 4_096  # prefixes (first blocks) counted: the most recently placed


class Placements:
    """Block key -> the worker a prompt with that key at one of its remembered depths went to last."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_prefixes: int = DEFAULT_MAX_PREFIXES) -> None:
        if max_entries < 1 or max_prefixes < 1:
            raise ValueError("max_entries and max_prefixes must be >= 1")
        self.max_entries = max_entries
        self.max_prefixes = max_prefixes
        self._last: OrderedDict[int, str] = OrderedDict()
        self._prefixes: OrderedDict[int | str, str] = OrderedDict()  # prefix -> its worker, last placed last
        self._prefix_counts: Counter[str] = Counter()

    def record(self, keys: Sequence[int], worker_id: str, session_id: str | None = None) -> None:
        """A prompt with these keys (of the conversation session_id, if given) was placed on
        worker_id (the least recently placed go first)."""
        if not keys:
            return
        last = self._last
        for depth in _depths(len(keys)):
            key = keys[depth]
            last[key] = worker_id
            last.move_to_end(key)
        while len(last) > self.max_entries:
            last.popitem(last=False)
        prefixes, counts = self._prefixes, self._prefix_counts
        prefix = keys[0] if session_id is None else session_id
        before = prefixes.get(prefix)
        if before != worker_id:
            if before is not None:
                counts[before] -= 1
            counts[worker_id] += 1
            prefixes[prefix] = worker_id
        prefixes.move_to_end(prefix)
        if len(prefixes) > self.max_prefixes:
            _, gone = prefixes.popitem(last=False)
            counts[gone] -= 1

    def prefixes_per_worker(self) -> Mapping[str, int]:
        """How many of the recently placed prefixes (first blocks, or conversations) each worker is the
        home of (a worker with none may be absent)."""
        return self._prefix_counts

    def home(self, keys: Sequence[int], session_id: str | None = None) -> str | None:
        """The worker the conversation session_id went to last, if it is among the recently placed
        prefixes; else the worker of the deepest remembered depth of keys (None: none remembered)."""
        if session_id is not None and (worker := self._prefixes.get(session_id)) is not None:
            return worker
        get = self._last.get
        for depth in reversed(_depths(len(keys))):
            worker = get(keys[depth])
            if worker is not None:
                return worker
        return None

    def forget_worker(self, worker_id: str) -> None:
        """worker_id left the fleet: none of its placements is a home any longer."""
        self._last = OrderedDict((key, w) for key, w in self._last.items() if w != worker_id)
        self._prefixes = OrderedDict((key, w) for key, w in self._prefixes.items() if w != worker_id)
        self._prefix_counts.pop(worker_id, None)

    def __len__(self) -> int:
        return len(self._last)


def _depths(num_keys: int) -> list[int]:
    """0, 1, 3, 7, ... below num_keys: the indices of blocks 1, 2, 4, 8, ..."""
    depths, depth = [], 0
    while depth < num_keys:
        depths.append(depth)
        depth = 2 * depth + 1
    return depths
