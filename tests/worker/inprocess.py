"""A real worker (engine, engine loop, HTTP handlers) served by uvicorn in a thread of the test process,
over any executor: the tiny model's TorchExecutor, or one wrapped to fail on demand."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from tests.conftest import free_port
from worker.cli import build_state, serve, uvicorn_config
from worker.engine.config import EngineConfig
from worker.model.tokenizer import load_tokenizer
from worker.server import WorkerState, build_app

BLOCK_SIZE = 8
MODEL_NAME = "tiny"


def tiny_executor(model_dir: Path, num_blocks: int = 64):
    from worker.executor.torch_executor import TorchExecutor

    return TorchExecutor.from_pretrained(model_dir, device="cpu", block_size=BLOCK_SIZE, num_blocks=num_blocks)


def worker_state(model_dir: Path, executor) -> WorkerState:
    """WorkerState as `kvgate worker` builds it (worker.cli.build_state), its engine loop started."""
    config = EngineConfig(model_name=MODEL_NAME, block_size=executor.block_size, num_blocks=executor.num_blocks)
    return build_state(executor, load_tokenizer(model_dir), model_dir, config)


@dataclass
class ServedWorker:
    url: str
    state: WorkerState
    server: uvicorn.Server
    thread: threading.Thread
    exit_status: list[int] = field(default_factory=list)  # worker.cli.serve's return value, once it returned

    def wait_exit_status(self, timeout_s: float = 10.0) -> int:
        self.thread.join(timeout_s)
        assert self.exit_status, f"the server did not stop within {timeout_s} s"
        return self.exit_status[0]


@contextmanager
def serving(state: WorkerState, timeout_s: float = 10.0) -> Iterator[ServedWorker]:
    """Run worker.cli.serve over state's app on a free loopback port until the block ends (or it stops)."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(build_app(state), argparse.Namespace(host="127.0.0.1", port=port)))
    served = ServedWorker(f"http://127.0.0.1:{port}", state, server, threading.Thread(target=lambda: None))
    served.thread = threading.Thread(target=lambda: served.exit_status.append(serve(server, state.engine)),
                                     name="worker-server", daemon=True)
    served.thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert time.monotonic() < deadline and served.thread.is_alive(), "the worker server did not start"
        time.sleep(0.01)
    try:
        yield served
    finally:
        server.should_exit = True
        served.thread.join(timeout_s)
        state.engine.shutdown()


def completion(url: str, client: httpx.Client | None = None, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, **body}
    post = client.post if client is not None else httpx.post
    return post(f"{url}/v1/completions", json=body, timeout=30)
