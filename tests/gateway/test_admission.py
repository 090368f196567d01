"""Admission through a real gateway: tenant limits answer 429, an overloaded pool 503, both with
Retry-After and the reason, without reaching a worker; queued requests are served in turn or
answered at their deadline; workers only see the admitted priority."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import openai
import pytest

from kvgate.keys import hash_key
from tests.gateway.conftest import MODEL, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # gateway and worker processes

KEYS = {"gold": "key-gold", "plain": "key-plain", "flood": "key-flood", "batcher": "key-batcher",
        "metered": "key-metered"}
TENANTS = {"gold": {"priority": "critical"}, "plain": {}, "flood": {"requests_per_s": 2, "requests_burst": 2},
           "batcher": {"requests_per_s": 0.2, "requests_burst": 1, "max_concurrency": 2},
           "metered": {"requests_per_s": 0.1, "requests_burst": 3, "tokens_per_min": 6000}}


def admission_config(worker_url: str, **pool_admission) -> dict:
    config = gateway_config([worker_entry("w", worker_url)], None,
                            auth={"keys": [{"tenant": t, "sha256": hash_key(k)} for t, k in KEYS.items()]})
    config["tenants"] = TENANTS
    # no standing-queue timeouts here (a worker that holds each request for a second would make one)
    config["pools"]["default"]["admission"] = {"queue_interval_s": 30, **pool_admission}
    return config


def post(url: str, tenant: str, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})},
                      json={"model": MODEL, "prompt": "p", "max_tokens": 1, **body})


def worker_requests(worker_url: str) -> list[dict]:
    return httpx.get(f"{worker_url}/requests").json()


async def post_together(url: str, tenant: str, count: int, headers: dict | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(0.05 * i)  # in this order
            return await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 1},
                                     headers={"Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})})
        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_others_are_served(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, admission_config(worker.url), tmp_path)
        statuses = [post(gateway.url, "flood").status_code for _ in range(4)]
        assert statuses[:2] == [200, 200] and 429 in statuses[2:]
        refused = post(gateway.url, "flood")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "requests_per_s" and "flood" in error["message"]
        assert post(gateway.url, "plain").status_code == 200
        answered = sum(1 for r in worker_requests(worker.url) if r["body"]["prompt"] == "p")
        assert answered == 3  # the refused requests never reached the worker
        assert metric_value(gateway.url, "kvgate_rejected_total", tenant="flood", reason="requests_per_s") >= 2
        assert metric_value(gateway.url, "kvgate_refusal_seconds_count", reason="requests_per_s") >= 2


def test_the_openai_sdk_sees_a_rate_limit_error(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, admission_config(worker.url), tmp_path)
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["flood"], max_retries=0)
        for _ in range(2):
            client.completions.create(model=MODEL, prompt="p", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="p", max_tokens=1)
        assert info.value.code == "requests_per_s"


def test_answers_say_what_is_left_of_the_tenants_limits_as_openai_does(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, admission_config(worker.url), tmp_path)
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["metered"], max_retries=0)
        first = client.completions.with_raw_response.create(model=MODEL, prompt="p", max_tokens=10).headers
        assert (first["x-ratelimit-limit-requests"], first["x-ratelimit-remaining-requests"]) == ("3", "2")
        assert first["x-ratelimit-reset-requests"] == "10s"  # one request back at 0.1 a second
        assert first["x-ratelimit-limit-tokens"] == "6000"
        assert first["x-ratelimit-remaining-tokens"] == "5989"  # the prompt's estimate (1) + max_tokens (10)
        assert first["x-ratelimit-reset-tokens"] == "110ms"  # 11 tokens back at 100 a second
        with client.completions.with_streaming_response.create(model=MODEL, prompt="p", max_tokens=10,
                                                               stream=True) as streamed:
            assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        unlimited = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {KEYS['plain']}"},
                               json={"model": MODEL, "prompt": "p", "max_tokens": 1}, timeout=30)
        assert unlimited.status_code == 200 and not any(h.startswith("x-ratelimit") for h in unlimited.headers)


def test_a_batch_counts_once_against_requests_per_s_and_keeps_its_prompts_under_max_concurrency(tmp_path):
    """A batch of 5 prompts from a tenant allowed one request in 5 s and 2 in flight: answered whole (its
    prompts 2 at a time, each held a while by the worker); the tenant's next request is over its rate."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("hold")))
        gateway = start_gateway(stack, admission_config(worker.url), tmp_path)
        batch = post(gateway.url, "batcher", prompt=[f"q{i}" for i in range(5)])
        assert batch.status_code == 200, batch.text
        assert [c["index"] for c in batch.json()["choices"]] == [0, 1, 2, 3, 4]
        assert batch.json()["usage"]["prompt_tokens"] == 15
        assert sorted(r["body"]["prompt"] for r in worker_requests(worker.url)) == [f"q{i}" for i in range(5)]
        assert metric_value(gateway.url, "kvgate_rejected_total", tenant="batcher") == 0
        refused = post(gateway.url, "batcher")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "requests_per_s"


def test_an_overloaded_pool_queues_then_refuses_fast_without_touching_a_worker(tmp_path):
    """Limit 2, queue 2: two served at once, two after them in turn, the fifth refused at once."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("hold")))
        config = admission_config(worker.url, max_concurrency=2, initial_concurrency=2, queue_size=2)
        gateway = start_gateway(stack, config, tmp_path)
        responses = asyncio.run(post_together(gateway.url, "plain", 5))
        assert sorted(r.status_code for r in responses) == [200, 200, 200, 200, 503]
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.json()["error"]["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
        assert 0 < float(refused.headers["server-timing"].removeprefix("gateway;dur=")) < 1000  # the gateway's ms
        assert httpx.get(f"{worker.url}/calls").json()["generate"] == 4
        assert metric_value(gateway.url, "kvgate_rejected_total", reason="queue_full") == 1
        assert metric_value(gateway.url, "kvgate_refusal_seconds_count", reason="queue_full") == 1
        assert metric_value(gateway.url, "kvgate_refusal_seconds_bucket", reason="queue_full", le="1.0") == 1
        assert metric_value(gateway.url, "kvgate_admitted_total", tenant="plain") == 4
        assert metric_value(gateway.url, "kvgate_queue_depth") == 0
        assert metric_value(gateway.url, "kvgate_admitted_in_flight") == 0


def test_a_queued_request_is_answered_at_its_deadline_and_never_sent(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("hold")))
        config = admission_config(worker.url, max_concurrency=1, initial_concurrency=1)
        gateway = start_gateway(stack, config, tmp_path)

        async def scenario() -> list[httpx.Response]:
            first = asyncio.ensure_future(post_together(gateway.url, "plain", 1))
            await asyncio.sleep(0.3)  # the worker holds the first for a second
            late = await post_together(gateway.url, "plain", 1, headers={"x-request-deadline-ms": "300"})
            return (await first) + late

        held, late = asyncio.run(scenario())
        assert held.status_code == 200
        assert late.status_code == 503 and late.json()["error"]["code"] == "deadline_exceeded"
        assert httpx.get(f"{worker.url}/calls").json()["generate"] == 1


def test_critical_work_goes_first_and_workers_see_only_the_admitted_priority(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("hold")))
        config = admission_config(worker.url, max_concurrency=1, initial_concurrency=1)
        gateway = start_gateway(stack, config, tmp_path)

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                def send(tenant: str, prompt: str, **extra):
                    return client.post(f"{gateway.url}/v1/completions",
                                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra.get("body", {})},
                                       headers={"Authorization": f"Bearer {KEYS[tenant]}", **extra.get("headers", {})})
                busy = asyncio.ensure_future(send("plain", "busy"))
                await asyncio.sleep(0.3)
                # queued behind "busy": a standard request that asks to be critical, then a critical one
                raised = asyncio.ensure_future(send("plain", "asks-critical", headers={"x-priority": "critical"},
                                                    body={"priority": -100}))
                await asyncio.sleep(0.1)
                gold = asyncio.ensure_future(send("gold", "gold"))
                lowered = asyncio.ensure_future(send("gold", "gold-batch", headers={"x-priority": "batch"}))
                assert all(r.status_code == 200 for r in await asyncio.gather(busy, raised, gold, lowered))

        asyncio.run(scenario())
        seen = [(r["body"]["prompt"], r["headers"].get("x-priority"), "priority" in r["body"])
                for r in worker_requests(worker.url)]
        assert seen == [("busy", "1", False), ("gold", "0", False), ("asks-critical", "1", False),
                        ("gold-batch", "2", False)]


def test_a_bad_priority_or_deadline_header_is_a_400_naming_it(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, admission_config(worker.url), tmp_path)
        for header, value in (("x-priority", "urgent"), ("x-request-deadline-ms", "-5"), ("x-workflow-step", "0")):
            response = post(gateway.url, "plain", headers={header: value})
            assert response.status_code == 400 and response.json()["error"]["param"].lower() == header


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_an_answer_no_worker_could_finish_ends_its_permit_once_with_an_error(tmp_path, stream):
    """The only worker stalls mid-answer and nobody can continue it: the client gets an OpenAI-style
    error (a 503 before any byte, an error event in a stream), and the pool's slot comes back."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("stall_mid_stream")))
        gateway = start_gateway(stack, admission_config(worker.url), tmp_path)
        response = post(gateway.url, "plain", stream=stream, max_tokens=16)
        if stream:
            assert response.status_code == 200 and '"code": "upstream_unavailable"' in response.text.replace(":", ": ")
        else:
            assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_unavailable"
        assert metric_value(gateway.url, "kvgate_admitted_in_flight") == 0
        statuses = {"503": 0, "200": 0}
        for status in statuses:
            statuses[status] = metric_value(gateway.url, "kvgate_requests_total", tenant="plain", status=status)
        assert sum(statuses.values()) == 1


def test_each_request_costs_its_usage_at_its_pools_prices(tmp_path):
    """The fake worker reports 3 prompt and 1 completion tokens per answer."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = admission_config(worker.url)
        config["pools"]["default"]["prices"] = {"prompt_per_1m": 2.0, "cached_per_1m": 0.5, "completion_per_1m": 8.0}
        gateway = start_gateway(stack, config, tmp_path)
        for _ in range(2):
            assert post(gateway.url, "plain").status_code == 200
        per_request = (3 * 2.0 + 1 * 8.0) / 1e6
        assert metric_value(gateway.url, "kvgate_cost_total", tenant="plain") == pytest.approx(2 * per_request)
        assert metric_value(gateway.url, "kvgate_cost_per_successful_request", tenant="plain") == \
            pytest.approx(per_request)
