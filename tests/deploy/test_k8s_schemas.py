"""deploy/k8s renders offline with `kubectl kustomize`, and every object it renders is valid Kubernetes.

Built-in kinds are checked against the Kubernetes OpenAPI schemas that the kubernetes-validate package ships
(strict: an unknown or misspelt field fails), for the oldest version the manifests support and the newest the
package knows. ServiceMonitor is a CRD those schemas lack: its structure is checked here by hand.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.manifests import EXAMPLES, KUSTOMIZATIONS, load_example, matches, objects, render

# The oldest Kubernetes the manifests are checked against (docs/deploy.md); nothing in them needs a newer one.
OLDEST_CHECKED = "1.30"
CRD_GROUPS = ("monitoring.coreos.com/",)
SERVICE_MONITOR_SPEC_KEYS = {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels",
                             "podTargetLabels", "sampleLimit"}
SERVICE_MONITOR_ENDPOINT_KEYS = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout",
                                 "honorLabels", "relabelings", "metricRelabelings", "params"}
SOURCES = [*KUSTOMIZATIONS, *EXAMPLES]


def _manifests(source: str) -> list[dict]:
    return load_example(source) if source.endswith(".yaml") else render(source)


def _is_crd(manifest: dict) -> bool:
    return manifest["apiVersion"].startswith(CRD_GROUPS)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_renders_offline(kustomization: str) -> None:
    manifests = render(kustomization)
    assert manifests, f"deploy/k8s/{kustomization} rendered nothing"
    names = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


@pytest.mark.parametrize("version", [OLDEST_CHECKED, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("source", SOURCES)
def test_every_built_in_object_validates_against_the_kubernetes_schema(source: str, version: str) -> None:
    failures = []
    for manifest in _manifests(source):
        if _is_crd(manifest):
            continue
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            failures.append(f"{manifest['kind']}/{manifest['metadata']['name']}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_service_monitors_select_a_service_and_name_its_port(kustomization: str) -> None:
    manifests = render(kustomization)
    services = objects(manifests, "Service")
    for monitor in objects(manifests, "ServiceMonitor"):
        where = f"{kustomization}: ServiceMonitor/{monitor['metadata']['name']}"
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1", where
        spec = monitor["spec"]
        assert set(spec) <= SERVICE_MONITOR_SPEC_KEYS, f"{where}: unknown keys {set(spec) - SERVICE_MONITOR_SPEC_KEYS}"
        selected = [s for s in services if matches(spec["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        assert len(selected) == 1, f"{where}: selects {[s['metadata']['name'] for s in selected]}, wanted one Service"
        port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
        assert spec["endpoints"], f"{where}: no endpoints"
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT_KEYS, f"{where}: unknown endpoint keys {set(endpoint)}"
            assert endpoint["port"] in port_names, f"{where}: port {endpoint['port']!r} not on the Service {port_names}"
            assert endpoint.get("path", "/metrics") == "/metrics", where


def test_production_has_service_monitors_and_dev_has_none() -> None:
    """ServiceMonitor is a CRD: only the overlay that opts into the component may render it."""
    assert {m["metadata"]["name"] for m in objects(render("overlays/production"), "ServiceMonitor")} == {
        "kvgate-gateway", "kvgate-worker"}
    assert not objects(render("overlays/dev"), "ServiceMonitor")
    assert not objects(render("base"), "ServiceMonitor")
