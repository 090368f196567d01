"""LiteLLM's proxy as a peer gateway: its config (one `openai/<model>` entry at the upstream) and its start
as PEERS.md runs it (one uvicorn worker, no master key: loopback only, no access log). Installed into
results/litellm-venv (peers.LITELLM)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from loadtest.peers import LITELLM
from loadtest.procs import ChildProcess


def start(name: str, model: str, port: int, upstream_port: int, log_dir: Path, pin: list[str]) -> ChildProcess:
    config, log_config = log_dir / "litellm.yaml", log_dir / "litellm-logging.json"
    config.write_text(yaml.safe_dump({"model_list": [{"model_name": model, "litellm_params": {
        "model": f"openai/{model}", "api_base": f"http://127.0.0.1:{upstream_port}/v1", "api_key": "none"}}]}))
    log_config.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                      "loggers": {"uvicorn.access": {"level": "WARNING"}}}))
    argv = [*pin, str(LITELLM.venv / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", "1", "--log_config", str(log_config)]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    return ChildProcess(name, argv, log_dir / "litellm.log", f"http://127.0.0.1:{port}/health/liveliness", env=env)
