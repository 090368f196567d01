"""The retry budget across gateway replicas: two gateways on one Redis in front of failing workers retry,
together, what one gateway's budget allows."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from tests.gateway.conftest import API_KEY, MODEL, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # gateway, worker and redis processes

RATIO = 0.1
FLOOR_PER_S = 1.0  # 10 retries a 10 s window, fleet-wide
REQUESTS = 60


def test_two_gateways_on_one_redis_retry_within_one_budget(tmp_path, redis_server):
    """Every worker answers 503: each request wants one retry (two workers). One budget allows
    0.1 x 60 + 10 = 16 retries; two budgets of their own would allow 2 x (0.1 x 30 + 10) = 26."""
    with ExitStack() as stack:
        fakes = [stack.enter_context(running(fake_worker_process("status503"))) for _ in range(2)]
        config = gateway_config([worker_entry(f"bad{i}", f.url) for i, f in enumerate(fakes)], None,
                                breaker={"fail_max": 1000},
                                upstream={"retry_budget_ratio": RATIO, "retry_budget_min_per_s": FLOOR_PER_S})
        config["redis"] = {"url": redis_server.url, "replicas": 2}
        gateways = [start_gateway(stack, config, tmp_path) for _ in range(2)]
        deadline_s = time.monotonic() + 5
        while not all(metric_value(g.url, "kvgate_shared_state", part="retry_budgets") == 1 for g in gateways):
            assert time.monotonic() < deadline_s, "the retry budgets did not sync with Redis"
            time.sleep(0.05)
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10) as client:
            for i in range(REQUESTS):
                response = client.post(f"{gateways[i % 2].url}/v1/completions",
                                       json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 1})
                assert response.status_code == 503
        retries = sum(metric_value(g.url, "kvgate_upstream_retries_total") for g in gateways)
        calls = sum(httpx.get(f"{f.url}/calls").json()["generate"] for f in fakes)
        assert calls == REQUESTS + retries
        one_budget = RATIO * REQUESTS + FLOOR_PER_S * 10
        # a retry or two either side: shares are whole retries (rounded at random), and the last requests'
        # ratio is spent by nobody; far from the 26 of two budgets
        assert one_budget - 4 <= retries <= one_budget + 2, retries
        assert all(metric_value(g.url, "kvgate_retry_budget_refusals_total") > 0 for g in gateways)
