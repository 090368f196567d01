"""Gateway replicas on one Redis act as one gateway: workers that register are used by all and
dropped by all when their heartbeats stop; a breaker one replica opens is open at all; a prefix one
replica sent somewhere, the others send there too. Real gateway processes, real Redis, real
`kvgate register` sidecars in front of fake workers."""

from __future__ import annotations

import signal
import sys
import time
from contextlib import ExitStack

import httpx
import pytest

from gateway.client_watch import WATCH_AFTER_S
from tests.gateway.conftest import API_KEY, MODEL, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import Process, fake_worker_process, running

pytestmark = pytest.mark.slow  # gateway, worker, sidecar and redis processes

POLL_S = 0.2
TTL_S = 2.0
HEARTBEAT_S = 0.5


def replica_config(workers: list[dict], redis_url: str, replicas: int, **sections) -> dict:
    return gateway_config(workers, None, redis={"url": redis_url, "replicas": replicas,
                                                "registry_poll_interval_s": POLL_S}, **sections)


def register_sidecar(redis_url: str, name: str, worker_url: str) -> Process:
    argv = [sys.executable, "-m", "kvgate", "register", "--redis", redis_url, "--pool", "default", "--name", name,
            "--url", worker_url, "--model", MODEL, "--registry-ttl", str(TTL_S),
            "--heartbeat-interval", str(HEARTBEAT_S)]
    return Process(argv, worker_url)


def gateway_with_a_registered_worker(stack: ExitStack, tmp_path, redis_url: str, name: str) -> tuple[Process, Process]:
    """One gateway whose pool lists no worker, and a fake worker registered by a sidecar, in rotation."""
    worker = stack.enter_context(running(fake_worker_process("answer")))
    gateway = start_gateway(stack, replica_config([], redis_url, replicas=1), tmp_path, ready=False)
    sidecar = register_sidecar(redis_url, name, worker.url)
    stack.callback(sidecar.stop)
    wait_until(lambda: in_rotation(gateway.url, name), 10, "registered worker in rotation")
    return gateway, sidecar


def served_by(gateway_url: str, prompt: str) -> str:
    response = httpx.post(f"{gateway_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=10)
    assert response.status_code == 200, response.text
    return response.headers["x-kvgate-worker"]


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Poll condition() until true; the seconds it took (AssertionError naming what, past timeout_s)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def in_rotation(gateway_url: str, worker: str) -> bool:
    return metric_value(gateway_url, "kvgate_worker_healthy", worker=worker) == 1


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_registered_worker_is_used_by_every_replica_and_dropped_by_all_when_its_heartbeats_stop(
        tmp_path, redis_server, replicas):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = replica_config([], redis_server.url, replicas=replicas)
        gateways = [start_gateway(stack, config, tmp_path, ready=False) for _ in range(replicas)]
        assert all(httpx.get(f"{g.url}/ready").status_code == 503 for g in gateways)  # no worker yet

        sidecar = register_sidecar(redis_server.url, "registered-0", worker.url)
        stack.callback(sidecar.stop)
        joined_s = wait_until(lambda: all(httpx.get(f"{g.url}/ready").status_code == 200 for g in gateways),
                              10, "registered worker in rotation at both replicas")
        assert joined_s < 2 + HEARTBEAT_S  # the sidecar's first beat waits for the worker's /health
        assert all(served_by(g.url, "hello") == "registered-0" for g in gateways)

        sidecar.proc.send_signal(signal.SIGKILL)  # no withdrawal: the record lapses after its TTL
        killed = time.monotonic()
        wait_until(lambda: not any(in_rotation(g.url, "registered-0") for g in gateways), TTL_S + 2 * POLL_S + 1,
                   "lapsed worker dropped by both replicas")
        assert time.monotonic() - killed <= TTL_S + 2 * POLL_S + 0.5
        assert all(httpx.get(f"{g.url}/ready").status_code == 503 for g in gateways)


def test_a_worker_that_stops_cleanly_is_withdrawn_at_once(tmp_path, redis_server):
    with ExitStack() as stack:
        gateway, sidecar = gateway_with_a_registered_worker(stack, tmp_path, redis_server.url, "registered-1")
        sidecar.proc.send_signal(signal.SIGTERM)
        assert sidecar.proc.wait(timeout=10) == 0
        took = wait_until(lambda: not in_rotation(gateway.url, "registered-1"), TTL_S, "withdrawn worker dropped")
        assert took < 1.0  # well before its TTL


def test_a_breaker_one_replica_opens_is_open_at_every_replica_within_a_second(tmp_path, redis_server):
    with ExitStack() as stack:
        failing = stack.enter_context(running(fake_worker_process("status500")))
        healthy = stack.enter_context(running(fake_worker_process("answer")))
        config = replica_config([worker_entry("failing", failing.url), worker_entry("healthy", healthy.url)],
                                redis_server.url, replicas=4, breaker={"fail_max": 2, "reset_timeout_s": 30.0})
        config["pools"]["default"]["policy"] = {"type": "round_robin"}
        first, *others = (start_gateway(stack, config, tmp_path) for _ in range(4))
        for i in range(6):  # round robin sends every other one to the failing worker (then retries elsewhere)
            served_by(first.url, f"request {i}")
        assert metric_value(first.url, "kvgate_breaker_state", worker="failing") == 2
        opened = time.monotonic()
        wait_until(lambda: all(metric_value(g.url, "kvgate_breaker_state", worker="failing") == 2 for g in others),
                   1.0, "the other replicas' breakers opened")
        assert time.monotonic() - opened < 1.0
        for gateway in others:
            assert metric_value(gateway.url, "kvgate_upstream_attempts", worker="failing") == 0  # never tried it
            assert all(served_by(gateway.url, f"after {i}") == "healthy" for i in range(4))


def test_a_prefix_sent_to_a_worker_by_one_replica_goes_there_from_the_others(tmp_path, redis_server):
    """Without KV events (fake workers publish none), only the dispatch records tell the second replica
    where the first sent each prompt: 4 prompts, each first through one replica, then the other (within
    the predictions' 10 s TTL even on a loaded machine)."""
    from concurrent.futures import ThreadPoolExecutor

    with ExitStack() as stack:
        # "hold": each request takes a second, so the first four, sent at once, spread by load
        workers = [stack.enter_context(running(fake_worker_process("hold"))) for _ in range(2)]
        config = replica_config([worker_entry(f"w{i}", w.url) for i, w in enumerate(workers)], redis_server.url,
                                replicas=2)
        replicas = [start_gateway(stack, config, tmp_path) for _ in range(2)]
        prompts = [f"tenant {i} system prompt: " + " ".join(f"word{i}-{j}" for j in range(200)) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            placed = dict(zip(prompts, pool.map(lambda i: served_by(replicas[i % 2].url, prompts[i]), range(4))))
        assert len(set(placed.values())) == 2  # load spread the new prefixes over both workers
        for i, (prompt, worker) in enumerate(placed.items()):
            assert served_by(replicas[(i + 1) % 2].url, prompt + " and a question") == worker, prompt[:12]
        assert metric_value(replicas[0].url, "kvgate_shared_state", part="peers") == 1


def test_kvgate_worker_register_joins_the_pool_with_its_model_and_kv_events(tmp_path, redis_server,
                                                                             tiny_llama_dir):
    """`kvgate worker --register`: a sim worker announces itself (its served model from its own
    /v1/models); the gateway routes to it and follows its KV events (the second request finds the
    first one's prefix cached)."""
    from tests.conftest import free_port, free_port_pair

    port, kv_port = free_port(), free_port_pair()
    argv = [sys.executable, "-m", "kvgate", "worker", "--model", str(tiny_llama_dir), "--executor", "sim",
            "--port", str(port), "--block-size", "8", "--num-blocks", "256", "--served-model-name", MODEL,
            "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}", "--worker-id", "sim-0",
            "--register", redis_server.url, "--pool", "default", "--heartbeat-interval", "0.5"]
    with ExitStack() as stack:
        stack.enter_context(running(Process(argv, f"http://127.0.0.1:{port}")))
        gateway = start_gateway(stack, replica_config([], redis_server.url, replicas=1), tmp_path, ready=False)
        wait_until(lambda: in_rotation(gateway.url, "sim-0"), 10, "registered sim worker in rotation")
        prompt = " ".join(f"w{i}" for i in range(64))
        assert served_by(gateway.url, prompt) == "sim-0"
        wait_until(lambda: metric_value(gateway.url, "kvgate_kv_index_blocks", worker="sim-0") > 0, 5,
                   "the worker's KV events indexed")
        response = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": MODEL, "prompt": prompt + " again", "max_tokens": 1}, timeout=10)
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_with_redis_gone_registered_workers_keep_serving_and_ready_says_what_is_local(tmp_path, redis_server):
    with ExitStack() as stack:
        gateway, sidecar = gateway_with_a_registered_worker(stack, tmp_path, redis_server.url, "registered-2")
        redis_server.stop()
        wait_until(lambda: metric_value(gateway.url, "kvgate_shared_state", part="registry") == 0, 5,
                   "registry reported local")
        time.sleep(TTL_S + 2 * POLL_S)  # past the record's TTL: nothing can be read, so nothing is dropped
        assert served_by(gateway.url, "still here") == "registered-2"
        ready = httpx.get(f"{gateway.url}/ready")
        assert ready.status_code == 200
        assert any("worker registry unreadable" in note for note in ready.json()["degraded"])
        redis_server.start()  # empty: the sidecar's next heartbeat announces the worker again
        wait_until(lambda: all(metric_value(gateway.url, "kvgate_shared_state", part=part) == 1
                               for part in ("registry", "peers", "tenant_limits", "retry_budgets")), 10,
                   "every kind of state shared again")
        assert in_rotation(gateway.url, "registered-2")
        assert "degraded" not in httpx.get(f"{gateway.url}/ready").json()


def test_a_replica_counts_the_requests_other_replicas_have_in_flight_at_each_worker(tmp_path, redis_server):
    """Two streams held open through one replica on the worker the other replica picks among idle
    ones; asked without a session (least load), the other replica sends every probe elsewhere: it
    counts the first replica's streams. Without shared load it would pick that worker again."""
    with ExitStack() as stack:
        workers = [stack.enter_context(running(fake_worker_process("trickle"))) for _ in range(2)]
        config = replica_config([worker_entry(f"w{i}", w.url) for i, w in enumerate(workers)], redis_server.url,
                                replicas=2)
        config["pools"]["default"]["policy"] = {"type": "session_affinity"}
        first, second = (start_gateway(stack, config, tmp_path) for _ in range(2))
        client = stack.enter_context(httpx.Client(timeout=10))
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 500, "stream": True}

        def probe() -> str:
            with client.stream("POST", f"{second.url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                worker = response.headers["x-kvgate-worker"]
            time.sleep(2 * WATCH_AFTER_S)  # the probe's departure noticed: it no longer counts as in flight
            return worker

        idle_choice = probe()
        held = []
        for i in range(20):  # a session whose worker is the one the second replica picks among idle ones
            headers = {"Authorization": f"Bearer {API_KEY}", "X-Session-Id": f"session-{i}"}
            streams = [client.stream("POST", f"{first.url}/v1/completions", headers=headers, json=body)
                       for _ in range(2)]
            held = [stack.enter_context(stream) for stream in streams]
            if all(r.headers["x-kvgate-worker"] == idle_choice for r in held):
                break
            for response in held:
                response.close()
        assert {r.headers["x-kvgate-worker"] for r in held} == {idle_choice}
        time.sleep(0.3)  # a load report or two
        assert all(probe() != idle_choice for _ in range(4))
