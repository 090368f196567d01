"""The shipped Grafana dashboards (configs/grafana/) and their provisioning: every query parses, names
series that the gateway and workers export, groups and filters by labels those series carry, and is
filtered by each dashboard variable whose label the series has."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import promql_parser as promql
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DASHBOARDS = CONFIGS / "grafana/dashboards"
PROVISIONING = CONFIGS / "grafana/provisioning"
SCRAPE_LABELS = frozenset({"job", "instance"})  # added by Prometheus to every scraped series
GATEWAY_LABELS = SCRAPE_LABELS | {"gateway_process"}  # `kvgate gateway --workers N` labels each process' series
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}

# file -> (uid, its variables in order): each dashboard has the variables its series can be filtered by
EXPECTED = {
    "kvgate-overview.json": ("kvgate-overview", ["datasource", "pool", "model", "tenant", "worker"]),
    "kvgate-routing.json": ("kvgate-routing", ["datasource", "pool", "model", "worker"]),
    "kvgate-admission.json": ("kvgate-admission", ["datasource", "pool", "tenant"]),
    "kvgate-reliability.json": ("kvgate-reliability", ["datasource", "pool", "worker"]),
    "kvgate-workers.json": ("kvgate-workers", ["datasource", "model_name", "instance"]),
    "kvgate-cost.json": ("kvgate-cost", ["datasource", "tenant"]),
}


# ---------------------------------------------------------------- what the real registries export

@functools.cache
def exported_samples() -> tuple:
    """Every sample of the gateway's and a worker's real registries, with one child of every labelled
    metric so that its labels show, each with the labels Prometheus adds when it scrapes it."""
    from admission.pool_admission import PoolState
    from admission.priority import Priority
    from gateway.metrics import GatewayMetrics
    from router.router import Router
    from router.rules import RoutingRules, rule
    from router.ticket import ClosedLoopStats
    from router.types import WorkerSpec
    from worker.metrics import WorkerMetrics

    gateway = GatewayMetrics()
    router = Router({"p": [WorkerSpec("w", "m", 16)]}, RoutingRules((rule("d", "p"),)))
    gateway.watch_router(lambda: dataclasses.replace(router.stats(), closed_loop={"p": ClosedLoopStats()},
                                                     tokenizer_prefix_cache={"m": (1, 1)}))
    gateway.watch_fleet(lambda: {"w": 1}, lambda: {"p": 1})
    gateway.watch_admission(lambda: {"p": PoolState(8.0, 1, {Priority.STANDARD: 1})}, shared_limits=lambda: True)
    gateway.watch_shared_state(lambda: {"tenant_limits": True})
    gateway.record_cost("t", 0.5, answered=True)
    worker = WorkerMetrics("m", "sim", block_size=16, num_blocks=64)
    samples = []
    for metrics, extra in ((gateway, GATEWAY_LABELS), (worker, SCRAPE_LABELS)):
        for metric in vars(metrics).values():
            if getattr(metric, "_labelnames", None) and not getattr(metric, "_labelvalues", None):
                metric.labels(*["x"] * len(metric._labelnames))  # a metric, not one of its children
        for family in metrics.registry.collect():
            samples.extend((sample, extra) for sample in family.samples)
    return tuple(samples)


@functools.cache
def exported_series() -> Mapping[str, frozenset[str]]:
    """Series name (as scraped: `_total`, `_bucket`, ...) -> its label names; `up` from Prometheus."""
    series: dict[str, frozenset[str]] = {"up": SCRAPE_LABELS}
    for sample, extra in exported_samples():
        series[sample.name] = series.get(sample.name, frozenset()) | set(sample.labels) | extra
    return series


@functools.cache
def bucket_bounds() -> Mapping[str, frozenset[str]]:
    """`_bucket` series -> its `le` values as exported (`1.0`, `+Inf`)."""
    bounds: dict[str, set[str]] = {}
    for sample, _ in exported_samples():
        if "le" in sample.labels:
            bounds.setdefault(sample.name, set()).add(sample.labels["le"])
    return {name: frozenset(values) for name, values in bounds.items()}


# ---------------------------------------------------------------- PromQL checks, shared with test_prometheus_rules

def selectors(expr: promql.Expr) -> list[promql.VectorSelector]:
    found: list[promql.VectorSelector] = []
    promql.walk(expr, lambda node: found.append(node) if isinstance(node, promql.VectorSelector) else None)
    return found


def output_labels(expr: promql.Expr, series: Mapping[str, frozenset[str]],
                  problems: list[str]) -> frozenset[str] | None:
    """The label names of what expr returns (None: a scalar), noting in problems every series that is not
    exported, every matcher or grouping on a label the series lacks, and binary operations whose sides
    cannot match."""
    if isinstance(expr, promql.VectorSelector):
        labels = series.get(expr.name)
        if labels is None:
            problems.append(f"{expr.name} is not exported")
            return frozenset()
        for matcher in expr.matchers.matchers:
            if matcher.name != "__name__" and matcher.name not in labels:
                problems.append(f"{expr.name} has no label {matcher.name!r}")
        return labels
    if isinstance(expr, promql.MatrixSelector):
        return output_labels(expr.vector_selector, series, problems)
    if isinstance(expr, (promql.ParenExpr, promql.UnaryExpr, promql.SubqueryExpr)):
        return output_labels(expr.expr, series, problems)
    if isinstance(expr, (promql.NumberLiteral, promql.StringLiteral)):
        return None
    if isinstance(expr, promql.Call):
        return _call_labels(expr, series, problems)
    if isinstance(expr, promql.AggregateExpr):
        return _aggregate_labels(expr, series, problems)
    if isinstance(expr, promql.BinaryExpr):
        return _binary_labels(expr, series, problems)
    raise TypeError(f"unexpected PromQL node {type(expr).__name__}: {expr}")


def _call_labels(call: promql.Call, series, problems) -> frozenset[str] | None:
    args = [output_labels(arg, series, problems) for arg in call.args]
    name = call.func.name
    if name in ("scalar", "time"):
        return None
    if name == "vector":
        return frozenset()
    vectors = [labels for labels in args if labels is not None]
    if name == "histogram_quantile":
        if "le" not in vectors[0]:
            problems.append(f"histogram_quantile over series without le: {call}")
        return vectors[0] - {"le"}
    return vectors[0] if vectors else None


def _aggregate_labels(agg: promql.AggregateExpr, series, problems) -> frozenset[str]:
    inner = output_labels(agg.expr, series, problems) or frozenset()
    if agg.modifier is None:
        return frozenset()
    named = frozenset(agg.modifier.labels)
    if agg.modifier.type == promql.AggModifierType.Without:
        return inner - named
    if not named <= inner:
        problems.append(f"{agg.op} by {sorted(named - inner)}: not a label of {agg.expr}")
    return named


def _binary_labels(expr: promql.BinaryExpr, series, problems) -> frozenset[str] | None:
    lhs = output_labels(expr.lhs, series, problems)
    rhs = output_labels(expr.rhs, series, problems)
    if lhs is None or rhs is None:
        return rhs if lhs is None else lhs
    op = str(expr.op)
    matching = expr.modifier.matching if expr.modifier is not None else None
    if matching is not None:
        named = frozenset(matching.labels)
        if matching.type == promql.LabelModifierType.Include and not named <= lhs & rhs:
            problems.append(f"on {sorted(named - (lhs & rhs))}: not on both sides of {expr}")
    if op == "or":
        return lhs | rhs
    if op in ("and", "unless"):
        return lhs
    card = expr.modifier.card if expr.modifier is not None else None
    groups = frozenset(expr.modifier.group_labels) if expr.modifier is not None else frozenset()
    if card == promql.VectorMatchCardinality.ManyToOne:
        return lhs | groups
    if card == promql.VectorMatchCardinality.OneToMany:
        return rhs | groups
    if matching is None and lhs != rhs:  # one-to-one on all labels: sides that differ never match
        problems.append(f"{op}: sides differ in labels {sorted(lhs ^ rhs)}: {expr}")
    if matching is not None and matching.type == promql.LabelModifierType.Include:
        return named
    return lhs - named if matching is not None else lhs


def check_expr(expr: str, series: Mapping[str, frozenset[str]]) -> tuple[frozenset[str] | None, list[str]]:
    """(the labels of what expr returns, its problems: see output_labels); a syntax error raises."""
    problems: list[str] = []
    labels = output_labels(promql.parse(expr), series, problems)
    return labels, problems


def promtool_check_exprs(exprs: Mapping[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Prometheus' own parser over each expr, as a recording rule named after its key."""
    rules = {"groups": [{"name": "exprs", "rules": [{"record": name, "expr": e} for name, e in exprs.items()]}]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=30)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus)")
    return path


# ---------------------------------------------------------------- dashboards

def load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def substitute(text: str, variables: set[str]) -> str:
    """$var and ${var} -> a regex naming the variable (`__pool__`), Grafana's intervals -> fixed ones;
    an unknown variable is a KeyError."""
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in GRAFANA_INTERVALS:
            return GRAFANA_INTERVALS[name]
        if name not in variables:
            raise KeyError(f"${name} is not a variable of this dashboard")
        return f"__{name}__"

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr with variables substituted) for every query of every panel."""
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    return [(p["title"], substitute(t["expr"], variables)) for p in panels(dashboard) for t in p.get("targets", [])]


def label_values_query(query: str) -> tuple[str, str]:
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert match, f"not a label_values(selector, label) query: {query}"
    return match.group(1), match.group(2)


@pytest.fixture(scope="module")
def series() -> Mapping[str, frozenset[str]]:
    return exported_series()


def test_the_dashboards_shipped_are_the_ones_tested():
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_has_its_uid_schema_and_variables(name):
    dashboard = load(name)
    uid, variables = EXPECTED[name]
    assert (dashboard["uid"], dashboard["schemaVersion"]) == (uid, 39)
    assert dashboard["title"].startswith("kvgate / ") and "kvgate" in dashboard["tags"]
    assert [v["name"] for v in dashboard["templating"]["list"]] == variables
    datasource = dashboard["templating"]["list"][0]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_variables_are_multi_select_label_values_with_all(name, series):
    defined = {"datasource"}
    for variable in load(name)["templating"]["list"][1:]:
        assert variable["type"] == "query" and variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert (variable["multi"], variable["includeAll"], variable["allValue"]) == (True, True, ".*"), variable["name"]
        selector, label = label_values_query(variable["query"])
        assert variable["definition"] == variable["query"] and label == variable["name"]
        labels, problems = check_expr(substitute(selector, defined), series)  # only variables defined before
        assert not problems and label in labels, (variable["name"], problems)
        defined.add(variable["name"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_panels_query_the_chosen_datasource_and_do_not_overlap(name):
    dashboard = load(name)
    ids, cells = set(), set()
    for panel in panels(dashboard):
        assert panel["id"] not in ids, panel["title"]
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                   for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_panel_queries_name_exported_series_by_their_labels(name, series):
    for title, expr in panel_exprs(load(name)):
        _, problems = check_expr(expr, series)
        assert not problems, (title, problems)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_panel_queries_are_filtered_by_every_variable_whose_label_they_have(name, series):
    dashboard = load(name)
    variables = [v["name"] for v in dashboard["templating"]["list"][1:]]
    used = set()
    for title, expr in panel_exprs(dashboard):
        for selector in selectors(promql.parse(expr)):
            matchers = {m.name: m for m in selector.matchers.matchers}
            for variable in variables:
                if variable not in series.get(selector.name, ()):
                    continue
                matcher = matchers.get(variable)
                assert matcher is not None and matcher.op == promql.MatchOp.Re and matcher.value == f"__{variable}__", (
                    f"{title}: {selector.name} is not filtered by {variable}=~\"${variable}\"")
                used.add(variable)
    assert used == set(variables), f"variables no panel filters by: {set(variables) - used}"


def test_bucket_matchers_name_bounds_the_histograms_have():
    """A `le` matcher must name an exported bound exactly (`1.0`, not `1`), or it matches nothing."""
    bounds = bucket_bounds()
    for name in EXPECTED:
        for title, expr in panel_exprs(load(name)):
            for selector in selectors(promql.parse(expr)):
                for matcher in selector.matchers.matchers:
                    if matcher.name == "le":
                        assert matcher.value in bounds[selector.name], (title, selector.name, matcher.value)


def test_ratios_of_counters_are_windowed_never_since_start():
    """kvgate_router_prediction_hit_ratio and kvgate_cost_per_successful_request are since-start gauges:
    the dashboards use windowed ratios of the counters instead."""
    for name in EXPECTED:
        for title, expr in panel_exprs(load(name)):
            assert "prediction_hit_ratio" not in expr and "cost_per_successful_request" not in expr, title


def test_panel_queries_pass_prometheus_parser(tmp_path):
    exprs = {f"dashboard:{Path(name).stem.replace('-', '_')}:{i}": expr
             for name in EXPECTED for i, (_, expr) in enumerate(panel_exprs(load(name)))}
    result = promtool_check_exprs(exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- provisioning

def test_dashboard_provider_reads_an_absolute_path_in_the_container():
    provider = yaml.safe_load((PROVISIONING / "dashboards/kvgate.yaml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_datasource_is_prometheus_at_the_url_from_the_environment():
    datasource = yaml.safe_load((PROVISIONING / "datasources/prometheus.yaml").read_text())["datasources"][0]
    assert (datasource["type"], datasource["url"], datasource["isDefault"]) == ("prometheus", "${PROMETHEUS_URL}", True)


def test_documented_grafana_command_mounts_what_provisioning_reads():
    docs = (ROOT / "docs/observability.md").read_text()
    command = re.search(r"docker run [^`]*?grafana/grafana\S*", docs.replace("\\\n", " "), re.S)
    assert command, "docs/observability.md shows no `docker run ... grafana/grafana` command"
    mounts = dict(re.findall(r"-v \$PWD/(\S+?):(\S+?)(?::ro)?\s", command.group(0) + " "))
    provider = yaml.safe_load((PROVISIONING / "dashboards/kvgate.yaml").read_text())["providers"][0]
    assert mounts == {"configs/grafana/provisioning": "/etc/grafana/provisioning",
                      "configs/grafana/dashboards": provider["options"]["path"]}
    assert "PROMETHEUS_URL=" in command.group(0)


def test_prometheus_config_scrapes_the_local_stack():
    config = yaml.safe_load((CONFIGS / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["127.0.0.1:8000", "127.0.0.1:8101", "127.0.0.1:8102"]
