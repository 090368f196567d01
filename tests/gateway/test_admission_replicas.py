"""Tenant limits across gateway replicas: two gateways on one Redis hold a tenant to its rate; with
Redis gone each enforces its share locally and says so in /ready and metrics, and it comes back."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import httpx
import pytest

from kvgate.keys import hash_key
from tests.gateway.conftest import MODEL, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # gateway, worker and redis processes

KEY = "key-metered"
RATE_PER_S = 10


def metered_config(worker_url: str, redis_url: str, replicas: int = 2) -> dict:
    config = gateway_config([worker_entry("w", worker_url)], None,
                            auth={"keys": [{"tenant": "metered", "sha256": hash_key(KEY)}]})
    config["tenants"] = {"metered": {"requests_per_s": RATE_PER_S, "requests_burst": RATE_PER_S}}
    config["redis"] = {"url": redis_url, "replicas": replicas}
    return config


async def offer(urls: list[str], rate_per_s: float, duration_s: float) -> tuple[list[int], float]:
    """Requests at a steady rate for duration_s, alternating between urls; their statuses, and the
    seconds from the first send to the last."""
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=200)) as client:
        async def one(url: str) -> int:
            response = await client.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                         json={"model": MODEL, "prompt": "p", "max_tokens": 1})
            return response.status_code

        tasks, started = [], time.monotonic()
        for i in range(int(rate_per_s * duration_s)):
            await asyncio.sleep(max(0.0, started + i / rate_per_s - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(urls[i % len(urls)])))
        sent_s = time.monotonic() - started
        return list(await asyncio.gather(*tasks)), sent_s


@pytest.mark.parametrize("replicas", [2, 4])
def test_gateways_on_one_redis_admit_a_tenant_at_its_rate(tmp_path, redis_server, replicas):
    """One tenant at 3x its requests_per_s for 20 s through two or four replicas: admitted within 5% of
    the limit."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = metered_config(worker.url, redis_server.url, replicas)
        gateways = [start_gateway(stack, config, tmp_path) for _ in range(replicas)]
        statuses, sent_s = asyncio.run(offer([g.url for g in gateways], 3 * RATE_PER_S, 20.0))
        admitted = statuses.count(200)
        allowed = RATE_PER_S * sent_s + RATE_PER_S  # the rate over the run, plus one burst
        assert set(statuses) <= {200, 429}
        assert abs(admitted - allowed) / allowed <= 0.05, (admitted, allowed)
        assert all(metric_value(g.url, "kvgate_tenant_limits_shared") == 1 for g in gateways)


def test_without_redis_each_replica_enforces_its_share_and_says_so_until_redis_returns(tmp_path, redis_server):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, metered_config(worker.url, redis_server.url), tmp_path)
        redis_server.stop()
        statuses, _ = asyncio.run(offer([gateway.url], 100, 0.5))  # 50 requests at once, Redis gone
        # each of the 2 replicas keeps half the burst (5) and half the rate (5/s) while Redis is down
        assert 5 <= statuses.count(200) <= 8 and set(statuses) == {200, 429}
        assert metric_value(gateway.url, "kvgate_tenant_limits_shared") == 0
        ready = httpx.get(f"{gateway.url}/ready").json()
        assert ready["status"] == "ready" and any("tenant limits local" in d for d in ready["degraded"])
        redis_server.start()
        deadline = time.monotonic() + 10
        while metric_value(gateway.url, "kvgate_tenant_limits_shared") != 1:
            assert time.monotonic() < deadline, "tenant limits did not go back to Redis"
            time.sleep(0.1)
        assert "degraded" not in httpx.get(f"{gateway.url}/ready").json()
