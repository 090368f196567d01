"""Routing rules: which pool and policy a request goes to (the first rule whose match fits wins).

The rules are built from the parsed configuration by the gateway (gateway/routing_config.py);
this module only matches requests against them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.policies import build_params
from router.types import RouteRequest


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """All given fields must match; model and path accept shell wildcards (fnmatch; a value equal
    to the pattern matches it, brackets included); header names are lower case."""

    model: str | None = None
    tenant: str | None = None
    priority: str | None = None  # an admitted class name
    headers: tuple[tuple[str, str], ...] = ()
    path: str | None = None

    def matches(self, req: RouteRequest) -> bool:
        if self.model is not None and req.model != self.model and not fnmatch.fnmatchcase(req.model, self.model):
            return False
        if self.tenant is not None and req.tenant != self.tenant:
            return False
        if self.priority is not None and req.priority != self.priority:
            return False
        if self.path is not None and req.path != self.path and not fnmatch.fnmatchcase(req.path, self.path):
            return False
        return not self.headers or all(req.headers.get(name) == value for name, value in self.headers)


FALLBACK_REASONS = ("overloaded", "unavailable", "context_length_exceeded")


@dataclass(frozen=True, slots=True)
class Fallback:
    """A pool a rule's requests may move to, and the reasons (FALLBACK_REASONS) that move them there."""

    pool: str
    when: frozenset[str]

    def __post_init__(self) -> None:
        if unknown := self.when - set(FALLBACK_REASONS):
            raise ValueError(f"fallbacks: unknown reason(s) {sorted(unknown)}")


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """One named rule: requests it matches go to pool with this policy, or to its fallbacks in order
    (each for the reasons it lists). policy_params are the policy's validated parameters
    (router.policies.build_params)."""

    name: str
    match: RuleMatch
    pool: str
    policy_type: str
    policy_params: Any
    fallbacks: tuple[Fallback, ...] = ()


@dataclass(frozen=True, slots=True)
class RoutingRules:
    """Rules in order; the first that matches wins."""

    rules: tuple[RoutingRule, ...]

    def select(self, req: RouteRequest) -> RoutingRule | None:
        return next((rule for rule in self.rules if rule.match.matches(req)), None)


def rule(name: str, pool: str, *, policy_type: str = "kv_aware", parameters: Mapping[str, Any] | None = None,
         match: RuleMatch = RuleMatch(), fallbacks: Sequence[Fallback] = (),
         fallback_pool: str | None = None) -> RoutingRule:
    """A rule with its policy's parameters validated; ValueError('type: ...' or 'parameters.NAME: ...').
    fallback_pool: short for one fallback there when the pool is unavailable."""
    if fallback_pool is not None:
        fallbacks = (*fallbacks, Fallback(fallback_pool, frozenset({"unavailable"})))
    return RoutingRule(name, match, pool, policy_type, build_params(policy_type, parameters or {}), tuple(fallbacks))
