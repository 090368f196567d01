"""The rendered deploy/k8s objects point at each other correctly: Services and probes reach declared ports,
the HPA scales the gateway Deployment on a metric the adapter rule serves, the PDB and NetworkPolicies select
the pods they mean, workers stay inside the cluster, and each overlay has the shape docs/deploy.md promises.
"""

from __future__ import annotations

import pytest
import yaml

from gateway.metrics import GatewayMetrics
from tests.deploy.manifests import (
    EXAMPLES,
    GATEWAY_LABELS,
    K8S,
    KUSTOMIZATIONS,
    WORKER_COMPONENTS,
    containers,
    declares_port,
    load_example,
    matches,
    objects,
    one,
    pod_labels,
    pod_spec,
    probes,
    render,
    selected_workloads,
    workloads,
)

SOURCES = [*KUSTOMIZATIONS, *EXAMPLES]


def _manifests(source: str) -> list[dict]:
    return load_example(source) if source.endswith(".yaml") else render(source)


@pytest.mark.parametrize("source", SOURCES)
def test_every_service_selects_pods_that_declare_its_target_ports(source: str) -> None:
    manifests = _manifests(source)
    for service in objects(manifests, "Service"):
        where = f"{source}: Service/{service['metadata']['name']}"
        pods = selected_workloads(manifests, service["spec"]["selector"])
        assert pods, f"{where}: its selector {service['spec']['selector']} matches no workload's pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload in pods:
                assert declares_port(containers(workload), target), (
                    f"{where}: targetPort {target!r} is not declared by {workload['metadata']['name']}")


@pytest.mark.parametrize("source", SOURCES)
def test_every_probe_targets_a_port_its_container_declares(source: str) -> None:
    for workload in workloads(_manifests(source)):
        for cont in containers(workload):
            for kind, port in probes(cont):
                assert declares_port([cont], port), (
                    f"{source}: {workload['metadata']['name']}/{cont['name']} {kind} port {port!r} is not declared")


@pytest.mark.parametrize("source", SOURCES)
def test_prometheus_annotations_name_a_declared_port_and_metrics_path(source: str) -> None:
    for workload in workloads(_manifests(source)):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if pod_labels(workload).get("app.kubernetes.io/component") == "redis":
            continue  # Redis exports no metrics of its own
        where = f"{source}: {workload['metadata']['name']}"
        assert annotations.get("prometheus.io/scrape") == "true", f"{where}: not marked for scraping"
        assert annotations.get("prometheus.io/path") == "/metrics", where
        assert declares_port(containers(workload), int(annotations["prometheus.io/port"])), (
            f"{where}: prometheus.io/port {annotations['prometheus.io/port']} is not a declared port")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_probes_ready_on_ready_and_live_on_health(kustomization: str) -> None:
    gateway = one(render(kustomization), "Deployment", "kvgate-gateway")
    cont = containers(gateway)[0]
    assert cont["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert cont["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_hpa_scales_the_gateway_deployment_that_exists(kustomization: str) -> None:
    manifests = render(kustomization)
    for hpa in objects(manifests, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        deployment = one(manifests, target["kind"], target["name"])
        assert target["apiVersion"] == deployment["apiVersion"]
        assert matches(GATEWAY_LABELS, pod_labels(deployment)), "the HPA must scale the gateway"
        assert "replicas" not in deployment["spec"], (
            "a Deployment the HPA scales must not set replicas: every re-apply would reset the HPA's count")
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def _adapter_metric_names() -> dict[str, str]:
    """HPA metric name -> the Prometheus series it comes from, per the prometheus-adapter rules."""
    rules = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text(encoding="utf-8"))
    names = {}
    for rule in rules["rules"]:
        series = rule["seriesQuery"].split("{", 1)[0]
        assert rule["resources"]["overrides"]["pod"]["resource"] == "pod", "a Pods metric needs the pod label mapped"
        assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"
        names[rule["name"]["as"]] = series
    return names


def test_hpa_pods_metric_is_served_by_the_adapter_rule_from_a_gateway_metric() -> None:
    hpa = one(render("base"), "HorizontalPodAutoscaler", "kvgate-gateway")
    pods_metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods_metrics, "the HPA should scale on a kvgate metric, not on CPU alone"
    adapter = _adapter_metric_names()
    exported = {family.name for family in GatewayMetrics().registry.collect()}
    for name in pods_metrics:
        assert name in adapter, f"no prometheus-adapter rule serves {name!r} (rules: {sorted(adapter)})"
        assert adapter[name].removesuffix("_total") in exported, (
            f"{adapter[name]} is not a metric the gateway exports at /metrics")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pdb_selects_exactly_the_gateway_pods(kustomization: str) -> None:
    manifests = render(kustomization)
    pdb = one(manifests, "PodDisruptionBudget", "kvgate-gateway")
    selected = selected_workloads(manifests, pdb["spec"]["selector"]["matchLabels"])
    assert [w["metadata"]["name"] for w in selected] == ["kvgate-gateway"]


@pytest.mark.parametrize("source", SOURCES)
def test_workers_are_reachable_only_inside_the_cluster(source: str) -> None:
    manifests = _manifests(source)
    assert not objects(manifests, "Ingress")
    for service in objects(manifests, "Service"):
        if service["spec"]["selector"].get("app.kubernetes.io/component") in WORKER_COMPONENTS:
            assert service["spec"].get("clusterIP") == "None", (
                f"{service['metadata']['name']}: workers get a headless Service")
            assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


@pytest.mark.parametrize("source", SOURCES)
def test_network_policies_admit_only_gateways_to_workers_and_name_declared_ports(source: str) -> None:
    manifests = _manifests(source)
    for policy in objects(manifests, "NetworkPolicy"):
        where = f"{source}: NetworkPolicy/{policy['metadata']['name']}"
        guarded = selected_workloads(manifests, policy["spec"]["podSelector"]["matchLabels"])
        if not guarded:  # a policy for pods of another file (the vLLM example's for Redis)
            guarded = selected_workloads(render("base"), policy["spec"]["podSelector"]["matchLabels"])
        assert guarded, f"{where}: selects no pods"
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert all(declares_port(containers(w), port["port"]) for w in guarded), f"{where}: port {port}"
            if guarded[0]["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] in WORKER_COMPONENTS:
                peers = [peer["podSelector"]["matchLabels"] for peer in rule["from"] if "podSelector" in peer]
                assert all(peer == GATEWAY_LABELS for peer in peers), f"{where}: workers admit {peers}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_worker_and_redis_pod_is_covered_by_a_network_policy(kustomization: str) -> None:
    manifests = render(kustomization)
    policies = objects(manifests, "NetworkPolicy")
    for workload in workloads(manifests):
        if pod_labels(workload).get("app.kubernetes.io/component") == "gateway":
            continue  # clients come from anywhere
        assert any(matches(p["spec"]["podSelector"]["matchLabels"], pod_labels(workload)) for p in policies), (
            f"{kustomization}: {workload['metadata']['name']} has no NetworkPolicy")


def test_dev_runs_one_gateway_and_two_cpu_workers_without_autoscaler() -> None:
    manifests = render("overlays/dev")
    assert one(manifests, "Deployment", "kvgate-gateway")["spec"]["replicas"] == 1
    workers = one(manifests, "StatefulSet", "kvgate-worker")
    assert workers["spec"]["replicas"] == 2
    assert "nvidia.com/gpu" not in str(pod_spec(workers))
    assert not objects(manifests, "HorizontalPodAutoscaler")


def test_production_autoscales_three_or_more_gateways_over_gpu_workers() -> None:
    manifests = render("overlays/production")
    assert one(manifests, "HorizontalPodAutoscaler", "kvgate-gateway")["spec"]["minReplicas"] >= 3
    worker = containers(one(manifests, "StatefulSet", "kvgate-worker"))[0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod_spec(one(manifests, "StatefulSet", "kvgate-worker"))
               ["tolerations"])


def test_production_redis_keeps_its_data_on_a_claim_that_exists() -> None:
    manifests = render("overlays/production")
    volumes = pod_spec(one(manifests, "Deployment", "kvgate-redis"))["volumes"]
    data = next(v for v in volumes if v["name"] == "data")
    assert set(data) == {"name", "persistentVolumeClaim"}, f"the data volume must be the claim alone: {data}"
    one(manifests, "PersistentVolumeClaim", data["persistentVolumeClaim"]["claimName"])


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_config_map_volumes_name_rendered_config_maps(kustomization: str) -> None:
    manifests = render(kustomization)
    names = {m["metadata"]["name"] for m in objects(manifests, "ConfigMap")}
    for workload in workloads(manifests):
        for volume in pod_spec(workload).get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in names, f"{workload['metadata']['name']}: {volume}"
