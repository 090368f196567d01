"""configs/prometheus/rules.yml: every rule names series the gateway and workers export (or that an
earlier rule records) by labels they carry, every alert says how bad and what happened, and
Prometheus' own promtool accepts the rules, the config that loads them and their unit tests."""

from __future__ import annotations

import functools
import re
import subprocess

import pytest
import yaml

from tests.kvgate.test_dashboards import CONFIGS, check_expr, exported_series, promtool

RULES = CONFIGS / "prometheus/rules.yml"
RULES_TEST = CONFIGS / "prometheus/rules_test.yml"
SEVERITIES = {"critical", "warning", "info"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def rule_id(rule: dict) -> str:
    return rule.get("record") or rule["alert"]


@functools.cache
def rule_labels() -> tuple[dict[str, frozenset[str]], dict[str, list[str]]]:
    """(rule -> the labels of what it records or alerts, rule -> problems of its expr: see check_expr),
    rules in file order: a recorded series has the labels its expression returns, plus the rule's own,
    and the rules after it may use it."""
    series = dict(exported_series())
    labels, problems = {}, {}
    for rule in rules():
        returned, problems[rule_id(rule)] = check_expr(rule["expr"], series)
        labels[rule_id(rule)] = (returned or frozenset()) | set(rule.get("labels", {}))
        if "record" in rule:
            series[rule["record"]] = labels[rule_id(rule)]
    return labels, problems


def test_rules_name_exported_or_recorded_series_by_their_labels():
    _, problems = rule_labels()
    assert len(problems) == len(rules()) and not {rule: p for rule, p in problems.items() if p}


def test_recorded_series_follow_the_level_metric_operations_convention():
    for rule in rules():
        if "record" in rule:
            assert re.fullmatch(r"kvgate:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


@pytest.mark.parametrize("rule", [r for r in rules() if "alert" in r], ids=rule_id)
def test_alert_has_a_duration_severity_and_a_summary_with_its_labels(rule):
    labels = rule_labels()[0][rule["alert"]]
    assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
    assert rule["labels"]["severity"] in SEVERITIES
    assert set(rule["annotations"]) >= {"summary", "description"}
    for text in rule["annotations"].values():
        named = set(re.findall(r"\$labels\.(\w+)", text))
        assert named <= labels, f"{rule['alert']} has no label {named - labels}"


def test_since_start_gauges_are_not_alerted_on():
    """The hit ratio and the cost per request are windowed ratios of counters, never the since-start gauges."""
    for rule in rules():
        assert "kvgate_router_prediction_hit_ratio" not in rule["expr"], rule_id(rule)
        assert "kvgate_cost_per_successful_request" not in rule["expr"], rule_id(rule)


def test_prometheus_config_loads_the_rules():
    config = yaml.safe_load((CONFIGS / "prometheus.yml").read_text())
    assert [(CONFIGS / path).resolve() for path in config["rule_files"]] == [RULES.resolve()]


@pytest.mark.parametrize("args", [
    ["check", "rules", str(RULES)],
    ["check", "config", str(CONFIGS / "prometheus.yml")],
    ["test", "rules", str(RULES_TEST)],
], ids=["check-rules", "check-config", "test-rules"])
def test_promtool_accepts(args):
    result = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_cover_alerts_and_recorded_series():
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    alerted = {t["alertname"] for test in tests for t in test.get("alert_rule_test", [])}
    recorded = {t["expr"] for test in tests for t in test.get("promql_expr_test", [])}
    names = {rule_id(rule) for rule in rules()}
    assert len(alerted) >= 3 and alerted <= names and recorded <= names
