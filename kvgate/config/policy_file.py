"""The routing-policy file (routing.policies_file): named rules, match -> pool + policy.

Loaded with the same loader as the gateway config (kvgate.config.load_policy_file); the router
checks the policies when the gateway builds its rules (gateway/routing_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.config.admission import PriorityName
from kvgate.config.loader import ConfigError
from kvgate.config.schema import FallbackConfig, PolicyConfig, check_fallbacks


@dataclass(frozen=True, slots=True)
class RuleMatchConfig:
    """Which requests a rule takes: every given field must match (none given: all requests)."""

    model: str | None = None  # shell wildcards allowed ("llama-*")
    tenant: str | None = None
    priority: PriorityName | None = None
    header: dict[str, str] = field(default_factory=dict)  # names are case-insensitive
    path: str | None = None  # wildcards allowed ("/v1/chat/*")


@dataclass(frozen=True, slots=True)
class RuleConfig:
    """One named rule: matching requests go to pool with policy, or move to its fallbacks in order (when each
    allows); `fallback_pool: X` is short for `fallbacks: [{pool: X, when: [unavailable]}]`."""

    name: str
    pool: str
    match: RuleMatchConfig = field(default_factory=RuleMatchConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    fallback_pool: str | None = None
    fallbacks: tuple[FallbackConfig, ...] = ()

    def __post_init__(self) -> None:
        for key in ("name", "pool", "fallback_pool"):
            if getattr(self, key) == "":
                raise ConfigError(key, "must be a non-empty string")
        if self.fallback_pool is not None and self.fallbacks:
            raise ConfigError("fallback_pool", "give fallbacks or fallback_pool, not both")
        check_fallbacks(self.pool, self.fallback_list(), "fallback_pool" if self.fallback_pool else "fallbacks")

    def fallback_list(self) -> tuple[FallbackConfig, ...]:
        """fallbacks, or fallback_pool as the one fallback it is short for."""
        if self.fallback_pool is not None:
            return (FallbackConfig(self.fallback_pool, ("unavailable",)),)
        return self.fallbacks


@dataclass(frozen=True, slots=True)
class PolicyFileConfig:
    """The routing-policy file: rules tried in order, the first that matches wins."""

    rules: tuple[RuleConfig, ...]

    def __post_init__(self) -> None:
        if not self.rules:
            raise ConfigError("rules", "must be a non-empty list")
        seen: dict[str, int] = {}
        for i, rule in enumerate(self.rules):
            if rule.name in seen:
                raise ConfigError(f"rules[{i}].name", f"duplicate rule name {rule.name!r} (also rules[{seen[rule.name]}])")
            seen[rule.name] = i
