"""`kvgate worker` options as worker/cli.py turns them into servers: uvicorn's keep-alive timeout and shutdown
grace (a stream under way finishes after SIGTERM), and where the KV-event sockets bind."""

from __future__ import annotations

import argparse
import json
import signal

import httpx
import pytest
from starlette.applications import Starlette

from kvgate.cli import build_parser
from tests.conftest import free_port_pair
from tests.processes import running, worker_process
from worker.cli import DEFAULT_SHUTDOWN_GRACE_S, DEFAULT_TIMEOUT_KEEP_ALIVE_S, _build_publisher, uvicorn_config
from worker.kv_publisher import bind_endpoint, is_loopback

GATEWAY_MAX_IDLE_S = 4.0  # the longest the gateway keeps an idle connection to a worker (gateway/upstream_http.py)


def parsed_worker_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", "--model", "default", "--port", "8001", *extra])


def test_the_worker_keeps_idle_connections_longer_than_the_gateway_does():
    config = uvicorn_config(Starlette(), parsed_worker_args())

    assert config.timeout_keep_alive == DEFAULT_TIMEOUT_KEEP_ALIVE_S >= 15 > GATEWAY_MAX_IDLE_S
    assert (config.host, config.port) == ("127.0.0.1", 8001)


def test_the_keep_alive_option_reaches_uvicorn():
    assert uvicorn_config(Starlette(), parsed_worker_args("--timeout-keep-alive", "42")).timeout_keep_alive == 42.0


def test_a_bare_kv_events_port_binds_both_sockets_to_loopback_only():
    port = free_port_pair()
    publisher = _build_publisher(argparse.Namespace(kv_events_endpoint=str(port), worker_id="w0"))
    try:
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{port + 1}"
    finally:
        publisher.close()


def test_no_kv_events_endpoint_publishes_nothing():
    assert _build_publisher(argparse.Namespace(kv_events_endpoint=None, worker_id=None)) is None


@pytest.mark.parametrize(("spec", "endpoint", "loopback"), [
    ("5701", "tcp://127.0.0.1:5701", True),
    ("tcp://127.0.0.1:5701", "tcp://127.0.0.1:5701", True),
    ("tcp://localhost:5701", "tcp://localhost:5701", True),
    ("tcp://[::1]:5701", "tcp://[::1]:5701", True),
    ("ipc:///tmp/kv.sock", "ipc:///tmp/kv.sock", True),
    ("tcp://*:5557", "tcp://*:5557", False),
    ("tcp://0.0.0.0:5557", "tcp://0.0.0.0:5557", False),
    ("tcp://10.0.0.12:5557", "tcp://10.0.0.12:5557", False),
], ids=["bare-port", "loopback", "localhost", "ipv6-loopback", "ipc", "wildcard", "any-address", "lan-address"])
def test_kv_events_bind_where_the_endpoint_says_and_only_a_bare_port_defaults_to_loopback(spec, endpoint, loopback):
    assert bind_endpoint(spec) == endpoint
    assert is_loopback(endpoint) is loopback


def test_the_shutdown_grace_reaches_uvicorn():
    assert uvicorn_config(Starlette(), parsed_worker_args()).timeout_graceful_shutdown == DEFAULT_SHUTDOWN_GRACE_S
    assert uvicorn_config(Starlette(), parsed_worker_args("--shutdown-grace", "3")).timeout_graceful_shutdown == 3.0


@pytest.mark.slow
def test_a_worker_told_to_stop_finishes_the_streams_it_serves(tiny_llama_dir):
    """SIGTERM mid-answer: no new connections, but the answer under way streams to its end."""
    with running(worker_process(tiny_llama_dir, "--served-model-name", "tiny")) as worker:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 48, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            worker.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        chunks = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]"
        assert chunks[-1]["usage"]["completion_tokens"] == 48
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert worker.proc.wait(30) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{worker.url}/health", timeout=2)
