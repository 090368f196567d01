"""GatewayCore: everything a request needs, built once from the config (router, fleet, budgets)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import yaml

from admission.retry_budget import RetryBudget, RetryBudgetConfig
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.upstream_http import UpstreamClient
from kvgate.config import ConfigError, KvgateConfig, PoolConfig
from router.policy_config import PolicyConfigError, PolicyStore, RoutingPolicies, load_policies
from router.router import Router, WorkerSpec
from router.tokenization import RoutingTokenizer

log = logging.getLogger("kvgate.gateway")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default, for remote workers that say nothing else


class GatewayCore:
    def __init__(self, config: KvgateConfig, tokenizer_dirs: Mapping[str, Path] | None = None,
                 http: httpx.AsyncClient | None = None, rng: random.Random | None = None) -> None:
        self.config = config
        self.started_at = int(time.time())  # the models' `created` (a gateway serves them from then)
        self.metrics = GatewayMetrics()
        self.rng = rng or random.Random()
        self.http = http or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=60.0))
        self.upstream = UpstreamClient()  # completions traffic; self.http serves health checks and scrapes
        self.tokenizers = _routing_tokenizers(config, tokenizer_dirs or {})
        self.policies = _routing_policies(config)
        specs = _worker_specs(config)
        self.router = Router(specs, self.policies, tokenizers=self.tokenizers, rng=self.rng)
        # room for every block the workers say they hold, so the index does not grow under load
        self.router.index.reserve(sum(s.num_blocks or 0 for pool in specs.values() for s in pool))
        self.fleet = Fleet(config, self.router, self.metrics, self.http)
        up = config.upstream
        budget_config = RetryBudgetConfig(ratio=up.retry_budget_ratio, min_retries_per_s=up.retry_budget_min_per_s)
        self.budgets = {pool: RetryBudget(budget_config) for pool in config.pools}
        self.models = {pool.model: name for name, pool in config.pools.items()}
        self.metrics.start_series(config.pools, self.fleet.workers)
        self.redis = _redis_client(config.redis.url)

    async def start(self) -> None:
        await self.fleet.start()

    async def stop(self) -> None:
        await self.fleet.stop()
        await self.upstream.aclose()
        await self.http.aclose()
        if self.redis is not None:
            await self.redis.aclose()

    async def redis_ok(self) -> bool | None:
        """None without Redis; else whether it answers a PING within 0.5 s."""
        if self.redis is None:
            return None
        try:
            return bool(await self.redis.ping())
        except Exception:  # any Redis failure means: serving on local state
            return False

    def count_tokens(self, model: str, text: str) -> int:
        """Tokens in generated text, with the model's tokenizer (else ~4 bytes a token)."""
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None or tokenizer.mode != "exact":
            return max(1, len(text.encode()) // 4) if text else 0
        return len(tokenizer.encode_text(text))

    def encode_text(self, model: str) -> Callable[[str], list[int]] | None:
        tokenizer = self.tokenizers.get(model)
        return tokenizer.encode_text if tokenizer is not None and tokenizer.mode == "exact" else None

    def maybe_reload_policies(self) -> None:
        """Install the policy file's new rules if it changed (or SIGHUP asked); a bad file keeps the
        old rules, and says so in the log and in kvgate_policy_reloads_total{outcome="error"}."""
        store = self.policies
        if not isinstance(store, PolicyStore):
            return
        failures = store.reload_failures
        if store.maybe_reload():
            log.info("routing policies reloaded from %s (version %d)", store.path, store.version)
            self.metrics.policy_reloads.labels(outcome="ok").inc()
        elif store.reload_failures != failures:
            log.warning("routing policies not reloaded, the previous rules stay: %s", store.last_error)
            self.metrics.policy_reloads.labels(outcome="error").inc()


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


def _routing_policies(config: KvgateConfig) -> PolicyStore | RoutingPolicies:
    """The rules file when configured; otherwise one rule per pool (its model -> its policy)."""
    if config.routing.policies_file is not None:
        try:
            return PolicyStore(config.routing.policies_file, known_pools=list(config.pools))
        except (OSError, PolicyConfigError) as exc:
            raise ConfigError("routing.policies_file", str(exc)) from None
    rules = [_pool_rule(name, pool) for name, pool in config.pools.items()]
    try:
        return load_policies(yaml.safe_dump({"rules": rules}), known_pools=list(config.pools))
    except PolicyConfigError as exc:  # the loader checks each pool's policy first: a bug if reached
        raise ConfigError("", _pool_path(str(exc), list(config.pools))) from None


def _pool_rule(name: str, pool: PoolConfig) -> dict:
    return {"name": name, "match": {"model": pool.model}, "pool": name,
            "policy": {"type": pool.policy.type, "parameters": dict(pool.policy.parameters)}}


def _pool_path(message: str, pools: list[str]) -> str:
    """Point `rules[i].policy...` errors at the pool the user wrote: `pools.<pool>.policy...`."""
    for i, pool in enumerate(pools):
        prefix = f"rules[{i}]."
        if message.startswith(prefix):
            return f"pools.{pool}.{message[len(prefix):]}"
    return f"pools: {message}"
