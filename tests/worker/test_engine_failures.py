"""A model step that fails, as clients of a real worker server see it: the requests of that step get an
OpenAI-style 500 and the worker serves on; steps that keep failing stop the worker with status 1 (for its
supervisor to restart it). The tiny model's TorchExecutor runs behind a wrapper that fails on demand."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.worker.fake_executor import FailingExecutor
from tests.worker.inprocess import completion, serving, tiny_executor, worker_state
from worker.async_engine import MAX_CONSECUTIVE_FAILED_STEPS


@pytest.fixture
def executor(tiny_llama_dir) -> FailingExecutor:
    return FailingExecutor(tiny_executor(tiny_llama_dir))


@pytest.fixture
def worker(tiny_llama_dir, executor):
    with serving(worker_state(tiny_llama_dir, executor)) as served:
        yield served


def test_a_failed_step_fails_its_request_with_a_500_and_the_next_request_is_served(worker, executor):
    expected = completion(worker.url).json()["choices"][0]["text"]
    executor.fail_next_steps(1)

    failed = completion(worker.url)

    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error" and "step failed" in failed.json()["error"]["message"]
    assert httpx.get(f"{worker.url}/health").status_code == 200
    again = completion(worker.url)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected


def test_a_failed_step_ends_a_stream_with_an_error_event_and_done(worker, executor):
    executor.fail_next_steps(1)

    with httpx.stream("POST", f"{worker.url}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": True}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]

    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    assert completion(worker.url).status_code == 200


def test_steps_failing_again_and_again_stop_the_worker_with_status_1(worker, executor):
    executor.fail_next_steps(10**6)

    statuses = [completion(worker.url).status_code for _ in range(MAX_CONSECUTIVE_FAILED_STEPS)]

    assert statuses == [500] * MAX_CONSECUTIVE_FAILED_STEPS
    assert worker.wait_exit_status() == 1
    assert executor.num_failed_steps == MAX_CONSECUTIVE_FAILED_STEPS
