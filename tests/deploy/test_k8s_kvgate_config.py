"""The kvgate side of deploy/k8s: the gateway config in each rendered ConfigMap loads with the project's own
loader and agrees with the manifests (ports, Redis Service, replica count, the tokenizer folder the gateway
image bakes), and the worker and `kvgate register` command lines parse with the `kvgate` CLI's own parser and
advertise the ports their containers declare.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kvgate.cli import build_parser
from kvgate.config import KvgateConfig, load_config
from tests.deploy.manifests import (
    KUSTOMIZATIONS,
    REPO,
    container,
    env_names,
    load_example,
    objects,
    one,
    port_number,
    render,
)

CONFIG_KEY = "kvgate.yaml"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
def _config(manifests: list[dict], tmp_path: Path) -> KvgateConfig:
    """The gateway's config as the gateway would load it, from the rendered ConfigMap (no environment)."""
    config_map = one(manifests, "ConfigMap", "kvgate-gateway-config")
    path = tmp_path / CONFIG_KEY
    path.write_text(config_map["data"][CONFIG_KEY], encoding="utf-8")
    return load_config(path, env={})


def _args_with_env(cont: dict) -> list[str]:
    """The container's args with each $(VAR) replaced by a sample value, after checking the container sets it
    (Kubernetes passes an undefined $(VAR) on literally)."""
    defined = env_names(cont)
    samples = {"POD_IP": "10.1.2.3", "POD_NAME": "pod-0"}
    args = []
    for arg in cont["args"]:
        for name in VAR_REF.findall(arg):
            assert name in defined, f"{cont['name']}: args use $({name}), which its env does not define"
        args.append(VAR_REF.sub(lambda m: samples.get(m.group(1), m.group(1).lower()), arg))
    return args


def _parse(args: list[str]):
    return build_parser().parse_args(args)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_config_loads_with_the_project_loader(kustomization: str, tmp_path: Path) -> None:
    config = _config(render(kustomization), tmp_path)
    assert config.redis.url is not None, "replicas need Redis"
    for name, pool in config.pools.items():
        assert pool.workers == (), f"pools.{name}: workers register themselves; none are listed"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_listens_where_the_deployment_and_its_config_mount_say(kustomization: str, tmp_path: Path) -> None:
    manifests = render(kustomization)
    config = _config(manifests, tmp_path)
    deployment = one(manifests, "Deployment", "kvgate-gateway")
    gateway = container(deployment, "gateway")
    assert config.gateway.host == "0.0.0.0", "the pod's other interfaces must reach the gateway"
    assert config.gateway.port == port_number(gateway, "http")
    parsed = _parse(gateway["args"])
    assert parsed.command == "gateway" and parsed.host is None and parsed.port is None
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "config")
    assert Path(parsed.config) == Path(mount["mountPath"]) / CONFIG_KEY


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_redis_url_names_the_redis_service(kustomization: str, tmp_path: Path) -> None:
    manifests = render(kustomization)
    url = urlparse(_config(manifests, tmp_path).redis.url)
    service = one(manifests, "Service", url.hostname)
    assert url.port in {p["port"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_redis_replicas_matches_the_gateway_count(kustomization: str, tmp_path: Path) -> None:
    """redis.replicas = the HPA's minReplicas where an HPA scales the gateway, else the Deployment's replicas."""
    manifests = render(kustomization)
    hpas = objects(manifests, "HorizontalPodAutoscaler")
    expected = (hpas[0]["spec"]["minReplicas"] if hpas
                else one(manifests, "Deployment", "kvgate-gateway")["spec"].get("replicas", 1))
    assert _config(manifests, tmp_path).redis.replicas == expected


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_pool_tokenizer_is_the_folder_the_gateway_image_bakes(kustomization: str, tmp_path: Path) -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text(encoding="utf-8")
    for name, pool in _config(render(kustomization), tmp_path).pools.items():
        assert pool.tokenizer is not None and pool.tokenizer.startswith("/opt/kvgate/tokenizers/"), name
        assert f"mkdir -p {pool.tokenizer}" in dockerfile, (
            f"pools.{name}.tokenizer: the gateway image has no {pool.tokenizer}")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_workers_register_in_the_gateways_redis_and_pool(kustomization: str, tmp_path: Path) -> None:
    manifests = render(kustomization)
    config = _config(manifests, tmp_path)
    worker = container(one(manifests, "StatefulSet", "kvgate-worker"), "worker")
    args = _parse(_args_with_env(worker))
    assert args.command == "worker"
    assert args.register == config.redis.url
    assert args.pool in config.pools
    assert args.advertise_host == "10.1.2.3", "workers advertise their pod IP ($(POD_IP))"
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert args.host == "0.0.0.0"
    assert args.port == port_number(worker, "http")
    kv_port = int(urlparse(args.kv_events_endpoint).port)
    assert kv_port == port_number(worker, "kv-events")
    assert port_number(worker, "kv-replay") == kv_port + 1, "the replay socket binds PORT + 1"


def test_vllm_sidecar_registers_what_vllm_serves(tmp_path: Path) -> None:
    manifests = load_example("examples/vllm-worker.yaml")
    config = _config(render("overlays/production"), tmp_path)
    workload = one(manifests, "StatefulSet", "kvgate-vllm")
    vllm, sidecar = container(workload, "vllm"), container(workload, "register")
    args = _parse(_args_with_env(sidecar))
    assert args.command == "register"
    assert args.redis == config.redis.url and args.pool in config.pools
    assert args.model == config.pools[args.pool].model
    assert urlparse(args.url).port == port_number(vllm, "http")
    kv_config = json.loads(vllm["args"][vllm["args"].index("--kv-events-config") + 1])
    assert kv_config["enable_kv_cache_events"] is True
    assert urlparse(args.kv_events_endpoint).port == int(kv_config["endpoint"].rsplit(":", 1)[1])
    assert int(kv_config["endpoint"].rsplit(":", 1)[1]) == port_number(vllm, "kv-events")
    assert int(kv_config["replay_endpoint"].rsplit(":", 1)[1]) == port_number(vllm, "kv-replay")
    assert vllm["args"][vllm["args"].index("--served-model-name") + 1] == args.model
    assert sidecar["image"].split(":")[0] == "kvgate-gateway", "the sidecar runs the torch-free gateway image"
