"""Where each prefix was placed last: a bounded memory that outlives the workers' caches.

The index forgets a prefix once its blocks are evicted and its prediction has expired; a cache-aware
policy then has nothing to say where the prefix belongs, and load alone places it, often on a worker
whose cache holds other prefixes: two caches end up with copies, and each evicts more. Placements
remembers, for a few depths of each routed prompt (blocks 1, 2, 4, 8, ...: keys[2^k - 1]), the worker
it went to last. A prompt's home is the worker of the deepest remembered depth it shares: for a
conversation, the worker of its own last turn rather than that of the system prompt it shares.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_MAX_ENTRIES = 65_536  # ~10 MiB: depths of ~6,000 prompts of 4,096 tokens in 16-token blocks


class Placements:
    """Block key -> the worker a prompt with that key at one of its remembered depths went to last."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._last: OrderedDict[int, str] = OrderedDict()

    def record(self, keys: Sequence[int], worker_id: str) -> None:
        """A prompt with these keys was placed on worker_id (the least recently placed go first)."""
        last = self._last
        for depth in _depths(len(keys)):
            key = keys[depth]
            last[key] = worker_id
            last.move_to_end(key)
        while len(last) > self.max_entries:
            last.popitem(last=False)

    def home(self, keys: Sequence[int]) -> str | None:
        """The worker of the deepest remembered depth of keys (None: none remembered)."""
        get = self._last.get
        for depth in reversed(_depths(len(keys))):
            worker = get(keys[depth])
            if worker is not None:
                return worker
        return None

    def forget_worker(self, worker_id: str) -> None:
        """worker_id left the fleet: none of its placements is a home any longer."""
        self._last = OrderedDict((key, w) for key, w in self._last.items() if w != worker_id)

    def __len__(self) -> int:
        return len(self._last)


def _depths(num_keys: int) -> list[int]:
    """0, 1, 3, 7, ... below num_keys: the indices of blocks 1, 2, 4, 8, ..."""
    depths, depth = [], 0
    while depth < num_keys:
        depths.append(depth)
        depth = 2 * depth + 1
    return depths
