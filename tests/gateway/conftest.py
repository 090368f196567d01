"""A fleet for gateway tests: real tiny-model workers and a real gateway, all on loopback."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port_pair
from tests.processes import gateway_process, running, worker_process
from tests.tiny_models import build_model_dir

API_KEY = "test-key"
MODEL = "tiny"
BLOCK_SIZE = 8


@pytest.fixture(scope="session")
def gateway_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Speaks only plain words, so mid-stream failover can continue from the delivered text exactly
    (a build of its own: a word-level tokenizer and no special tokens in its output, which the shared
    tiny_llama_dir does not promise)."""
    return build_model_dir(tmp_path_factory.mktemp("gateway-tiny-llama"), plain_words=True)


def metric_value(gateway_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway_url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def worker_entry(name: str, url: str, **extra) -> dict:
    return {"name": name, "url": url, "block_size": BLOCK_SIZE, **extra}


def gateway_config(workers: list[dict], model_dir: Path | None, **sections) -> dict:
    config = {
        "pools": {"default": {"model": MODEL, "workers": workers,
                              "tokenizer": str(model_dir) if model_dir else None}},
        "upstream": {"connect_timeout_s": 1.0, "first_byte_timeout_s": 3.0, "idle_timeout_s": 3.0,
                     "max_retries": 2},
        "health": {"interval_s": 0.5, "timeout_s": 1.0},
        "breaker": {"fail_max": 3, "reset_timeout_s": 30.0},
        "routing": {"debug_header": True},  # tests read x-kvgate-route (off by default)
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def start_tiny_worker(stack: ExitStack, model_dir: Path, kv_port: int | None = None):
    process = worker_process(model_dir, "--block-size", str(BLOCK_SIZE), "--num-blocks", "256",
                             "--served-model-name", MODEL, kv_events_port=kv_port)
    return stack.enter_context(running(process))


def start_gateway(stack: ExitStack, config: dict, tmp_dir: Path, ready: bool = True, env: dict | None = None):
    process = gateway_process(config, tmp_dir, api_key=API_KEY, env=env)
    return stack.enter_context(running(process, "/ready" if ready else "/health"))


@pytest.fixture(scope="module")
def fleet(gateway_model_dir, tmp_path_factory):
    """Two real tiny-model workers (with KV events) behind a real gateway."""
    tmp = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:
        kv_ports = [free_port_pair() for _ in range(2)]
        workers = [start_tiny_worker(stack, gateway_model_dir, kv_port=p) for p in kv_ports]
        entries = [worker_entry(f"w{i}", w.url, kv_events_endpoint=f"tcp://127.0.0.1:{p}")
                   for i, (w, p) in enumerate(zip(workers, kv_ports))]
        gateway = start_gateway(stack, gateway_config(entries, gateway_model_dir), tmp)
        yield {"gateway": gateway, "workers": workers}


@pytest.fixture
def client(fleet):
    """The openai SDK, pointed at the fleet's gateway."""
    with openai.OpenAI(base_url=f"{fleet['gateway'].url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def direct(fleet):
    """The openai SDK, pointed at the fleet's first worker (no gateway)."""
    with openai.OpenAI(base_url=f"{fleet['workers'][0].url}/v1", api_key="unused", max_retries=0) as c:
        yield c
