"""A gateway told to stop (SIGTERM): requests in flight finish within gateway.shutdown_grace_s; one still
running then ends with a clear 503 gateway_shutdown (a stream: that error as its last event, then [DONE]),
never a cut connection; each is counted and logged once, and the process exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.gateway.conftest import API_KEY, MODEL, gateway_config, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # gateway and worker processes

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": MODEL, "prompt": "p", "max_tokens": 1000}


def start(stack: ExitStack, tmp_path, mode: str, grace_s: float):
    worker = stack.enter_context(running(fake_worker_process(mode)))
    config = gateway_config([worker_entry("w0", worker.url)], None, gateway={"shutdown_grace_s": grace_s})
    return start_gateway(stack, config, tmp_path)


def in_background(target) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = target()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def stream_lines(url: str) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, json={**BODY, "stream": True},
                      timeout=30) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def collected(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, json=BODY, timeout=30)


def log_lines(gateway) -> list[dict]:
    return [json.loads(line) for line in gateway.output().splitlines()
            if line.startswith("{") and '"event":"request"' in line]


def test_requests_still_running_when_the_grace_ends_get_a_clear_error(tmp_path):
    with ExitStack() as stack:
        gateway = start(stack, tmp_path, "trickle", grace_s=1.0)  # a token every 0.1 s for a minute
        streamed, stream_result = in_background(lambda: stream_lines(gateway.url))
        waiting, collected_result = in_background(lambda: collected(gateway.url))
        time.sleep(0.8)  # both under way
        stopped_at = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        streamed.join(15)
        waiting.join(15)
        assert gateway.proc.wait(15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it stopped on
        assert time.monotonic() - stopped_at < 8  # the grace, then a prompt stop

        lines = stream_result["value"]  # a well-formed stream: no cut connection
        assert len([line for line in lines if '"text"' in line]) >= 10  # tokens until the grace ran out
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "gateway_shutdown" and "retry" in error["message"]
        assert lines[-1] == "data: [DONE]"

        response = collected_result["value"]
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "gateway_shutdown"
        assert response.headers["retry-after"] == "1"

        records = log_lines(gateway)
        assert sorted(r["outcome"] for r in records) == ["gateway_shutdown", "gateway_shutdown"]
        assert "Traceback" not in gateway.output() and "Exception in ASGI application" not in gateway.output()


def test_a_request_that_ends_within_the_grace_is_answered_whole(tmp_path):
    with ExitStack() as stack:
        gateway = start(stack, tmp_path, "hold", grace_s=10.0)  # answers after 1 s
        waiting, result = in_background(lambda: collected(gateway.url))
        time.sleep(0.3)
        gateway.proc.send_signal(signal.SIGTERM)
        waiting.join(15)
        assert gateway.proc.wait(15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it stopped on
        response = result["value"]
        assert response.status_code == 200 and response.json()["choices"]
        assert "stopping: 1 request(s) in flight get up to 10 s to finish" in gateway.output()
        assert [r["outcome"] for r in log_lines(gateway)] == ["answered"]


def test_a_request_still_waiting_for_its_worker_gets_a_503_to_retry(tmp_path):
    with ExitStack() as stack:
        gateway = start(stack, tmp_path, "hang", grace_s=0.5)  # no answer, not even headers
        waiting, result = in_background(lambda: collected(gateway.url))
        time.sleep(0.5)
        gateway.proc.send_signal(signal.SIGTERM)
        waiting.join(15)
        assert gateway.proc.wait(15) in (0, -signal.SIGTERM)
        response = result["value"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "gateway_shutdown"
        assert [r["outcome"] for r in log_lines(gateway)] == ["gateway_shutdown"]


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_batch_still_running_when_the_grace_ends_ends_as_its_prompts_do(tmp_path, stream):
    """Its prompts end as requests of their own would (one waiting its turn under the tenant's
    max_concurrency too): a 503 naming a prompt before the answer starts, each prompt's error event in a
    stream; never a cut connection."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("trickle")))
        config = gateway_config([worker_entry("w0", worker.url)], None, gateway={"shutdown_grace_s": 1.0},
                                tenants={"dev": {"max_concurrency": 2 if stream else 1}})
        gateway = start_gateway(stack, config, tmp_path)
        batch = {**BODY, "prompt": ["a", "b"] if stream else ["a", "b", "c"], "stream": stream}

        def send_batch():
            if not stream:
                return httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, json=batch, timeout=30)
            with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=AUTH, json=batch,
                              timeout=30) as response:
                return [line for line in response.iter_lines() if line]

        waiting, result = in_background(send_batch)
        time.sleep(0.8)
        gateway.proc.send_signal(signal.SIGTERM)
        waiting.join(15)
        assert gateway.proc.wait(15) in (0, -signal.SIGTERM)
        if stream:
            lines = result["value"]
            errors = [json.loads(line.removeprefix("data: "))["error"] for line in lines if '"error"' in line]
            assert [e["code"] for e in errors] == ["gateway_shutdown", "gateway_shutdown"]
            assert lines[-1] == "data: [DONE]"
        else:
            response = result["value"]
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["code"] == "gateway_shutdown" and error["message"].startswith("prompt ")
        assert "Traceback" not in gateway.output()
