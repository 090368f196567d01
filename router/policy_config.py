"""YAML routing policies: named rules (match -> pool, policy, fallback_pool), validated and reloadable."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import signal
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from router.policies import build_params
from router.types import RouteRequest

_TOP_KEYS = {"rules"}
_RULE_KEYS = {"name", "match", "pool", "policy", "fallback_pool"}
_MATCH_KEYS = {"model", "tenant", "priority", "header", "path"}
_POLICY_KEYS = {"type", "parameters"}


class PolicyConfigError(ValueError):
    """A bad policy file; the message starts with the YAML path, e.g. rules[2].pool."""


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """All given fields must match; model and path accept shell wildcards (fnmatch)."""

    model: str | None = None
    tenant: str | None = None
    priority: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    path: str | None = None

    def matches(self, req: RouteRequest) -> bool:
        if self.model is not None and not fnmatch.fnmatchcase(req.model, self.model):
            return False
        if self.tenant is not None and req.tenant != self.tenant:
            return False
        if self.priority is not None and req.priority != self.priority:
            return False
        if self.path is not None and not fnmatch.fnmatchcase(req.path, self.path):
            return False
        return all(req.headers.get(name) == value for name, value in self.headers)


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """One named rule: requests it matches go to pool with this policy (fallback_pool if empty)."""

    name: str
    match: RuleMatch
    pool: str
    policy_type: str
    policy_params: Any
    fallback_pool: str | None = None


@dataclass(frozen=True, slots=True)
class RoutingPolicies:
    """Rules in file order; the first that matches wins."""

    rules: tuple[RoutingRule, ...]

    def select(self, req: RouteRequest) -> RoutingRule | None:
        return next((rule for rule in self.rules if rule.match.matches(req)), None)


def load_policies(text: str, *, known_pools: Collection[str] | None = None) -> RoutingPolicies:
    """Parse and validate a policy file's text; raises PolicyConfigError naming the YAML path."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyConfigError(yaml_error_message(exc)) from None
    _require_map(doc, "(top level)", _TOP_KEYS)
    raw_rules = doc.get("rules")
    if not isinstance(raw_rules, list) or not raw_rules:
        raise PolicyConfigError("rules: must be a non-empty list")
    rules: list[RoutingRule] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raw_rules):
        rule = _rule(raw, f"rules[{i}]", known_pools)
        if rule.name in seen:
            raise PolicyConfigError(f"rules[{i}].name: duplicate rule name {rule.name!r} (also rules[{seen[rule.name]}])")
        seen[rule.name] = i
        rules.append(rule)
    return RoutingPolicies(tuple(rules))


def yaml_error_message(exc: yaml.YAMLError) -> str:
    """A YAML syntax error on one line: `not valid YAML at line 3, column 7: <problem>`."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"not valid YAML{where}: {problem}"


def _rule(raw: Any, path: str, known_pools: Collection[str] | None) -> RoutingRule:
    _require_map(raw, path, _RULE_KEYS)
    name = _string(raw.get("name"), f"{path}.name")
    pool = _pool(raw.get("pool"), f"{path}.pool", known_pools)
    fallback = raw.get("fallback_pool")
    fallback = None if fallback is None else _pool(fallback, f"{path}.fallback_pool", known_pools)
    policy_type, params = _policy(raw.get("policy", {"type": "kv_aware"}), f"{path}.policy")
    return RoutingRule(name, _match(raw.get("match", {}), f"{path}.match"), pool, policy_type, params, fallback)


def _match(raw: Any, path: str) -> RuleMatch:
    if raw is None:
        return RuleMatch()
    _require_map(raw, path, _MATCH_KEYS)
    priority = raw.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise PolicyConfigError(f"{path}.priority: must be an integer, got {priority!r}")
    headers = raw.get("header", {}) or {}
    if not isinstance(headers, dict):
        raise PolicyConfigError(f"{path}.header: must be a map of header name to value")
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, (str, int)) or isinstance(value, bool):
            raise PolicyConfigError(f"{path}.header.{name}: must be a string value")
    return RuleMatch(
        model=_optional_string(raw.get("model"), f"{path}.model"),
        tenant=_optional_string(raw.get("tenant"), f"{path}.tenant"),
        priority=priority,
        headers=tuple((str(n).lower(), str(v)) for n, v in headers.items()),
        path=_optional_string(raw.get("path"), f"{path}.path"),
    )


def _policy(raw: Any, path: str) -> tuple[str, Any]:
    _require_map(raw, path, _POLICY_KEYS)
    policy_type = _string(raw.get("type"), f"{path}.type")
    parameters = raw.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise PolicyConfigError(f"{path}.parameters: must be a map")
    try:
        return policy_type, build_params(policy_type, parameters)
    except ValueError as exc:
        raise PolicyConfigError(f"{path}.{exc}") from None


def _require_map(raw: Any, path: str, allowed: set[str]) -> None:
    if not isinstance(raw, dict):
        raise PolicyConfigError(f"{path}: must be a map, got {type(raw).__name__}")
    for key in raw:
        if key not in allowed:
            where = key if path == "(top level)" else f"{path}.{key}"
            raise PolicyConfigError(f"{where}: unknown key (allowed: {', '.join(sorted(allowed))})")


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise PolicyConfigError(f"{path}: must be a non-empty string")
    return value


def _optional_string(value: Any, path: str) -> str | None:
    return None if value is None else _string(value, path)


def _pool(value: Any, path: str, known_pools: Collection[str] | None) -> str:
    pool = _string(value, path)
    if known_pools is not None and pool not in known_pools:
        raise PolicyConfigError(f"{path}: unknown pool {pool!r}")
    return pool


class PolicyStore:
    """The current policies from a file; reloads on SIGHUP or mtime change, keeps the old on error.

    Its errors read `<file>: <yaml.path>: <problem>`.
    """

    def __init__(self, path: str | Path, *, known_pools: Collection[str] | None = None) -> None:
        self.path = Path(path)
        self.known_pools = known_pools
        self.version = 0
        self.reload_failures = 0
        self.last_error: str | None = None
        self._reload_requested = False
        self._stamp = self._file_stamp()
        self.policies = self._load()  # a bad file at start is fatal: raise

    def request_reload(self) -> None:
        """Ask for a reload at the next maybe_reload() (safe to call from a signal handler)."""
        self._reload_requested = True

    def install_sighup(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """SIGHUP -> request_reload(); through the event loop when one is given."""
        if loop is not None:
            loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        else:
            signal.signal(signal.SIGHUP, lambda signum, frame: self.request_reload())

    def maybe_reload(self) -> bool:
        """Reload if asked or the file changed; True when new policies were installed."""
        stamp = self._file_stamp()
        if not self._reload_requested and stamp == self._stamp:
            return False
        self._reload_requested = False
        self._stamp = stamp
        try:
            self.policies = self._load()
        except PolicyConfigError as exc:
            self.reload_failures += 1
            self.last_error = str(exc)
            return False
        return True

    def _load(self) -> RoutingPolicies:
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyConfigError(f"{self.path}: cannot read the file: {exc.strerror}") from None
        try:
            policies = load_policies(text, known_pools=self.known_pools)
        except PolicyConfigError as exc:
            raise PolicyConfigError(f"{self.path}: {exc}") from None
        self.version += 1
        self.last_error = None
        return policies

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)
