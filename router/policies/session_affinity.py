"""session_affinity: consistent-hash ring (virtual nodes) on a session key, with bounded load."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from router.policies.base import check_number, check_str, explain, over_bound
from router.policies.least_load import load_key
from router.types import RouteDecision, RouteRequest, WorkerView

_hash = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class SessionAffinityParams:
    """key_header: lower-case header holding the session key (x-session-id uses req.session_id)."""

    key_header: str = "x-session-id"
    virtual_nodes: int = 100
    epsilon: float = 0.25

    def __post_init__(self) -> None:
        check_str("key_header", self.key_header)
        check_number("virtual_nodes", self.virtual_nodes, minimum=1, maximum=10_000, integer=True)
        check_number("epsilon", self.epsilon, minimum=0)


class SessionAffinity:
    """rank = distinct workers clockwise from xxh3_64(key) on the ring; workers over the bound

    ceil((1 + epsilon) * (total requests + 1) / n) move to the end. No key: least load.
    """

    name = "session_affinity"

    def __init__(self, params: SessionAffinityParams = SessionAffinityParams(), *, rng: random.Random | None = None) -> None:
        self.params = params
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        key = self._session_key(req)
        if key is None:
            ranked = sorted(workers, key=load_key)
            return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked, note="no session key"))
        by_id = {w.worker_id: (w, hot) for w, hot in zip(workers, over_bound(workers, self.params.epsilon))}
        walk = self._walk(tuple(sorted(by_id)), _hash(key.encode("utf-8")))
        fits = [by_id[w][0] for w in walk if not by_id[w][1]]
        over = [by_id[w][0] for w in walk if by_id[w][1]]
        ranked = fits + over
        note = "ring owner over load bound" if over and ranked[0] is not by_id[walk[0]][0] else None
        return RouteDecision(self.name, tuple(w.worker_id for w in ranked), explain(ranked, note=note))

    def _session_key(self, req: RouteRequest) -> str | None:
        if self.params.key_header == "x-session-id" and req.session_id:
            return req.session_id
        return req.headers.get(self.params.key_header) or None

    def _walk(self, worker_ids: tuple[str, ...], point: int) -> list[str]:
        """Distinct workers in ring order starting at the first virtual node >= point."""
        points, owners = self._ring(worker_ids)
        start = bisect.bisect_left(points, point)
        seen: dict[str, None] = {}
        for i in range(len(points)):
            seen.setdefault(owners[(start + i) % len(points)])
            if len(seen) == len(worker_ids):
                break
        return list(seen)

    def _ring(self, worker_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(worker_ids)
        if ring is None:
            nodes = sorted(
                (_hash(f"{w}#{i}".encode()), w) for w in worker_ids for i in range(self.params.virtual_nodes)
            )
            ring = ([p for p, _ in nodes], [w for _, w in nodes])
            if len(self._rings) > 64:
                self._rings.clear()
            self._rings[worker_ids] = ring
        return ring
