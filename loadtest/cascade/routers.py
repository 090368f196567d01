"""The routers a configuration puts in front of the fleet: kvgate from generated YAML (fallbacks to the
small pool on or off, slow start as configured), SGLang's router (cache_aware, the primary pool only) and
LiteLLM's proxy (a deployment per worker, its own fallbacks from big-model to small-model)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import yaml

from kvgate.keys import hash_key
from loadtest.cascade.fleet import PRIMARY, PRIMARY_MODEL, SMALL, SMALL_MODEL, WorkerSpec
from loadtest.cascade.workload import TenantLoad
from loadtest.peers import LITELLM, SGLANG_ROUTER
from loadtest.peers.sglang import external_command
from loadtest.procs import ChildProcess, free_port

FALLBACKS = [{"pool": SMALL, "when": ["overloaded", "unavailable"]}]


@dataclass(frozen=True, slots=True)
class Router:
    """A started router: where clients send (base_url ends in /v1), its /metrics and /ready when it is kvgate."""

    name: str
    child: ChildProcess
    base_url: str
    metrics_url: str | None = None
    ready_url: str | None = None
    any_answer: bool = False  # healthy once its health URL answers below 500 (not only 200)


def gateway_config(workers: Sequence[WorkerSpec], port: int, tenants: Sequence[TenantLoad],
                   api_keys: Mapping[str, str], *, fallbacks: bool, slow_start_s: float,
                   max_num_seqs: int) -> dict[str, Any]:
    """kvgate's config: pools primary and small (kv_aware, each admitting what its workers run), the
    tenants with their priorities and hashed keys, no request log lines (no router under test writes any);
    with fallbacks, the primary pool's requests move to small when it is overloaded or unavailable."""
    def pool(name: str, model: str) -> dict[str, Any]:
        members = [w for w in workers if w.pool == name]
        return {"model": model, "tokenizer": "default", "policy": {"type": "kv_aware", "parameters": {}},
                "workers": [{"name": w.name, "url": w.url, "kv_events_endpoint": w.kv_events_endpoint}
                            for w in members],
                "admission": {"max_concurrency": len(members) * max_num_seqs}, "slow_start_s": slow_start_s}

    pools = {PRIMARY: pool(PRIMARY, PRIMARY_MODEL), SMALL: pool(SMALL, SMALL_MODEL)}
    if fallbacks:
        pools[PRIMARY]["fallbacks"] = FALLBACKS
    return {"gateway": {"host": "127.0.0.1", "port": port},
            "auth": {"keys": [{"tenant": t, "sha256": hash_key(k)} for t, k in api_keys.items()], "dev_key_env": None},
            "tenants": {t.name: {"priority": t.priority} for t in tenants},
            "logging": {"requests": False}, "pools": pools}


def start_kvgate(name: str, config: dict[str, Any], work_dir: Path, cpus: Collection[int] | None) -> Router:
    port = config["gateway"]["port"]
    path = work_dir / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "kvgate", "gateway", "--config", str(path), "--port", str(port)]
    child = ChildProcess(name, argv, work_dir / "logs" / f"{name}.log", f"{url}/ready", cpus=cpus)
    return Router(name, child, f"{url}/v1", f"{url}/metrics", f"{url}/ready")


def start_sglang(name: str, primary: Sequence[WorkerSpec], work_dir: Path, cpus: Collection[int] | None) -> Router:
    """SGLang's router, cache_aware, over the primary pool's workers (it has no fallback pools)."""
    port = free_port()
    argv = external_command("cache_aware", python=str(SGLANG_ROUTER.python)).argv([w.url for w in primary], port,
                                                                                  free_port())
    url = f"http://127.0.0.1:{port}"
    child = ChildProcess(name, argv, work_dir / "logs" / f"{name}.log", f"{url}/v1/models", cpus=cpus)
    return Router(name, child, f"{url}/v1", any_answer=True)


def litellm_config(workers: Sequence[WorkerSpec]) -> dict[str, Any]:
    """A deployment per worker under its model's name, and PEERS.md's fallbacks: big-model -> small-model."""
    return {"model_list": [{"model_name": w.model, "litellm_params": {
                "model": f"openai/{w.model}", "api_base": f"{w.url}/v1", "api_key": "none"}} for w in workers],
            "router_settings": {"fallbacks": [{PRIMARY_MODEL: [SMALL_MODEL]}]}}


def start_litellm(name: str, workers: Sequence[WorkerSpec], work_dir: Path, cpus: Collection[int] | None) -> Router:
    config, log_config = work_dir / "litellm.yaml", work_dir / "litellm-logging.json"
    config.write_text(yaml.safe_dump(litellm_config(workers), sort_keys=False))
    log_config.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                      "loggers": {"uvicorn.access": {"level": "WARNING"}}}))
    port = free_port()
    argv = [str(LITELLM.venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", "1", "--log_config", str(log_config)]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    url = f"http://127.0.0.1:{port}"
    child = ChildProcess(name, argv, work_dir / "logs" / f"{name}.log", f"{url}/health/liveliness", env, cpus)
    return Router(name, child, f"{url}/v1")
