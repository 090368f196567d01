"""Routing rules from the config: the policy file's messages, each pool's own policy, rule
selection, and the policy-file watcher's reloads."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import pytest

from gateway.metrics import GatewayMetrics
from gateway.routing_config import PolicyFileWatcher, routing_rules, rules_from_file
from kvgate.config import ConfigError, KvgateConfig, build
from router.policies.kv_aware import KvAwareParams
from router.router import Router
from router.rules import Fallback
from router.types import RouteRequest, WorkerSpec

REPO = Path(__file__).resolve().parents[2]
POOLS = ("fast", "slow", "p", "q")

GOOD = """
rules:
  - name: premium
    match: {tenant: acme, priority: critical, header: {X-Team: search}, model: "llama-*", path: "/v1/chat/*"}
    pool: fast
    policy: {type: kv_aware, parameters: {slack: 0.2}}
    fallback_pool: slow
  - name: everyone
    pool: slow
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policies.yaml"
    path.write_text(text)
    return path


def req(**kw: object) -> RouteRequest:
    fields = {"model": "llama-3", "messages": [], "path": "/v1/chat/completions"}
    fields.update(kw)
    return RouteRequest(**fields)  # type: ignore[arg-type]


def test_good_file_loads_with_validated_parameters(tmp_path) -> None:
    premium, everyone = rules_from_file(write(tmp_path, GOOD), POOLS).rules
    assert (premium.pool, premium.policy_type) == ("fast", "kv_aware")
    assert premium.fallbacks == (Fallback("slow", frozenset({"unavailable"})),)  # fallback_pool's meaning
    assert premium.policy_params == KvAwareParams(slack=0.2)
    assert premium.match.headers == (("x-team", "search"),)  # header names are case-insensitive
    assert everyone.policy_type == "kv_aware"


@pytest.mark.parametrize(
    ("request_fields", "rule"),
    [
        ({"tenant": "acme", "priority": "critical", "headers": {"x-team": "search"}}, "premium"),
        ({"tenant": "acme", "priority": "critical", "headers": {"x-team": "ads"}}, "everyone"),
        ({"tenant": "acme", "priority": "critical", "headers": {"x-team": "search"}, "model": "qwen"}, "everyone"),
        ({"tenant": "acme", "priority": "critical", "headers": {"x-team": "search"}, "path": "/v1/completions"}, "everyone"),
        ({"tenant": "other", "priority": "critical", "headers": {"x-team": "search"}}, "everyone"),
    ],
    ids=["all-match", "header-differs", "model-differs", "path-differs", "tenant-differs"],
)
def test_first_matching_rule_wins(tmp_path, request_fields: dict, rule: str) -> None:
    assert rules_from_file(write(tmp_path, GOOD), POOLS).select(req(**request_fields)).name == rule


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: []", "rules: must be a non-empty list"),
        ("rulez: []", "rulez: unknown key (expected one of: rules)"),
        ("rules: [{name: a, pool: p, colour: red}]",
         "rules[0].colour: unknown key (expected one of: name, pool, match, policy, fallback_pool, fallbacks)"),
        ("rules: [{name: a, pool: p}, {name: a, pool: q}]", "rules[1].name: duplicate rule name 'a' (also rules[0])"),
        ("rules: [{name: a}]", "rules[0].pool: required"),
        ("rules: [{name: a, pool: ''}]", "rules[0].pool: must be a non-empty string"),
        ("rules: [{name: a, pool: p, policy: {type: fastest}}]",
         "rules[0].policy.type: unknown policy type 'fastest' (known: kv_aware, least_load, power_of_two, prefix_approx, random, round_robin, session_affinity)"),
        ("rules: [{name: a, pool: p}, {name: b, pool: p}, {name: c, pool: p, policy: {type: least_load, parameters: {slack: 1}}}]",
         "rules[2].policy.parameters.slack: unknown parameter"),
        ("rules: [{name: a, pool: p, policy: {type: kv_aware, parameters: {slack: -0.5}}}]",
         "rules[0].policy.parameters.slack: must be >= 0, got -0.5"),
        ("rules: [{name: a, pool: p, policy: {type: kv_aware, params: {}}}]",
         "rules[0].policy.params: unknown key (expected one of: type, parameters)"),
        ("rules: [{name: a, pool: p, match: {user: x}}]",
         "rules[0].match.user: unknown key (expected one of: model, tenant, priority, header, path)"),
        ("rules: [{name: a, pool: p, match: {priority: high}}]",
         "rules[0].match.priority: must be one of: critical, standard, batch (got 'high')"),
        ("rules: [{name: a, pool: p, match: {header: [x]}}]", "rules[0].match.header: expected a mapping, got a list"),
        ("rules: [{name: a, pool: p, fallback_pool: [x]}]", "rules[0].fallback_pool: expected a string, got a list"),
        ("rules: [{name: a, pool: p, fallback_pool: nowhere}]", "rules[0].fallback_pool: unknown pool 'nowhere'"),
        ("rules: [{name: a, pool: p, fallbacks: [{pool: nowhere, when: [overloaded]}]}]",
         "rules[0].fallbacks[0].pool: unknown pool 'nowhere'"),
        ("rules: [{name: a, pool: p, fallbacks: [{pool: q, when: [busy]}]}]",
         "rules[0].fallbacks[0].when[0]: must be one of: overloaded, unavailable, context_length_exceeded (got 'busy')"),
        ("rules: [{name: a, pool: p, fallbacks: [{pool: q, when: []}]}]",
         "rules[0].fallbacks[0].when: must list at least one of overloaded, unavailable, context_length_exceeded"),
        ("rules: [{name: a, pool: p, fallbacks: [{pool: q}, {pool: q}]}]",
         "rules[0].fallbacks[1].pool: 'q' is already listed"),
        ("rules: [{name: a, pool: p, fallbacks: [{pool: p}]}]", "rules[0].fallbacks[0].pool: 'p' is the rule's own pool"),
        ("rules: [{name: a, pool: p, fallback_pool: q, fallbacks: [{pool: q}]}]",
         "rules[0].fallback_pool: give fallbacks or fallback_pool, not both"),
        ("- just a list", "expected a mapping, got a list"),
        ("rules: [{name: a, pool: p}", "not valid YAML at line 1, column 27: expected ',' or ']', but got '<stream end>'"),
    ],
    ids=[
        "empty-rules", "unknown-top-key", "unknown-rule-key", "duplicate-name", "missing-pool", "empty-pool",
        "unknown-type", "unknown-parameter", "bad-parameter-value", "unknown-policy-key", "unknown-match-key",
        "priority-not-a-class", "header-not-map", "fallback-not-string", "unknown-fallback-pool",
        "unknown-fallbacks-pool", "unknown-fallback-reason", "no-fallback-reason", "fallback-pool-twice",
        "fallback-to-own-pool", "fallback-pool-and-fallbacks", "not-a-map",
        "invalid-yaml",
    ],
)
def test_bad_files_are_rejected_with_the_yaml_path(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        rules_from_file(write(tmp_path, text), POOLS)
    assert str(excinfo.value) == message


def test_unknown_pool_is_rejected(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^rules\[1\].pool: unknown pool 'slow'$"):
        rules_from_file(write(tmp_path, GOOD.replace("    fallback_pool: slow\n", "")), {"fast"})


def test_example_default_file_loads() -> None:
    rules = rules_from_file(REPO / "configs/policies/default.yaml", {"default"})
    assert [r.name for r in rules.rules] == ["agents-sticky", "default"]


WORKER = {"name": "w0", "url": "http://127.0.0.1:8101"}


def config_with(policy: dict | None = None, policies_file: Path | None = None) -> KvgateConfig:
    pool = {"model": "m", "workers": [WORKER], **({"policy": policy} if policy else {})}
    routing = {"policies_file": str(policies_file)} if policies_file else {}
    return build(KvgateConfig, {"pools": {"default": pool}, "routing": routing}, env={})


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"type": "fastest"}, "pools.default.policy.type: unknown policy type 'fastest' (known: kv_aware, least_load, "
                              "power_of_two, prefix_approx, random, round_robin, session_affinity)"),
        ({"type": "least_load", "parameters": {"slack": 1}}, "pools.default.policy.parameters.slack: unknown parameter"),
        ({"parameters": {"slack": -0.5}}, "pools.default.policy.parameters.slack: must be >= 0, got -0.5"),
    ],
    ids=["unknown-pool-policy-type", "unknown-pool-policy-parameter", "bad-pool-policy-parameter"],
)
def test_a_pools_policy_is_checked_naming_the_yaml_path(policy, message) -> None:
    with pytest.raises(ConfigError) as info:
        routing_rules(config_with(policy))
    assert str(info.value) == message


def test_without_a_policy_file_each_pool_routes_its_model_with_its_policy() -> None:
    (only,) = routing_rules(config_with({"type": "least_load"})).rules
    assert (only.name, only.pool, only.policy_type, only.match.model) == ("default", "default", "least_load", "m")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("rules: [{name: a, pool: default, policy: {type: nope}}]", "rules[0].policy.type: unknown policy type 'nope'"),
        ("rules: [unclosed", "not valid YAML at line 1, column 17: expected ',' or ']', but got '<stream end>'"),
        (None, "cannot read the file: No such file or directory"),
    ],
    ids=["bad-rule", "invalid-yaml", "missing-file"],
)
def test_a_bad_policy_file_at_start_names_the_file_then_the_yaml_path(tmp_path, text: str | None, problem: str) -> None:
    path = tmp_path / "p.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        routing_rules(config_with(policies_file=path))
    assert str(excinfo.value).startswith(f"routing.policies_file: {path}: {problem}")


def _rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


class Watched:
    """A router on the file's rules and a watcher over the file (driven by hand, no task)."""

    def __init__(self, path: Path) -> None:
        self.metrics = GatewayMetrics()
        pools = {"default": [WorkerSpec("w0", "m", 16)]}
        self.router = Router(pools, rules_from_file(path, pools), rng=random.Random(0))
        self.watcher = PolicyFileWatcher(path, list(pools), self.router, self.metrics, interval_s=1.0)

    def rule_in_force(self) -> str | None:
        return self.router.route(RouteRequest(model="m", prompt=[1, 2, 3])).decision.rule

    def reloads(self, outcome: str) -> float:
        return self.metrics.policy_reloads.labels(outcome=outcome)._value.get()


def test_the_watcher_installs_a_changed_file(tmp_path) -> None:
    path = write(tmp_path, "rules: [{name: first, pool: default}]")
    watched = Watched(path)
    assert watched.watcher.reload_if_changed() is False
    _rewrite(path, "rules: [{name: only, pool: default, policy: {type: round_robin}}]")
    assert watched.watcher.reload_if_changed() is True
    assert watched.rule_in_force() == "only" and watched.reloads("ok") == 1


def test_the_watcher_keeps_the_rules_in_force_when_the_new_file_is_bad(tmp_path, caplog) -> None:
    path = write(tmp_path, "rules: [{name: first, pool: default}]")
    watched = Watched(path)
    _rewrite(path, "rules: [{name: a, pool: default, policy: {type: nope}}]")
    with caplog.at_level(logging.WARNING, logger="kvgate.gateway"):
        assert watched.watcher.reload_if_changed() is False
    assert watched.rule_in_force() == "first" and watched.reloads("error") == 1
    assert f"{path}: rules[0].policy.type: unknown policy type 'nope'" in caplog.text
    assert watched.watcher.reload_if_changed() is False  # the same bad file is not reported again


def test_the_watcher_reloads_on_request_even_without_a_change(tmp_path) -> None:
    path = write(tmp_path, "rules: [{name: first, pool: default}]")
    watched = Watched(path)
    watched.watcher.request_reload()  # what the SIGHUP handler does
    assert watched.watcher.reload_if_changed() is True
    assert watched.reloads("ok") == 1
