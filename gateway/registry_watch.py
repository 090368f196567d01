"""Pool membership from the worker registry in Redis (kvgate/registry.py): who joins, who leaves.

Every poll_interval_s the watcher reads the registry and brings the fleet in line: a worker
registered for one of this gateway's pools, with the pool's model, joins it (the fleet follows
its KV events and health-checks it); a registered worker whose record has lapsed (heartbeats
stopped for its TTL) or was withdrawn leaves, with its KV-index entries. Workers listed in the
config are never touched, and a registered name that clashes with one is refused (logged once).

While Redis is unreachable the registered workers stay as they were: each keeps serving while its
health checks pass, and the watcher catches up when Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from admission.redis_buckets import REDIS_ERRORS
from gateway.fleet import Fleet
from kvgate.config import ConfigError, KvgateConfig, WorkerConfig
from kvgate.registry import WorkerRecord, read_registry
from router.types import WorkerSpec

log = logging.getLogger("kvgate.gateway")


class RegistryWatcher:
    def __init__(self, config: KvgateConfig, client, fleet: Fleet, default_block_size: int,
                 on_pool_change: Callable[[str, int], None]) -> None:
        """on_pool_change(pool, registered workers in it now): after each join or leave."""
        self._config = config
        self._client = client
        self._fleet = fleet
        self._default_block_size = default_block_size
        self._on_pool_change = on_pool_change
        self._static = {w.name for pool in config.pools.values() for w in pool.workers}
        self.registered: dict[str, WorkerRecord] = {}  # the workers this watcher added, as announced
        self._refused: dict[str, WorkerRecord] = {}  # logged once each, until the record changes
        self.state = "redis"

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._config.redis.registry_poll_interval_s)

    async def poll(self) -> None:
        """Read the registry once and apply what changed."""
        try:
            records = await read_registry(self._client)
        except REDIS_ERRORS as exc:
            self._set_state("local", exc)
            return
        self._set_state("redis")
        for name, record in list(self.registered.items()):
            if records.get(name) != record:  # lapsed, withdrawn, or announced anew with other details
                del self.registered[name]
                await self._fleet.remove_worker(name)
                self._pool_changed(record.pool)
        for name, record in records.items():
            if name not in self.registered and self._accepts(record):
                await self._join(record)

    def _accepts(self, record: WorkerRecord) -> bool:
        problem = None
        pool = self._config.pools.get(record.pool)
        if record.name in self._static:
            problem = "its name is a configured worker's"
        elif pool is None:
            problem = f"no pool {record.pool!r} here (pools: {', '.join(self._config.pools)})"
        elif record.model != pool.model:
            problem = f"it serves {record.model!r}, pool {record.pool!r} serves {pool.model!r}"
        if problem is None:
            self._refused.pop(record.name, None)
            return True
        if self._refused.get(record.name) != record:
            log.warning("registered worker %s not added: %s", record.name, problem)
            self._refused[record.name] = record
        return False

    async def _join(self, record: WorkerRecord) -> None:
        try:
            config = WorkerConfig(record.name, record.url, kv_events_endpoint=record.kv_events_endpoint)
        except ConfigError as exc:
            if self._refused.get(record.name) != record:
                log.warning("registered worker %s not added: %s", record.name, exc)
                self._refused[record.name] = record
            return
        spec = WorkerSpec(record.name, record.model, self._default_block_size, None)  # the worker says the rest
        self.registered[record.name] = record
        await self._fleet.add_worker(record.pool, config, spec)
        self._pool_changed(record.pool)

    def _pool_changed(self, pool: str) -> None:
        self._on_pool_change(pool, sum(1 for r in self.registered.values() if r.pool == pool))

    def _set_state(self, state: str, exc: BaseException | None = None) -> None:
        if state == self.state:
            return
        self.state = state
        if exc is not None:
            log.warning("worker registry unreadable (%s): registered workers stay as they are until Redis answers",
                        exc)
        else:
            log.info("worker registry readable again")
