"""The shipped Grafana dashboard only queries metrics that the gateway and workers export."""

import json
import re
from pathlib import Path

import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GATEWAY_METRICS = re.compile(r"\b(kvgate_[a-z_]+)")
WORKER_METRICS = re.compile(r"\b(vllm:[a-z_]+)")


def test_dashboard_queries_name_metrics_we_export():
    from gateway.metrics import GatewayMetrics
    from router.router import Router
    from router.rules import RoutingRules, rule
    from router.types import WorkerSpec
    from worker.metrics import WorkerMetrics

    gateway = GatewayMetrics()
    gateway.watch_router(Router({"p": [WorkerSpec("w", "m", 16)]}, RoutingRules((rule("d", "p"),))).stats)
    gateway.watch_admission(lambda: {}, shared_limits=lambda: True)
    exported = set()
    for registry in (gateway.registry, WorkerMetrics("m", "sim").registry):
        for family in registry.collect():  # series appear once labelled: name them by type
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            exported.update(family.name + suffix for suffix in suffixes)
    dashboard = json.loads((CONFIGS / "grafana/dashboards/kvgate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {m for e in exprs for m in GATEWAY_METRICS.findall(e) + WORKER_METRICS.findall(e)}
    assert names and names <= exported, sorted(names - exported)


def test_prometheus_config_scrapes_the_local_stack():
    config = yaml.safe_load((CONFIGS / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["127.0.0.1:8000", "127.0.0.1:8101", "127.0.0.1:8102"]
