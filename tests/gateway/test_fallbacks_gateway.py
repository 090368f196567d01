"""Fallback pools through a real gateway: a pool that would refuse a request at arrival, or has no healthy
worker, or takes no prompt that long, hands it to its rule's fallback, which answers with its own model
(real tiny-model workers serving another model name) and says so in x-kvgate-pool; a tenant that refuses
moves gets the refusal."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import openai
import pytest

from kvgate.keys import hash_key
from tests.conftest import free_port
from tests.gateway.conftest import BLOCK_SIZE, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import fake_worker_process, running, worker_process

pytestmark = pytest.mark.slow  # gateway and worker processes

KEYS = {"anyone": "key-anyone", "strict": "key-strict"}
TIGHT = {"max_concurrency": 1, "initial_concurrency": 1, "queue_size": 1, "queue_interval_s": 30}


def small_worker(stack: ExitStack, model_dir, name: str = "small", max_model_len: int | None = None):
    extra = ["--max-model-len", str(max_model_len)] if max_model_len else []
    process = worker_process(model_dir, "--block-size", str(BLOCK_SIZE), "--num-blocks", "256",
                             "--served-model-name", name, *extra)
    return stack.enter_context(running(process))


def two_pools(big_workers: list[dict], small_url: str, model_dir, when: list[str], **big) -> dict:
    config = gateway_config([], None, auth={"keys": [{"tenant": t, "sha256": hash_key(k)} for t, k in KEYS.items()]})
    config["pools"] = {
        "big": {"model": "big", "workers": big_workers, "admission": TIGHT,
                "fallbacks": [{"pool": "small", "when": when}], **big},
        "small": {"model": "small", "workers": [worker_entry("s0", small_url)], "tokenizer": str(model_dir)},
    }
    config["tenants"] = {"anyone": {}, "strict": {"fallbacks": False}}
    return config


async def post_together(url: str, tenant: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> httpx.Response:
            await asyncio.sleep(0.1 * i)  # in this order
            return await client.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                                     json={"model": "big", "prompt": f"hello {i}", "max_tokens": 2})
        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_flooded_pool_spills_to_its_fallback_which_answers_with_its_own_model_and_pool(tmp_path, gateway_model_dir):
    with ExitStack() as stack:
        small = small_worker(stack, gateway_model_dir)
        held = stack.enter_context(running(fake_worker_process("hold")))  # big's one worker: a request takes 1 s
        gateway = start_gateway(stack, two_pools([worker_entry("b0", held.url)], small.url, gateway_model_dir,
                                                 ["overloaded"]), tmp_path)
        answers = asyncio.run(post_together(gateway.url, "anyone", 4))
        assert [a.status_code for a in answers] == [200] * 4
        pools = [a.headers["x-kvgate-pool"] for a in answers]
        assert pools == ["big", "big", "small", "small"]  # one running, one queued, then big's queue is full
        assert [a.json()["model"] for a in answers[2:]] == ["small", "small"]  # the model that answered
        assert metric_value(gateway.url, "kvgate_fallbacks_total", from_pool="big", to_pool="small",
                            reason="overloaded") == 2

        strict = asyncio.run(post_together(gateway.url, "strict", 3))
        assert [a.status_code for a in strict] == [200, 200, 503]  # it refuses moves: big's refusal is its answer
        assert strict[2].json()["error"]["code"] == "queue_full" and "retry-after" in strict[2].headers


def test_a_pool_with_every_worker_down_spills_and_the_openai_sdk_sees_the_model_that_answered(
        tmp_path, gateway_model_dir):
    with ExitStack() as stack:
        small = small_worker(stack, gateway_model_dir)
        dead = worker_entry("b0", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        gateway = start_gateway(stack, two_pools([dead], small.url, gateway_model_dir, ["unavailable"]), tmp_path,
                                ready=False)
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["anyone"], max_retries=0) as client:
            raw = client.completions.with_raw_response.create(model="big", prompt="hello", max_tokens=2)
        assert raw.headers["x-kvgate-pool"] == "small" and raw.parse().model == "small"
        assert metric_value(gateway.url, "kvgate_fallbacks_total", reason="unavailable") == 1
        refused = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {KEYS['strict']}"},
                             json={"model": "big", "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_healthy_worker"
        assert "tenant 'strict' accepts none of its fallback pools" in refused.json()["error"]["message"]


def test_a_prompt_too_long_for_its_pool_goes_to_the_long_context_fallback(tmp_path, gateway_model_dir):
    with ExitStack() as stack:
        short = small_worker(stack, gateway_model_dir, name="big", max_model_len=64)
        long = small_worker(stack, gateway_model_dir)
        config = two_pools([worker_entry("b0", short.url)], long.url, gateway_model_dir, ["context_length_exceeded"],
                           tokenizer=str(gateway_model_dir), max_model_len=64)
        gateway = start_gateway(stack, config, tmp_path)
        auth = {"Authorization": f"Bearer {KEYS['anyone']}"}
        short_answer = httpx.post(f"{gateway.url}/v1/completions", headers=auth, timeout=30,
                                  json={"model": "big", "prompt": "hello there", "max_tokens": 2})
        long_answer = httpx.post(f"{gateway.url}/v1/completions", headers=auth, timeout=30,
                                 json={"model": "big", "prompt": "hello there " * 60, "max_tokens": 2})
        assert (short_answer.status_code, short_answer.headers["x-kvgate-pool"]) == (200, "big")
        assert (long_answer.status_code, long_answer.headers["x-kvgate-pool"]) == (200, "small")
        assert long_answer.json()["model"] == "small"
        assert metric_value(gateway.url, "kvgate_fallbacks_total", reason="context_length_exceeded") == 1


def test_a_request_whose_every_attempt_failed_before_a_first_token_is_served_by_the_unavailable_fallback(
        tmp_path, gateway_model_dir):
    with ExitStack() as stack:
        small = small_worker(stack, gateway_model_dir)
        refusing = stack.enter_context(running(fake_worker_process("status503")))  # healthy, refuses every request
        gateway = start_gateway(stack, two_pools([worker_entry("b0", refusing.url)], small.url, gateway_model_dir,
                                                 ["unavailable"]), tmp_path)
        answer = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {KEYS['anyone']}"},
                            json={"model": "big", "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert (answer.status_code, answer.headers["x-kvgate-pool"], answer.json()["model"]) == (200, "small", "small")
        assert metric_value(gateway.url, "kvgate_fallbacks_total", from_pool="big", to_pool="small",
                            reason="unavailable") == 1
        strict = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {KEYS['strict']}"},
                            json={"model": "big", "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert strict.status_code == 503 and strict.json()["error"]["code"] == "upstream_unavailable"
