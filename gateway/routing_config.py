"""Router inputs built from the parsed configuration (rules, prompt limits, cache salts), and the
policy file's reloads.

Without routing.policies_file each pool routes its own model with its own policy; with one, its
rules decide. Either way the router checks every policy type and parameter here, at start, and
errors name the YAML path the user wrote. A running gateway reloads the policy file on SIGHUP and
when the file changes (checked every routing.policies_watch_interval_s); a bad file keeps the
rules in force, and says so in the log and in kvgate_policy_reloads_total{outcome="error"}.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

from gateway.metrics import GatewayMetrics
from kvgate.config import ConfigError, FallbackConfig, KvgateConfig, PoolConfig, RuleConfig, load_policy_file
from router.router import Router
from router.rules import Fallback, RoutingRule, RoutingRules, RuleMatch, rule

log = logging.getLogger("kvgate.gateway")
T = TypeVar("T")


def routing_rules(config: KvgateConfig) -> RoutingRules:
    """The rules the gateway starts with; ConfigError naming the YAML path (and file) otherwise."""
    path = config.routing.policies_file
    if path is None:
        return RoutingRules(tuple(_pool_rule(name, pool) for name, pool in config.pools.items()))
    try:
        return rules_from_file(path, config.pools)
    except ConfigError as exc:
        raise ConfigError("routing.policies_file", f"{path}: {exc}") from None


def prompt_token_limits(config: KvgateConfig) -> dict[str, int]:
    """Router(max_model_lens=...): pool -> the most prompt tokens routed there (pools.<name>.max_model_len,
    else what every worker's launch section allows); a pool with no known limit is left out."""
    limits = {name: pool.prompt_token_limit() for name, pool in config.pools.items()}
    return {name: limit for name, limit in limits.items() if limit is not None}


def tenant_cache_salts(config: KvgateConfig) -> dict[str, str]:
    """Router(tenant_cache_salts=...): tenant -> salt, for tenants.<name>.cache_isolation."""
    return config.cache_salts()


def rules_from_file(path: str | Path, pools: Collection[str]) -> RoutingRules:
    """The rules of a policy file whose pools must be among pools; ConfigError naming the YAML path."""
    policy_file = load_policy_file(path)
    return RoutingRules(tuple(_file_rule(r, f"rules[{i}]", pools) for i, r in enumerate(policy_file.rules)))


def _pool_rule(name: str, pool: PoolConfig) -> RoutingRule:
    policy = pool.policy
    return _at(f"pools.{name}.policy", lambda: rule(name, name, policy_type=policy.type, parameters=policy.parameters,
                                                     match=RuleMatch(model=pool.model),
                                                     fallbacks=_fallbacks(pool.fallbacks)))


def _fallbacks(configs: tuple[FallbackConfig, ...]) -> tuple[Fallback, ...]:
    return tuple(Fallback(f.pool, frozenset(f.when)) for f in configs)


def _file_rule(config: RuleConfig, where: str, pools: Collection[str]) -> RoutingRule:
    if config.pool not in pools:
        raise ConfigError(f"{where}.pool", f"unknown pool {config.pool!r}")
    if config.fallback_pool is not None and config.fallback_pool not in pools:
        raise ConfigError(f"{where}.fallback_pool", f"unknown pool {config.fallback_pool!r}")
    for i, fallback in enumerate(config.fallbacks):
        if fallback.pool not in pools:
            raise ConfigError(f"{where}.fallbacks[{i}].pool", f"unknown pool {fallback.pool!r}")
    m = config.match
    match = RuleMatch(model=m.model, tenant=m.tenant, priority=m.priority, path=m.path,
                      headers=tuple((name.lower(), value) for name, value in m.header.items()))
    policy = config.policy
    return _at(f"{where}.policy", lambda: rule(config.name, config.pool, policy_type=policy.type,
                                                parameters=policy.parameters, match=match,
                                                fallbacks=_fallbacks(config.fallback_list())))


def _at(where: str, build: Callable[[], T]) -> T:
    """build(), with the router's `type: ...` / `parameters.NAME: ...` errors placed under where."""
    try:
        return build()
    except ValueError as exc:
        key, _, problem = str(exc).partition(": ")
        raise ConfigError(f"{where}.{key}", problem) from None


class PolicyFileWatcher:
    """Installs a changed policy file's rules in the router: on request (SIGHUP) and when the
    file's mtime or size changes. run() is the watching task; request_reload() is signal-safe."""

    def __init__(self, path: str | Path, pools: Collection[str], router: Router, metrics: GatewayMetrics,
                 interval_s: float) -> None:
        self.path = Path(path)
        self._pools = pools
        self._router = router
        self._metrics = metrics
        self._interval_s = interval_s
        self._stamp = self._file_stamp()
        self._requested = False
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def request_reload(self) -> None:
        """Reload now, whether or not the file changed (a SIGHUP handler may call this)."""
        self._requested = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            self.reload_if_changed()

    def reload_if_changed(self) -> bool:
        """Reload when the file changed or a reload was requested; True when new rules went in."""
        stamp = self._file_stamp()
        if not self._requested and stamp == self._stamp:
            return False
        self._requested, self._stamp = False, stamp
        try:
            rules = rules_from_file(self.path, self._pools)
        except ConfigError as exc:
            log.warning("routing policies not reloaded, the previous rules stay: %s: %s", self.path, exc)
            self._metrics.policy_reloads.labels(outcome="error").inc()
            return False
        self._router.set_rules(rules)
        log.info("routing policies reloaded from %s", self.path)
        self._metrics.policy_reloads.labels(outcome="ok").inc()
        return True

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)
