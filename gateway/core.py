"""The gateway's parts, built once from the config, and their background work.

GatewayCore assembles the router (with its rules and tokenizers), admission (tenants, pool
queues, retry budgets), the fleet (health checks, KV events, breakers), the upstream clients,
metrics, the Redis client and the API-key store; build_app hands each endpoint exactly the parts
it uses. start() and stop() run the background work: health checks, KV-event subscribers, the
admission queues' timeouts, and the policy-file watcher.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Mapping
from pathlib import Path

from admission.redis_buckets import RedisBuckets, SharedBuckets
from admission.token_bucket import LocalBuckets
from gateway.admission import admission_from_config, pool_concurrency_ceiling
from gateway.auth import KeyStore
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.peers import PeerLink
from gateway.registry_watch import RegistryWatcher
from gateway.routing_config import PolicyFileWatcher, prompt_token_limits, routing_rules, tenant_cache_salts
from gateway.shutdown import Shutdown
from gateway.telemetry import Telemetry
from gateway.upstream_http import UpstreamClient
from kvgate.config import KvgateConfig
from kvgate.offload import Offloader
from kvgate.tasks import stop_tasks
from router.router import Router
from router.tokenization import RoutingTokenizer
from router.types import WorkerSpec

log = logging.getLogger("kvgate.gateway")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default, for remote workers that say nothing else
SLOW_STOP_STEP_S = 1.0


class GatewayCore:
    def __init__(self, config: KvgateConfig, tokenizer_dirs: Mapping[str, Path] | None = None,
                 rng: random.Random | None = None) -> None:
        """Raises ConfigError (naming the YAML path) for routing rules the router cannot use."""
        rules = routing_rules(config)
        self.config = config
        self.started_at = int(time.time())  # the models' `created` (a gateway serves them from then)
        self.metrics = GatewayMetrics()
        self.telemetry = Telemetry.from_config(config)
        self.rng = rng or random.Random()
        self.upstream = UpstreamClient()  # completions, health checks and metrics scrapes
        self.shutdown = Shutdown()  # begun by the server as it stops (gateway/server.py)
        self.offload = Offloader(config.limits.offload_min_bytes)  # a large request's parse, tokenizing, encoding
        self.tokenizers = _routing_tokenizers(config, tokenizer_dirs or {})
        max_model_lens = prompt_token_limits(config)
        self.router = Router(_worker_specs(config), rules, tokenizers=self.tokenizers, rng=self.rng,
                             max_model_lens=max_model_lens, tenant_cache_salts=tenant_cache_salts(config),
                             pool_models={name: pool.model for name, pool in config.pools.items()},
                             slow_start_s={name: pool.slow_start_s for name, pool in config.pools.items()})
        # the longest prompt any pool takes (None while some pool's limit is unknown)
        self.longest_prompt_tokens = (max(max_model_lens.values())
                                      if max_model_lens and len(max_model_lens) == len(config.pools) else None)
        self.fleet = Fleet(config, self.router, self.metrics, self.upstream)
        self.redis = _redis_client(config.redis.url)
        self.keys = KeyStore(config.auth, dict(os.environ), redis_client=self.redis)
        # tenant limits: in this process, or in Redis shared by every replica (each replica's share locally while
        # Redis is unreachable)
        self.buckets = LocalBuckets() if self.redis is None else SharedBuckets(
            RedisBuckets(self.redis), config.redis.replicas, on_change=_log_limits_state)
        self.admission = admission_from_config(config, self.metrics, self.buckets, redis_client=self.redis)
        self.models = {pool.model: name for name, pool in config.pools.items()}
        self.metrics.start_series(config.pools, self.fleet.workers)
        self.metrics.watch_router(self.router.stats)
        self.metrics.watch_fleet(self.fleet.kv_events_applied, self.fleet.healthy_per_pool)
        self.metrics.watch_admission(lambda: {name: pool.state() for name, pool in self.admission.pools.items()},
                                     shared_limits=self.limits_shared)
        routing = config.routing
        self.policy_watcher = None if routing.policies_file is None else PolicyFileWatcher(
            routing.policies_file, list(config.pools), self.router, self.metrics, routing.policies_watch_interval_s)
        # with Redis: routing decisions, load and breaker changes shared with the other replicas, and
        # workers that register themselves
        self.peers = self.registry = None
        if self.redis is not None:
            self.peers = PeerLink(config.redis.url, self.redis, on_routed=self.router.peer_routed,
                                  on_breaker=self.fleet.peer_breaker_change,
                                  breaker_reset_s=config.breaker.reset_timeout_s, own_load=self.router.own_load,
                                  on_load=self.router.peer_load, expire_loads=self.router.expire_peer_loads)
            self.router.on_routed = self.peers.routed
            self.fleet.on_breaker_change = self.peers.breaker_changed
            self.registry = RegistryWatcher(config, self.redis, self.fleet, DEFAULT_BLOCK_SIZE, self._pool_resized)
        self.metrics.watch_shared_state(self.shared_state)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.fleet.start()
        if self.peers is not None:
            await self.peers.start(self.fleet.workers)
        if self.registry is not None:
            await self.registry.poll()  # registered workers join before the gateway takes requests
            self._tasks.append(asyncio.create_task(self.registry.run(), name="worker-registry"))
        self._tasks.append(asyncio.create_task(self.admission.run_expiry(), name="admission-expiry"))
        await self.admission.start_budget_sync()
        if self.policy_watcher is not None:
            self._tasks.append(asyncio.create_task(self.policy_watcher.run(), name="policy-file-watcher"))

    async def stop(self) -> None:
        """Stop the background work and close the clients, in order; a step slower than
        SLOW_STOP_STEP_S is logged by name (a stop that hangs says where)."""
        steps = [("background tasks", lambda: stop_tasks(self._tasks)),
                 ("tenant limit updates", self.admission.limits.settled),
                 ("retry budget sync", self.admission.stop_budget_sync)]
        if self.peers is not None:
            steps.append(("peer link", self.peers.aclose))
        if isinstance(self.buckets, SharedBuckets):
            steps.append(("shared limits probe", self.buckets.aclose))
        steps += [("fleet", self.fleet.stop), ("upstream client", self.upstream.aclose),
                  ("offload threads", lambda: asyncio.to_thread(self.offload.close)),
                  ("key store", self.keys.aclose),
                 ("trace export", lambda: asyncio.to_thread(self.telemetry.shutdown))]
        if self.redis is not None:
            steps.append(("redis client", self.redis.aclose))
        for name, step in steps:
            started = time.monotonic()
            await step()
            if (took_s := time.monotonic() - started) > SLOW_STOP_STEP_S:
                log.warning("stopping: %s took %.1f s", name, took_s)

    def reload_policies(self) -> None:
        """SIGHUP: reload routing.policies_file now (signal-safe); without one, say so in the log."""
        if self.policy_watcher is not None:
            self.policy_watcher.request_reload()
        else:
            log.info("SIGHUP: no routing.policies_file to reload")

    def limits_shared(self) -> bool | None:
        """None without Redis; else whether tenant limits are kept in Redis now (False: each
        replica enforces its share locally until Redis answers again)."""
        return None if not isinstance(self.buckets, SharedBuckets) else self.buckets.state == "redis"

    def _pool_resized(self, pool: str, registered_workers: int) -> None:
        """Workers registered in pool or left it: its admission limit scales to what they run."""
        self.admission.pools[pool].set_max_limit(pool_concurrency_ceiling(self.config.pools[pool], registered_workers))

    def shared_state(self) -> dict[str, bool] | None:
        """None without Redis; else, for each kind of state replicas share, whether it is shared now
        (False: this replica runs on its own view of it until Redis answers)."""
        if self.redis is None:
            return None
        return {"tenant_limits": self.limits_shared() is not False, "retry_budgets": self.admission.budgets_shared(),
                "peers": self.peers.state == "redis", "registry": self.registry.state == "redis"}

    async def redis_ok(self) -> bool | None:
        """None without Redis; False while the key store knows it unreachable (no PING waited on);
        else whether it answers a PING within 0.5 s."""
        if self.redis is None:
            return None
        if self.keys.redis_down:
            return False
        try:
            return bool(await self.redis.ping())
        except Exception:  # any Redis failure means: serving on local state
            return False


def _log_limits_state(state: str) -> None:
    if state == "redis":
        log.info("tenant limits are shared through Redis again")
    else:
        log.warning("Redis unreachable: tenant limits are enforced locally, each replica its share, until it answers")


def _redis_client(url: str | None):
    """An asyncio Redis client with short timeouts, so a dead Redis never stalls a request."""
    if url is None:
        return None
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)


def _worker_specs(config: KvgateConfig) -> dict[str, list[WorkerSpec]]:
    specs: dict[str, list[WorkerSpec]] = {}
    for name, pool in config.pools.items():
        specs[name] = []
        for w in pool.workers:
            block_size = w.block_size or (w.launch.block_size if w.launch else None) or DEFAULT_BLOCK_SIZE
            num_blocks = w.num_blocks or (w.launch.num_blocks if w.launch else None)
            specs[name].append(WorkerSpec(w.name, pool.model, block_size, num_blocks))
    return specs


def _routing_tokenizers(config: KvgateConfig, dirs: Mapping[str, Path]) -> dict[str, RoutingTokenizer]:
    """One routing tokenizer per served model, from the folder resolved for its pool."""
    tokenizers = {}
    for name, pool in config.pools.items():
        folder = dirs.get(name)
        if folder is not None:
            tokenizers[pool.model] = RoutingTokenizer.from_dir(folder)
    return tokenizers
