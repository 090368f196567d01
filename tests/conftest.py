"""Fixtures shared by every test package: free loopback ports (loadtest.procs), a manual clock, the tiny
model folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.clock import ManualClock
from loadtest.procs import free_port
from tests.redis_server import RedisServer
from tests.tiny_models import build_model_dir


def free_port_pair() -> int:
    """A port P whose replay port (P + 1) is free too: a KV-event endpoint and its replay socket."""
    return free_port(pair=True)


@pytest.fixture
def clock() -> ManualClock:
    """The injected clock for router, admission and gateway logic; tests move it with advance()."""
    return ManualClock()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own (stopped at its end), so it may stop and start it."""
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LlamaForCausalLM: 2 layers, 4 heads over 2 KV heads (GQA), untied lm_head; built once per
    session for every package (worker, contract, kvgate up). Tests that change files work on a copy."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama"))
