"""Fault handling with real processes: killed, failing and hanging workers behind a real gateway."""

from __future__ import annotations

import json
import signal
import time
from contextlib import ExitStack

import httpx
import pytest

from loadtest.sse import StreamReader
from tests.gateway.conftest import (API_KEY, MODEL, gateway_config, metric_value, start_gateway,
                                    start_tiny_worker, worker_entry)
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # every test runs workers and a gateway as processes

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def stream_text(response: httpx.Response, on_chunk=None) -> tuple[str, list[dict]]:
    """The streamed content and every chunk; on_chunk(number of chunks so far) after each with choices."""
    reader, payloads = StreamReader(), []
    for payload in reader.read(response.iter_lines()):
        payloads.append(payload)
        if payload.get("choices") and on_chunk is not None:
            on_chunk(len(payloads))
    assert reader.error != "bad_chunk", "a data line that is not a JSON object"
    return reader.text, payloads


def two_workers_behind_a_gateway(stack: ExitStack, model_dir, tmp_path) -> tuple[dict, object]:
    """Two real tiny-model workers, by name (w0, w1), and a gateway over them."""
    by_name = {f"w{i}": start_tiny_worker(stack, model_dir) for i in range(2)}
    entries = [worker_entry(name, w.url) for name, w in by_name.items()]
    return by_name, start_gateway(stack, gateway_config(entries, model_dir), tmp_path)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_worker_killed_mid_stream_client_text_equals_uninterrupted_run(gateway_model_dir, tmp_path, kind):
    with ExitStack() as stack:
        by_name, gateway = two_workers_behind_a_gateway(stack, gateway_model_dir, tmp_path)
        if kind == "completion":
            path, body = "/v1/completions", {"prompt": "Paged attention stores keys and values"}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}
        body = {**body, "model": MODEL, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        plain = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        expected = httpx.post(f"{gateway.url}{path}", json=plain, headers=AUTH, timeout=60).json()["choices"][0]
        expected_text = expected["text"] if kind == "completion" else expected["message"]["content"]

        with httpx.stream("POST", f"{gateway.url}{path}", json=body, headers=AUTH, timeout=60) as response:
            victim = by_name[response.headers["x-kvgate-worker"]]

            def kill_after_five(n: int) -> None:
                if n == 5:
                    victim.proc.send_signal(signal.SIGKILL)

            text, payloads = stream_text(response, kill_after_five)
        assert victim.proc.wait(timeout=5) == -signal.SIGKILL
        assert [i for p in payloads for c in p.get("choices", ()) for i in c.get("token_ids", ())] \
            == expected["token_ids"]  # token for token
        assert text == expected_text
        assert len({p["id"] for p in payloads}) == 1  # one well-formed stream
        assert payloads[-1]["usage"]["completion_tokens"] == 300
        assert [p["choices"][0]["finish_reason"] for p in payloads if p.get("choices")][-1] == "length"
        assert metric_value(gateway.url, "kvgate_failovers_total", mode="token_ids") == 1


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_streams_logprobs_go_on_through_a_failover_as_an_uninterrupted_run_has_them(gateway_model_dir, tmp_path,
                                                                                     kind):
    """The answer continues on the other worker through its completions endpoint; a chat's logprobs come
    back in a chat's shape, the same tokens with the same alternatives (the values to float noise: the
    other worker computes the prompt in one prefill)."""
    with ExitStack() as stack:
        by_name, gateway = two_workers_behind_a_gateway(stack, gateway_model_dir, tmp_path)
        if kind == "completion":
            path, body = "/v1/completions", {"prompt": "Paged attention stores keys and values", "logprobs": 2}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}],
                                                  "logprobs": True, "top_logprobs": 2}
        body = {**body, "model": MODEL, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        expected = httpx.post(f"{gateway.url}{path}", json=body, headers=AUTH, timeout=60).json()["choices"][0]

        with httpx.stream("POST", f"{gateway.url}{path}", json={**body, "stream": True}, headers=AUTH,
                          timeout=60) as response:
            victim = by_name[response.headers["x-kvgate-worker"]]
            _, payloads = stream_text(response, lambda n: n == 5 and victim.proc.send_signal(signal.SIGKILL))
        assert victim.proc.wait(timeout=5) == -signal.SIGKILL
        assert metric_value(gateway.url, "kvgate_failovers_total") == 1

    pieces = [c["logprobs"] for p in payloads for c in p.get("choices", ()) if c.get("logprobs")]
    if kind == "chat":
        streamed = [entry for piece in pieces for entry in piece["content"]]
        assert len(streamed) == 60
        for got, want in zip(streamed, expected["logprobs"]["content"]):
            assert (got["token"], got["bytes"]) == (want["token"], want["bytes"])
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
            assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]]
            assert [t["logprob"] for t in got["top_logprobs"]] == \
                pytest.approx([t["logprob"] for t in want["top_logprobs"]], abs=1e-4)
    else:
        want = expected["logprobs"]
        for field in ("tokens", "text_offset"):
            assert [value for piece in pieces for value in piece[field]] == want[field]
        assert [v for piece in pieces for v in piece["token_logprobs"]] == pytest.approx(want["token_logprobs"],
                                                                                         abs=1e-4)
        tops = [top for piece in pieces for top in piece["top_logprobs"]]
        assert [sorted(top) for top in tops] == [sorted(top) for top in want["top_logprobs"]]


def test_a_worker_killed_mid_stream_of_n_choices_ends_the_stream_with_a_clear_error(gateway_model_dir, tmp_path):
    """One continuation goes on one answer: n choices are not continued, the client is told so."""
    with ExitStack() as stack:
        by_name, gateway = two_workers_behind_a_gateway(stack, gateway_model_dir, tmp_path)
        body = {"model": MODEL, "prompt": "Paged attention stores keys and values", "max_tokens": 300, "n": 2,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            victim = by_name[response.headers["x-kvgate-worker"]]
            _, payloads = stream_text(response, lambda n: n == 5 and victim.proc.send_signal(signal.SIGKILL))
        assert victim.proc.wait(timeout=5) == -signal.SIGKILL

    assert payloads[-1]["error"]["code"] == "failover_failed" and "choices" in payloads[-1]["error"]["message"]
    assert {c["index"] for p in payloads[:-1] for c in p["choices"]} == {0, 1}


def test_breaker_opens_on_a_worker_returning_503_and_no_request_fails(gateway_model_dir, tmp_path):
    with ExitStack() as stack:
        bad = stack.enter_context(running(fake_worker_process("status503")))
        good = start_tiny_worker(stack, gateway_model_dir)
        entries = [worker_entry("bad", bad.url), worker_entry("good", good.url)]
        config = gateway_config(entries, gateway_model_dir, upstream={"retry_budget_min_per_s": 5.0})
        # round robin: every other request starts at the bad worker (kv_aware may keep a prompt's
        # prefix at the good one after the first retry, and never try the bad one three times)
        config["pools"]["default"]["policy"] = {"type": "round_robin"}
        gateway = start_gateway(stack, config, tmp_path)
        for i in range(12):
            response = httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, timeout=30,
                                  json={"model": MODEL, "prompt": f"request number {i}", "max_tokens": 2})
            assert response.status_code == 200, response.text
        assert metric_value(gateway.url, "kvgate_breaker_state", worker="bad") == 2  # open
        assert httpx.get(f"{bad.url}/calls").json()["generate"] <= 3


def test_hanging_worker_times_out_before_the_first_byte_and_the_request_is_retried(gateway_model_dir, tmp_path):
    with ExitStack() as stack:
        hang = stack.enter_context(running(fake_worker_process("hang_after_headers")))
        good = start_tiny_worker(stack, gateway_model_dir)
        entries = [worker_entry("hang", hang.url), worker_entry("good", good.url)]
        config = gateway_config(entries, gateway_model_dir, upstream={"first_byte_timeout_s": 1.0},
                                outliers={"enabled": False})
        config["pools"]["default"]["policy"] = {"type": "round_robin"}
        gateway = start_gateway(stack, config, tmp_path)
        for i in range(4):
            response = httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, timeout=30,
                                  json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 2, "stream": True})
            assert response.status_code == 200 and response.headers["x-kvgate-worker"] == "good"
            assert "data: [DONE]" in response.text
        hung = httpx.get(f"{hang.url}/calls").json()["generate"]
        assert hung >= 1  # round robin sent it some; each timed out before its first byte and was retried
        assert metric_value(gateway.url, "kvgate_upstream_attempts_total", worker="hang", outcome="error") == hung


def test_a_worker_slow_for_its_work_is_ejected_and_its_peers_are_not(tmp_path):
    """The whole path: the router's expectation at the first token, the gateway's slowness EWMA,
    ejection, and routing around the ejected worker."""
    with ExitStack() as stack:
        workers = {name: stack.enter_context(running(fake_worker_process(mode)))
                   for name, mode in (("fast0", "answer"), ("fast1", "answer"), ("slow", "slow"))}
        config = gateway_config([worker_entry(name, w.url) for name, w in workers.items()], None,
                                outliers={"min_samples": 3, "ratio": 3.0, "base_latency_s": 0.25})
        config["pools"]["default"]["policy"] = {"type": "round_robin"}
        gateway = start_gateway(stack, config, tmp_path)
        served = []
        with httpx.Client(headers=AUTH, timeout=10) as client:
            for i in range(18):
                response = client.post(f"{gateway.url}/v1/completions",
                                       json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 1})
                assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hi"
                served.append(response.headers["x-kvgate-worker"])
        # its third answer (1 s: slowness ~5, peers ~1) ejects it; a loaded machine may slow the peers a little
        assert 3 <= served.count("slow") <= 5
        assert "slow" not in served[-6:]
        assert metric_value(gateway.url, "kvgate_worker_ejections_total", worker="slow") == 1
        assert metric_value(gateway.url, "kvgate_worker_ejections_total") == 1


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_a_client_that_goes_away_cancels_the_upstream_request_at_once(tmp_path, stream):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("trickle")))
        gateway = start_gateway(stack, gateway_config([worker_entry("w", worker.url)], None), tmp_path)
        body = {"model": MODEL, "prompt": "p", "max_tokens": 600, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{gateway.url}/v1/completions", headers=AUTH, json=body, timeout=10) as response:
                data = (line for line in response.iter_lines() if line.startswith("data: "))
                texts = [json.loads(next(data)[6:])["choices"][0]["text"] for _ in range(2)]
                assert texts == [" t0", " t1"]  # two tokens arrived; leaving the block closes the connection
        else:
            with pytest.raises(httpx.ReadTimeout):  # the whole answer would take a minute
                httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, json=body, timeout=0.5)
        deadline = time.monotonic() + 2.0
        while httpx.get(f"{worker.url}/calls").json()["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{worker.url}/calls").json() == {"generate": 1, "cancelled": 1}


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_a_client_that_goes_away_before_the_first_token_cancels_the_upstream_request(tmp_path, stream):
    """While the worker is still computing the prompt (nothing sent to the client yet); the
    request counts as 499 and leaves no load or predicted cache behind."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("hang_first")))
        gateway = start_gateway(stack, gateway_config([worker_entry("w", worker.url)], None), tmp_path)
        body = {"model": MODEL, "prompt": "p " * 40, "max_tokens": 1, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, json=body, timeout=0.5)
        deadline = time.monotonic() + 2.0
        while httpx.get(f"{worker.url}/calls").json()["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{worker.url}/calls").json() == {"generate": 1, "cancelled": 1}
        assert metric_value(gateway.url, "kvgate_requests_total", status="499") == 1
        again = httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, json=body, timeout=10)
        assert again.status_code == 200
        route = again.headers["x-kvgate-route"]  # what the router knew when it routed the same prompt again
        assert "predicted_cached_tokens=0" in route and "w(cached_blocks=0 requests=0 " in route, route


def test_a_worker_that_stalls_mid_stream_is_replaced_and_the_client_gets_one_stream(tmp_path):
    with ExitStack() as stack:
        stalling = stack.enter_context(running(fake_worker_process("stall_mid_stream")))
        healthy = stack.enter_context(running(fake_worker_process("answer")))
        config = gateway_config([worker_entry("stalling", stalling.url), worker_entry("healthy", healthy.url)], None,
                                upstream={"idle_timeout_s": 1.0})
        config["pools"]["default"]["policy"] = {"type": "round_robin"}  # the first request goes to "stalling"
        gateway = start_gateway(stack, config, tmp_path)
        response = httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, timeout=10,
                              json={"model": MODEL, "prompt": "p", "max_tokens": 10, "stream": True,
                                    "stream_options": {"include_usage": True}})
        text, payloads = stream_text(response)
        assert response.headers["x-kvgate-worker"] == "stalling"
        assert text == " t0 t1hi"  # two tokens from the stalled worker, the rest from the healthy one
        assert {p["id"] for p in payloads} == {payloads[0]["id"]}  # one stream
        assert [c["finish_reason"] for p in payloads for c in p["choices"]][-1] == "length"
        assert payloads[-1]["usage"]["completion_tokens"] > 1  # the delivered tokens count too
        assert response.text.rstrip().endswith("data: [DONE]")
        assert metric_value(gateway.url, "kvgate_failovers_total", mode="text") == 1  # it returns no token ids
        assert all("token_ids" not in c for p in payloads for c in p["choices"])


def test_with_every_worker_failing_retries_stay_in_budget_and_clients_get_fast_503s(gateway_model_dir, tmp_path):
    with ExitStack() as stack:
        fakes = [stack.enter_context(running(fake_worker_process("status503"))) for _ in range(2)]
        entries = [worker_entry(f"bad{i}", f.url) for i, f in enumerate(fakes)]
        config = gateway_config(entries, None, breaker={"fail_max": 1000},
                                upstream={"retry_budget_ratio": 0.1, "retry_budget_min_per_s": 0.2})
        gateway = start_gateway(stack, config, tmp_path)
        requests = 50
        with httpx.Client(headers=AUTH, timeout=10) as client:
            for i in range(requests):
                started = time.monotonic()
                response = client.post(f"{gateway.url}/v1/completions",
                                       json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 1})
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["type"] == "service_unavailable"
                assert time.monotonic() - started < 2.0
        calls = sum(httpx.get(f"{f.url}/calls").json()["generate"] for f in fakes)
        retries = metric_value(gateway.url, "kvgate_upstream_retries_total")
        assert calls == requests + retries
        assert retries <= 0.1 * requests + 0.2 * 10
        assert metric_value(gateway.url, "kvgate_retry_budget_refusals_total") > 0


def test_a_worker_that_ignores_n_gives_the_collecting_client_the_one_choice_it_made(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, gateway_config([worker_entry("w0", worker.url)], None), tmp_path)
        response = httpx.post(f"{gateway.url}/v1/completions", headers=AUTH, timeout=30,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 2})
    assert response.status_code == 200
    assert [choice["index"] for choice in response.json()["choices"]] == [0]  # no empty choice made up
