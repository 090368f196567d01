"""A pool's capacity at the start of a run: closed loops straight at each of its workers (one more caller
than the worker runs at once, so it never idles), answered requests per second once warmed up, summed."""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from loadtest.cascade.client import Clients, ClientSettings
from loadtest.cascade.fleet import WorkerSpec
from loadtest.cascade.records import CallRecord
from loadtest.cascade.workload import Arrival, RequestShape, messages_for

PROBE_TENANT = "probe"


def answered_rps(records: Sequence[CallRecord], warmup_s: float, end_s: float) -> float:
    """Successes that ended within [warmup_s, end_s), per second."""
    if end_s <= warmup_s:
        raise ValueError("the window must not be empty")
    return sum(1 for r in records if r.ok and warmup_s <= r.end_s < end_s) / (end_s - warmup_s)


async def _probe_worker(worker: WorkerSpec, shape: RequestShape, concurrency: int, duration_s: float,
                        seed: int) -> list[CallRecord]:
    settings = ClientSettings(f"{worker.url}/v1", worker.model, {PROBE_TENANT: "none"}, shape.max_tokens,
                              max_retries=0)

    def make(i: int) -> Arrival:
        index = seed * 10**6 + i  # questions apart from the run's
        return Arrival(index, PROBE_TENANT, 0.0, messages_for(f"probe-{worker.name}", index, shape))

    async with Clients(settings) as clients:
        return await clients.closed_loop(make, concurrency, duration_s, time.monotonic())


def pool_capacity_rps(workers: Sequence[WorkerSpec], shape: RequestShape, max_num_seqs: int, duration_s: float,
                      warmup_s: float) -> dict[str, float]:
    """worker -> answered req/s in its closed loop, all of the pool's workers probed at once."""
    async def probe() -> list[list[CallRecord]]:
        return await asyncio.gather(*(_probe_worker(w, shape, max_num_seqs + 1, duration_s, i + 1)
                                      for i, w in enumerate(workers)))
    runs = asyncio.run(probe())
    return {w.name: answered_rps(records, warmup_s, duration_s) for w, records in zip(workers, runs)}
