"""What `kvgate up` runs: the child processes a config describes, and the banner it prints."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import TextIO

from kvgate.config import KvgateConfig, LoggingConfig, TracingConfig, WorkerConfig
from kvgate.supervisor import ChildSpec

DEV_KEY_PREFIX = "kvg-dev-"


def worker_argv(worker: WorkerConfig, tracing: TracingConfig | None = None,
                logs: LoggingConfig | None = None) -> tuple[str, ...]:
    """`kvgate worker ...` for a worker whose config has a launch section, with the config's tracing
    settings (those it sets; the worker takes OTEL_* variables for the others) and request-log settings."""
    launch = worker.launch
    assert launch is not None
    argv = [
        sys.executable, "-m", "kvgate", "worker",
        "--model", launch.model,
        "--port", str(worker.port),
        "--executor", launch.executor,
        "--block-size", str(launch.block_size),
        "--max-num-seqs", str(launch.max_num_seqs),
        "--worker-id", worker.name,
    ]
    optional = {
        "--num-blocks": launch.num_blocks,
        "--max-num-batched-tokens": launch.max_num_batched_tokens,
        "--served-model-name": launch.served_model_name,
        "--sim-timing": launch.sim_timing,
        "--kv-events-endpoint": worker.kv_events_endpoint,
    }
    if tracing is not None:
        optional.update({"--tracing-exporter": tracing.exporter, "--tracing-endpoint": tracing.endpoint,
                         "--tracing-sample-ratio": tracing.sample_ratio})
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if logs is not None and not logs.requests:
        argv.append("--no-request-log")
    if logs is not None and logs.prompt_token_ids:
        argv.append("--log-prompt-token-ids")
    return (*argv, *launch.extra_args)


def stack_specs(config: KvgateConfig, config_path: Path, gateway_port: int, api_key: str | None) -> list[ChildSpec]:
    """Workers first (non-critical: the gateway routes around a dead one while it restarts), then the gateway.

    The gateway reloads its routing policies on SIGHUP only when it has a policies file; without one,
    SIGHUP would end it, so it is not passed on.
    """
    specs = [
        ChildSpec(name=w.name, argv=worker_argv(w, config.tracing, config.logging),
                  health_url=f"{w.url.rstrip('/')}/health")
        for w in config.launched_workers()
    ]
    host = config.gateway.host
    argv = (sys.executable, "-m", "kvgate", "gateway", "--config", str(config_path),
            "--host", host, "--port", str(gateway_port))
    env = {config.auth.dev_key_env: api_key} if config.auth.dev_key_env and api_key else {}
    specs.append(ChildSpec(name="gateway", argv=argv, critical=True, env=env,
                           health_url=f"{config.gateway.scheme}://{_url_host(host)}:{gateway_port}/ready",
                           reloads_on_sighup=config.routing.policies_file is not None))
    return specs


def dev_api_key(env_value: str | None) -> str:
    """The development key: KVGATE_API_KEY when set, a fresh random one otherwise."""
    return env_value or DEV_KEY_PREFIX + secrets.token_urlsafe(24)


def print_banner(out: TextIO, config: KvgateConfig, gateway_port: int, api_key: str | None) -> None:
    """What `kvgate up` prints once the stack is ready; api_key None: the dev key is off (auth.keys are
    configured), so the example names no key."""
    base = f"{config.gateway.scheme}://{_url_host(config.gateway.host)}:{gateway_port}"
    model = next(iter(config.pools.values())).model
    shown = api_key or "<one of auth.keys>"
    out.write(
        "\nkvgate is up.\n"
        f"  OpenAI base URL: {base}/v1\n"
        f"  API key:         {api_key or 'one of auth.keys (the dev key is off while keys are configured)'}\n"
        f"  Metrics:         {base}/metrics\n\n"
        "Try:\n"
        f"  curl {base}/v1/chat/completions \\\n"
        f"    -H 'Authorization: Bearer {shown}' -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 64, \"temperature\": 0}}'\n\n"
        "Press Ctrl-C to stop.\n"
    )
    out.flush()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
