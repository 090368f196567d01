"""YAML routing policies: the loader's messages, rule selection and reloading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.policies.kv_aware import KvAwareParams
from router.policy_config import PolicyConfigError, PolicyStore, load_policies
from router.types import RouteRequest

REPO = Path(__file__).resolve().parents[2]

GOOD = """
rules:
  - name: premium
    match: {tenant: acme, priority: 1, header: {X-Team: search}, model: "llama-*", path: "/v1/chat/*"}
    pool: fast
    policy: {type: kv_aware, parameters: {slack: 0.2}}
    fallback_pool: slow
  - name: everyone
    pool: slow
"""


def req(**kw: object) -> RouteRequest:
    fields = {"model": "llama-3", "messages": [], "path": "/v1/chat/completions"}
    fields.update(kw)
    return RouteRequest(**fields)  # type: ignore[arg-type]


def test_good_file_loads_with_validated_parameters() -> None:
    policies = load_policies(GOOD)
    premium, everyone = policies.rules
    assert (premium.pool, premium.fallback_pool, premium.policy_type) == ("fast", "slow", "kv_aware")
    assert premium.policy_params == KvAwareParams(slack=0.2)
    assert everyone.policy_type == "kv_aware"


@pytest.mark.parametrize(
    ("request_fields", "rule"),
    [
        ({"tenant": "acme", "priority": 1, "headers": {"x-team": "search"}}, "premium"),
        ({"tenant": "acme", "priority": 1, "headers": {"x-team": "ads"}}, "everyone"),
        ({"tenant": "acme", "priority": 1, "headers": {"x-team": "search"}, "model": "qwen"}, "everyone"),
        ({"tenant": "acme", "priority": 1, "headers": {"x-team": "search"}, "path": "/v1/completions"}, "everyone"),
        ({"tenant": "other", "priority": 1, "headers": {"x-team": "search"}}, "everyone"),
    ],
    ids=["all-match", "header-differs", "model-differs", "path-differs", "tenant-differs"],
)
def test_first_matching_rule_wins(request_fields: dict, rule: str) -> None:
    assert load_policies(GOOD).select(req(**request_fields)).name == rule


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: []", "rules: must be a non-empty list"),
        ("rulez: []", "rulez: unknown key (allowed: rules)"),
        ("rules: [{name: a, pool: p, colour: red}]", "rules[0].colour: unknown key (allowed: fallback_pool, match, name, policy, pool)"),
        ("rules: [{name: a, pool: p}, {name: a, pool: q}]", "rules[1].name: duplicate rule name 'a' (also rules[0])"),
        ("rules: [{name: a}]", "rules[0].pool: must be a non-empty string"),
        ("rules: [{name: a, pool: p, policy: {type: fastest}}]",
         "rules[0].policy.type: unknown policy type 'fastest' (known: kv_aware, least_load, power_of_two, prefix_approx, random, round_robin, session_affinity)"),
        ("rules: [{name: a, pool: p}, {name: b, pool: p}, {name: c, pool: p, policy: {type: least_load, parameters: {slack: 1}}}]",
         "rules[2].policy.parameters.slack: unknown parameter"),
        ("rules: [{name: a, pool: p, policy: {type: kv_aware, parameters: {slack: -0.5}}}]",
         "rules[0].policy.parameters.slack: must be >= 0, got -0.5"),
        ("rules: [{name: a, pool: p, policy: {type: kv_aware, params: {}}}]", "rules[0].policy.params: unknown key (allowed: parameters, type)"),
        ("rules: [{name: a, pool: p, match: {user: x}}]", "rules[0].match.user: unknown key (allowed: header, model, path, priority, tenant)"),
        ("rules: [{name: a, pool: p, match: {priority: high}}]", "rules[0].match.priority: must be an integer, got 'high'"),
        ("rules: [{name: a, pool: p, match: {header: [x]}}]", "rules[0].match.header: must be a map of header name to value"),
        ("rules: [{name: a, pool: p, fallback_pool: 3}]", "rules[0].fallback_pool: must be a non-empty string"),
        ("- just a list", "(top level): must be a map, got list"),
        ("rules: [{name: a, pool: p}", "not valid YAML at line 1, column 27: expected ',' or ']', but got '<stream end>'"),
    ],
    ids=[
        "empty-rules", "unknown-top-key", "unknown-rule-key", "duplicate-name", "missing-pool", "unknown-type",
        "unknown-parameter", "bad-parameter-value", "unknown-policy-key", "unknown-match-key", "priority-not-int",
        "header-not-map", "fallback-not-string", "not-a-map", "invalid-yaml",
    ],
)
def test_bad_files_are_rejected_with_the_yaml_path(text: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as excinfo:
        load_policies(text)
    assert str(excinfo.value) == message


def test_unknown_pool_is_rejected_when_pools_are_known() -> None:
    with pytest.raises(PolicyConfigError, match=r"^rules\[1\].pool: unknown pool 'slow'$"):
        load_policies(GOOD.replace("fallback_pool: slow", "fallback_pool: fast"), known_pools={"fast"})


def test_example_default_file_loads() -> None:
    policies = load_policies((REPO / "configs/policies/default.yaml").read_text())
    assert [r.name for r in policies.rules] == ["agents-sticky", "default"]


def _rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_store_reloads_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore(path)
    assert store.maybe_reload() is False
    _rewrite(path, "rules: [{name: only, pool: p}]")
    assert store.maybe_reload() is True
    assert [r.name for r in store.policies.rules] == ["only"]
    assert store.version == 2


def test_store_keeps_the_old_policies_when_the_new_file_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore(path)
    _rewrite(path, "rules: [{name: a, pool: p, policy: {type: nope}}]")
    assert store.maybe_reload() is False
    assert [r.name for r in store.policies.rules] == ["premium", "everyone"]
    assert store.reload_failures == 1
    assert store.last_error is not None
    assert store.last_error.startswith(f"{path}: rules[0].policy.type: unknown policy type 'nope'")


def test_store_reloads_on_request_even_without_a_change(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    store = PolicyStore(path)
    store.request_reload()  # what the SIGHUP handler does
    assert store.maybe_reload() is True
    assert store.version == 2


def test_store_raises_on_a_bad_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("rules: []")
    with pytest.raises(PolicyConfigError):
        PolicyStore(path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("rules: [{name: a, pool: p, policy: {type: nope}}]", "rules[0].policy.type: unknown policy type 'nope'"),
        ("rules: [unclosed", "not valid YAML at line 1, column 17: expected ',' or ']', but got '<stream end>'"),
        (None, "cannot read the file: No such file or directory"),
    ],
    ids=["bad-rule", "invalid-yaml", "missing-file"],
)
def test_store_errors_read_file_then_yaml_path_then_problem(tmp_path: Path, text: str | None, problem: str) -> None:
    path = tmp_path / "p.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(PolicyConfigError) as excinfo:
        PolicyStore(path)
    assert str(excinfo.value).startswith(f"{path}: {problem}")
