"""What each upstream outcome means, through a real gateway in front of workers that fail on purpose:
5xx is a worker failure (retried, counted by its breaker), 429 is back-pressure (retried elsewhere, no
breaker failure), an error event before the first token is a failed attempt, a half-open trial always
ends, a client's X-Request-Id is never an internal key, and tokens streamed without a usage chunk are
still counted."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.gateway.conftest import API_KEY, MODEL, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # gateway and worker processes

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": MODEL, "prompt": "p", "max_tokens": 4}


def start_fleet(stack: ExitStack, tmp_path, modes: dict[str, str], **sections):
    """A gateway in front of one fake worker per (name, mode), taken in turn (round robin: each is
    tried, whatever a cache-aware policy would prefer); returns (gateway, {name: worker})."""
    workers = {name: stack.enter_context(running(fake_worker_process(mode))) for name, mode in modes.items()}
    config = gateway_config([worker_entry(name, w.url) for name, w in workers.items()], None, **sections)
    config["pools"]["default"]["policy"] = {"type": "round_robin"}
    return start_gateway(stack, config, tmp_path), workers


def post(gateway_url: str, **body) -> httpx.Response:
    return httpx.post(f"{gateway_url}/v1/completions", headers=AUTH, json={**BODY, **body}, timeout=30)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_worker_answering_500_is_retried_elsewhere_and_its_breaker_opens(tmp_path):
    with ExitStack() as stack:
        gateway, workers = start_fleet(stack, tmp_path, {"bad": "status500", "good": "answer"},
                                       upstream={"retry_budget_min_per_s": 10.0})
        statuses = [post(gateway.url, prompt=f"request {i}").status_code for i in range(8)]
        assert statuses == [200] * 8
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="bad") == 2  # open
        assert httpx.get(f"{workers['bad'].url}/calls").json()["generate"] <= 3  # fail_max, then left alone


def test_a_worker_answering_429_is_back_pressure_retried_elsewhere_without_a_breaker_failure(tmp_path):
    with ExitStack() as stack:
        gateway, workers = start_fleet(stack, tmp_path, {"busy": "status429", "good": "answer"},
                                       upstream={"retry_budget_min_per_s": 10.0})
        statuses = [post(gateway.url, prompt=f"request {i}").status_code for i in range(8)]
        assert statuses == [200] * 8
        assert httpx.get(f"{workers['busy'].url}/calls").json()["generate"] >= 3  # tried more than fail_max times
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="busy") == 0  # closed: its cache stays indexed
        assert metric_value(gateway.url, "kvgate_worker_healthy", worker="busy") == 1


def test_an_error_event_before_the_first_token_is_a_failed_attempt_retried_on_another_worker(tmp_path):
    with ExitStack() as stack:
        gateway, _ = start_fleet(stack, tmp_path, {"broken": "error_before_token", "good": "answer"},
                                 upstream={"retry_budget_min_per_s": 10.0})
        for i in range(6):
            response = post(gateway.url, prompt=f"request {i}")
            assert response.status_code == 200 and response.headers["x-kvgate-worker"] == "good"
            assert response.json()["choices"][0]["text"] == "hi"  # not an empty answer after a failover
        assert metric_value(gateway.url, "kvgate_failovers_total") == 0
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="good") == 0


def test_a_half_open_trial_whose_client_leaves_after_the_first_token_returns_the_worker(tmp_path):
    reset_s = 0.5
    with ExitStack() as stack:
        gateway, _ = start_fleet(stack, tmp_path, {"w": "fail_twice_then_trickle"},
                                 breaker={"fail_max": 2, "reset_timeout_s": reset_s}, upstream={"max_retries": 0})
        assert [post(gateway.url).status_code for _ in range(2)] == [503, 503]
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="w") == 2  # open

        def first_chunk_then_leave() -> bool:
            with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=AUTH, timeout=10,
                              json={**BODY, "max_tokens": 500, "stream": True}) as response:
                if response.status_code != 200:
                    return False
                next(response.iter_lines())
                return True  # leaving here closes the connection mid-answer

        wait_for(first_chunk_then_leave, timeout_s=5 * reset_s)  # the half-open trial
        left_s = time.monotonic()
        wait_for(first_chunk_then_leave, timeout_s=2 * reset_s)  # served again, not refused for good
        assert time.monotonic() - left_s < 2 * reset_s
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="w") == 0


def test_two_requests_with_the_same_client_request_id_both_succeed(tmp_path):
    with ExitStack() as stack:
        gateway, workers = start_fleet(stack, tmp_path, {"w": "hold"})

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(*(client.post(f"{gateway.url}/v1/completions", json=BODY,
                                                          headers={**AUTH, "X-Request-Id": "same-id"})
                                              for _ in range(2)))

        responses = asyncio.run(both())
        assert [r.status_code for r in responses] == [200, 200]
        assert [r.headers["x-request-id"] for r in responses] == ["same-id", "same-id"]  # echoed
        assert httpx.get(f"{workers['w'].url}/calls").json()["generate"] == 2
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="w") == 0


def test_tokens_of_a_stream_its_client_left_are_counted(tmp_path):
    with ExitStack() as stack:
        gateway, _ = start_fleet(stack, tmp_path, {"w": "trickle"})
        with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=AUTH, timeout=10,
                          json={**BODY, "max_tokens": 500, "stream": True}) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data:")
                if chunks == 3:
                    break  # leaving here closes the connection mid-answer
        wait_for(lambda: metric_value(gateway.url, "kvgate_completion_tokens_total") >= 3)
        assert metric_value(gateway.url, "kvgate_requests_total", status="499") == 1


def test_a_request_past_its_total_timeout_ends_with_a_504_or_its_streams_last_event(tmp_path):
    """upstream.total_timeout_s bounds a request from arrival to its answer's end: an answer still
    trickling, or a worker that never answers, ends then with total_timeout (no retry elsewhere: the
    worker is not at fault), counted and logged once; its tokens so far are counted too."""
    with ExitStack() as stack:
        gateway, workers = start_fleet(stack, tmp_path, {"trickle": "trickle", "hang": "hang"},
                                       upstream={"total_timeout_s": 0.6, "first_byte_timeout_s": 5.0})
        with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=AUTH, timeout=10,
                          json={**BODY, "max_tokens": 500, "stream": True}) as response:
            assert response.status_code == 200 and response.headers["x-kvgate-worker"] == "trickle"
            lines = [line for line in response.iter_lines() if line]
        assert len([line for line in lines if '"text"' in line]) >= 3  # tokens until the time ran out
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "total_timeout" and "0.6 s" in error["message"]
        assert lines[-1] == "data: [DONE]"
        started = time.monotonic()
        refused = post(gateway.url)  # round robin: the hanging worker's turn
        assert time.monotonic() - started < 3  # the total, not the first-byte timeout (5 s)
        assert refused.status_code == 504 and refused.json()["error"]["code"] == "total_timeout"
        assert httpx.get(f"{workers['trickle'].url}/calls").json()["generate"] == 1  # not retried there
        assert metric_value(gateway.url, "kvgate_requests_total", status="504") == 2
        assert metric_value(gateway.url, "kvgate_completion_tokens_total") >= 3
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="hang") == 0


def test_tokens_of_an_answer_that_ended_without_usage_are_counted(tmp_path):
    with ExitStack() as stack:
        gateway, _ = start_fleet(stack, tmp_path, {"w": "finish_without_usage"})
        response = post(gateway.url)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hi there"
        assert metric_value(gateway.url, "kvgate_completion_tokens_total") >= 1


def test_a_streamed_tool_call_and_its_logprobs_are_assembled_in_a_non_streaming_answer(tmp_path):
    with ExitStack() as stack:
        gateway, _ = start_fleet(stack, tmp_path, {"w": "tool_call"})
        response = httpx.post(f"{gateway.url}/v1/chat/completions", headers=AUTH, timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "logprobs": True,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
        assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.5, -0.25, -0.125]


def stream_events(gateway_url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{gateway_url}{path}", headers=AUTH, timeout=30, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


def test_a_chats_logprobs_go_on_as_a_chats_after_a_failover_from_token_ids(tmp_path):
    """The continuation (completions, from the token ids) asks for the chat's top_logprobs; its
    completions logprobs reach the client as chat logprobs, streamed and assembled."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1,
            "max_tokens": 4}
    with ExitStack() as stack:
        gateway, workers = start_fleet(stack, tmp_path, {"a": "logprobs_die_mid_stream", "b": "logprobs_die_mid_stream"},
                                       upstream={"retry_budget_min_per_s": 10.0})
        events = stream_events(gateway.url, "/v1/chat/completions", chat)
        choices = [e["choices"][0] for e in events if e["choices"]]
        assert "".join(c["delta"].get("content") or "" for c in choices) == "ABCD"
        assert all("delta" in c and "text" not in c for c in choices)
        content = [entry for c in choices if c["logprobs"] for entry in c["logprobs"]["content"]]
        assert [(e["token"], e["logprob"], e["bytes"]) for e in content] == \
            [("A", -0.25, [65]), ("B", -0.5, [66]), ("C", -0.75, [67]), ("D", -1.0, [68])]
        assert [[t["token"] for t in e["top_logprobs"]] for e in content] == [["A"], ["B"], ["C"], ["D"]]
        continuation = [r["body"] for w in workers.values() for r in httpx.get(f"{w.url}/requests").json()
                        if isinstance(r["body"].get("prompt"), list)]
        assert [(c["prompt"], c["logprobs"], c["max_tokens"]) for c in continuation] == [([1, 2, 3, 65, 66], 1, 2)]

        answer = httpx.post(f"{gateway.url}/v1/chat/completions", headers=AUTH, timeout=30, json=chat).json()
        choice = answer["choices"][0]
        assert choice["message"]["content"] == "ABCD"
        assert [e["token"] for e in choice["logprobs"]["content"]] == ["A", "B", "C", "D"]


def test_a_completions_logprobs_text_offsets_count_from_the_answers_start_after_a_failover(tmp_path):
    with ExitStack() as stack:
        gateway, _ = start_fleet(stack, tmp_path, {"a": "logprobs_die_mid_stream", "b": "logprobs_die_mid_stream"},
                                 upstream={"retry_budget_min_per_s": 10.0})
        events = stream_events(gateway.url, "/v1/completions", {"model": MODEL, "prompt": "p", "logprobs": 1,
                                                                "max_tokens": 4})
        logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
        assert [(lp["tokens"], lp["text_offset"]) for lp in logprobs] == \
            [(["A"], [0]), (["B"], [1]), (["C"], [2]), (["D"], [3])]
