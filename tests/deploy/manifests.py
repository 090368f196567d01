"""Rendering the deploy/k8s kustomizations offline (`kubectl kustomize`) and looking things up in what they render."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# Everything `kubectl apply -k` is meant for; the base renders alone too, so it is checked like an overlay.
KUSTOMIZATIONS = ("base", "overlays/dev", "overlays/production")
# Plain manifests applied beside an overlay (kubectl apply -f).
EXAMPLES = ("examples/vllm-worker.yaml",)
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
GATEWAY_LABELS = {"app.kubernetes.io/name": "kvgate", "app.kubernetes.io/component": "gateway"}
WORKER_COMPONENTS = ("worker", "vllm-worker")

Manifest = dict[str, Any]


def kubectl() -> str:
    """The kubectl binary, or a skip saying why the render tests cannot run."""
    found = shutil.which("kubectl") or next(
        (p for p in ("/usr/local/bin/kubectl", "/usr/bin/kubectl") if Path(p).is_file()), None)
    if found is None:
        pytest.skip("kubectl is not installed: the deploy/k8s renders need `kubectl kustomize` (kubectl >= 1.27)")
    return found


@cache
def _render_text(kustomization: str) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                            timeout=60, check=False)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize deploy/k8s/{kustomization} failed:\n{result.stderr}")
    return result.stdout


def render(kustomization: str) -> list[Manifest]:
    """The objects `kubectl kustomize deploy/k8s/<kustomization>` prints (rendered once per session)."""
    return [doc for doc in yaml.safe_load_all(_render_text(kustomization)) if doc]


def load_example(name: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text(encoding="utf-8")) if doc]


def objects(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[Manifest], kind: str, name_prefix: str) -> Manifest:
    """The single object of `kind` whose name starts with name_prefix (generated ConfigMaps carry a hash)."""
    found = [m for m in objects(manifests, kind) if m["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} named {name_prefix}*, found {[m['metadata']['name'] for m in found]}"
    return found[0]


def workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] in WORKLOAD_KINDS]


def pod_labels(workload: Manifest) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def pod_spec(workload: Manifest) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: Manifest) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(workload: Manifest, name: str) -> dict[str, Any]:
    return next(c for c in containers(workload) if c["name"] == name)


def port_number(cont: Mapping[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in cont.get("ports", []) if p.get("name") == name)


def matches(match_labels: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """A matchLabels selector (or a Service's selector) selects these labels; an empty one selects nothing here."""
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def selected_workloads(manifests: list[Manifest], match_labels: Mapping[str, str]) -> list[Manifest]:
    return [w for w in workloads(manifests) if matches(match_labels, pod_labels(w))]


def probes(cont: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(probe kind, port) for each httpGet / tcpSocket / grpc probe of a container."""
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = cont.get(kind)
        if probe is None:
            continue
        for handler in ("httpGet", "tcpSocket", "grpc"):
            if handler in probe:
                yield kind, probe[handler]["port"]


def declares_port(conts: list[Mapping[str, Any]], port: Any) -> bool:
    """A port reference (a name, or a number) resolves to a port the containers declare."""
    declared = [p for c in conts for p in c.get("ports", [])]
    if isinstance(port, str):
        return any(p.get("name") == port for p in declared)
    return any(p["containerPort"] == port for p in declared)


def env_names(cont: Mapping[str, Any]) -> set[str]:
    return {e["name"] for e in cont.get("env", [])}
