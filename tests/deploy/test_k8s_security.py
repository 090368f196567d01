"""Every rendered pod meets the `restricted` Pod Security Standard the overlays' namespaces enforce, runs a
pinned image (never `latest`; kvgate's own at the project's version), has resource requests and limits, and
takes secrets from Secrets, never from literals in the manifests.
"""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.deploy.manifests import (
    EXAMPLES,
    KUSTOMIZATIONS,
    REPO,
    containers,
    load_example,
    objects,
    pod_spec,
    render,
    workloads,
)

SOURCES = [*KUSTOMIZATIONS, *EXAMPLES]
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
KVGATE_IMAGES = ("kvgate-gateway", "kvgate-worker")
SECRET_NAME = re.compile(r"KEY|TOKEN|PASSWORD|SECRET", re.IGNORECASE)


def _manifests(source: str) -> list[dict]:
    return load_example(source) if source.endswith(".yaml") else render(source)


def _image_tag(image: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of an image reference; a registry's port is not a tag."""
    name, _, digest = image.partition("@")
    repo, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "")
    return repo, tag or None, digest or None


@pytest.mark.parametrize("source", SOURCES)
def test_images_are_pinned_never_latest(source: str) -> None:
    for workload in workloads(_manifests(source)):
        for cont in containers(workload):
            repo, tag, digest = _image_tag(cont["image"])
            where = f"{source}: {workload['metadata']['name']}/{cont['name']} image {cont['image']}"
            assert tag or digest, f"{where}: no tag or digest (means latest)"
            assert tag != "latest", where
            if repo.rsplit("/", 1)[-1] in KVGATE_IMAGES:
                assert tag.split("-")[0] == PROJECT_VERSION, f"{where}: not the project's version {PROJECT_VERSION}"


@pytest.mark.parametrize("source", SOURCES)
def test_pods_meet_the_restricted_pod_security_standard(source: str) -> None:
    for workload in workloads(_manifests(source)):
        spec = pod_spec(workload)
        pod_context = spec.get("securityContext", {})
        assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault", workload["metadata"]["name"]
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        for cont in containers(workload):
            where = f"{source}: {workload['metadata']['name']}/{cont['name']}"
            context = {**pod_context, **cont.get("securityContext", {})}
            assert context.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
            assert context.get("runAsUser", 1) != 0, f"{where}: runs as root"
            assert context.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
            assert context.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities not dropped"
            assert not context.get("privileged"), where


@pytest.mark.parametrize("source", SOURCES)
def test_every_container_requests_and_limits_cpu_and_memory(source: str) -> None:
    for workload in workloads(_manifests(source)):
        for cont in containers(workload):
            resources = cont.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(part, {})), (
                    f"{source}: {workload['metadata']['name']}/{cont['name']} has no {part} for cpu and memory")


@pytest.mark.parametrize("source", SOURCES)
def test_secrets_come_from_secret_objects_not_literals(source: str) -> None:
    manifests = _manifests(source)
    for secret in objects(manifests, "Secret"):
        assert not secret.get("data") and not secret.get("stringData"), f"literal Secret {secret['metadata']['name']}"
    for workload in workloads(manifests):
        for cont in containers(workload):
            for env in cont.get("env", []):
                if SECRET_NAME.search(env["name"]):
                    assert "secretKeyRef" in env.get("valueFrom", {}), (
                        f"{workload['metadata']['name']}/{cont['name']}: {env['name']} must come from a Secret")


@pytest.mark.parametrize("kustomization", ["overlays/dev", "overlays/production"])
def test_overlay_namespaces_enforce_the_restricted_standard(kustomization: str) -> None:
    manifests = render(kustomization)
    (namespace,) = objects(manifests, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for manifest in manifests:
        if manifest["kind"] != "Namespace":
            assert manifest["metadata"]["namespace"] == namespace["metadata"]["name"], manifest["metadata"]["name"]
