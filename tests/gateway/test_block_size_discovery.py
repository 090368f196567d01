"""A worker configured without its block size: the gateway takes the one the worker reports, so
the KV events it publishes match the router's keys (a mismatch would leave every hit unseen)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from tests.conftest import free_port_pair
from tests.gateway.conftest import API_KEY, BLOCK_SIZE, MODEL, gateway_config, start_gateway, start_tiny_worker

pytestmark = pytest.mark.slow  # a real worker and a real gateway as processes

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_a_worker_without_a_configured_block_size_is_routed_by_the_size_it_reports(gateway_model_dir, tmp_path):
    assert BLOCK_SIZE != 16  # the default a config without block_size would otherwise key with
    with ExitStack() as stack:
        kv_port = free_port_pair()
        worker = start_tiny_worker(stack, gateway_model_dir, kv_port=kv_port)
        entry = {"name": "w", "url": worker.url, "kv_events_endpoint": f"tcp://127.0.0.1:{kv_port}"}
        config = gateway_config([entry], gateway_model_dir)
        # predictions expire at once: what the router counts on below is confirmed by KV events
        config["pools"]["default"]["policy"] = {"type": "kv_aware", "parameters": {"prediction_ttl_s": 0.05}}
        gateway = start_gateway(stack, config, tmp_path)
        body = {"model": MODEL, "prompt": "the cat sat on the mat " * 12, "max_tokens": 1}
        assert httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, json=body, timeout=10).status_code == 200
        deadline, route = time.monotonic() + 5.0, ""
        while "predicted_cached_tokens=0 " in (route := _route(gateway.url, body)) or not route:
            assert time.monotonic() < deadline, f"the worker's cached prefix was never counted on: {route}"
            time.sleep(0.2)


def _route(gateway_url: str, body: dict) -> str:
    response = httpx.post(f"{gateway_url}/v1/completions", headers=AUTH, json=body, timeout=10)
    assert response.status_code == 200
    return response.headers["x-kvgate-route"]
