"""A real gateway process seen by an operator: its spans at a real OTLP receiver (one trace per request,
joined to the caller's and passed on to the worker), its request log lines, and its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.gateway.conftest import API_KEY, MODEL, gateway_config, start_gateway, worker_entry
from tests.gateway.recording_worker import recording_worker
from tests.loadtest.fake_upstream import serve_in_thread
from tests.otlp_receiver import otlp_receiver

pytestmark = pytest.mark.slow  # gateway processes

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
PARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the batch exporter's default waits 5 s


def complete(url: str, headers: dict[str, str] | None = None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30, headers={"Authorization": f"Bearer {API_KEY}",
                                                                     **(headers or {})},
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 1, **body})


def request_lines(output: str) -> list[dict]:
    """The gateway's request log lines (JSON objects, one a line) in a process's output."""
    lines = []
    for line in output.splitlines():
        if line.startswith("{") and '"event":"request"' in line:
            lines.append(json.loads(line))
    return lines


def line_for(gateway, request_id: str, timeout_s: float = 5.0) -> dict:
    """The request's one log line. It is written once the response has ended, which may be just
    after the client has read it: wait for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        output = gateway.output()
        found = [line for line in request_lines(output) if line["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, output[-3000:]
            return found[0]
        time.sleep(0.02)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A gateway exporting to an OTLP receiver, in front of a worker that fails (503) and one that answers."""
    seen_failing: list[dict] = []
    seen: list[dict] = []
    with ExitStack() as stack:
        receiver = stack.enter_context(otlp_receiver())
        failing = stack.enter_context(serve_in_thread(recording_worker(seen_failing, status=503), free_port()))
        answering = stack.enter_context(serve_in_thread(recording_worker(seen), free_port()))
        config = gateway_config([worker_entry("bad", failing), worker_entry("good", answering)], None,
                                breaker={"fail_max": 1000},
                                tracing={"exporter": "otlp", "endpoint": receiver.url})
        config["pools"]["default"]["policy"] = {"type": "round_robin"}
        gateway = start_gateway(stack, config, tmp_path_factory.mktemp("traced"), env=FAST_EXPORT)
        yield gateway, receiver, seen, seen_failing


def test_one_trace_per_request_joins_the_callers_and_reaches_the_worker(traced):
    gateway, receiver, seen, seen_failing = traced
    for _ in range(2):  # round robin: one of the two starts at the failing worker and is retried
        response = complete(gateway.url, {"traceparent": PARENT, "x-request-id": "traced-1"})
        assert response.status_code == 200, response.text
    spans = receiver.wait_for(lambda spans: sum(s.kind == "server" and s.trace_id == TRACE_ID for s in spans) >= 2)
    spans = [s for s in spans if s.trace_id == TRACE_ID]
    servers = [s for s in spans if s.kind == "server"]
    assert len(servers) == 2 and all(s.parent_span_id == CALLER_SPAN for s in servers)
    assert all(s.service == "kvgate-gateway" and s.name == "POST /v1/completions" for s in servers)
    server = servers[0]
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["gen_ai.usage.input_tokens"] == 1
    assert server.attributes["gen_ai.usage.output_tokens"] == 1
    assert server.attributes["kvgate.request_id"] == "traced-1"
    children = {s.name: s for s in spans if s.parent_span_id == server.span_id}
    assert {"auth", "admission", "route"} <= set(children)
    route = children["route"]
    assert route.attributes["kvgate.route.policy"] == "round_robin"
    assert set(route.attributes["kvgate.route.candidates"]) == {"bad", "good"}
    attempts = [s for s in spans if s.kind == "client"]
    assert {s.attributes["kvgate.worker"] for s in attempts} == {"bad", "good"}
    assert all(s.name == f"text_completion {MODEL}" for s in attempts)
    failed = [s for s in attempts if s.attributes["kvgate.worker"] == "bad"]
    assert failed and all(s.status == "error" and s.attributes["kvgate.outcome"] == "status" for s in failed)
    answered = [s for s in attempts if s.attributes["kvgate.worker"] == "good"]
    assert all(s.attributes["kvgate.outcome"] == "ok" for s in answered)
    # each worker continues its own attempt's span: the trace goes on below the gateway
    sent = {h["traceparent"].split("-")[2] for h in seen + seen_failing if h["traceparent"].split("-")[1] == TRACE_ID}
    assert sent == {s.span_id for s in attempts}


def test_a_request_without_a_trace_starts_one(traced):
    gateway, receiver, seen, _ = traced
    response = complete(gateway.url, {"x-request-id": "untraced-1"})
    assert response.status_code == 200
    trace_id = response.headers["traceparent"].split("-")[1]
    spans = receiver.wait_for(lambda spans: any(s.kind == "server" and s.trace_id == trace_id for s in spans))
    server = next(s for s in spans if s.kind == "server" and s.trace_id == trace_id)
    assert server.parent_span_id == ""
    assert seen[-1]["traceparent"].split("-")[1] == trace_id


def test_request_lines_name_the_trace_the_worker_the_route_and_the_tokens(traced):
    gateway, *_ = traced
    response = complete(gateway.url, {"traceparent": PARENT, "x-request-id": "logged-1"})
    assert response.status_code == 200
    line = line_for(gateway, "logged-1")
    assert line["source"] == "gateway" and line["status"] == 200 and line["outcome"] == "answered"
    assert line["trace_id"] == TRACE_ID
    assert line["tenant"] == "dev" and line["pool"] == "default" and line["model"] == MODEL
    assert line["worker"] == "good" and line["policy"] == "round_robin"
    assert line["prompt_tokens"] == 1 and line["completion_tokens"] == 1
    assert line["e2e_s"] > 0 and line["ttft_s"] > 0 and line["duration_s"] >= line["e2e_s"]
    assert "prompt_token_ids" not in line and "hello" not in json.dumps(line)


@pytest.fixture(scope="module")
def untraced(tmp_path_factory):
    """A gateway with tracing off (the default) and prompt token ids in its log lines."""
    seen: list[dict] = []
    with ExitStack() as stack:
        answering = stack.enter_context(serve_in_thread(recording_worker(seen), free_port()))
        config = gateway_config([worker_entry("w0", answering)], None, logging={"prompt_token_ids": True})
        yield start_gateway(stack, config, tmp_path_factory.mktemp("untraced")), seen


def test_every_answer_and_refusal_has_its_line(untraced):
    gateway, _ = untraced
    ok = complete(gateway.url, {"x-request-id": "ok-1"})
    unauthorized = httpx.post(f"{gateway.url}/v1/completions", headers={"x-request-id": "no-key-1"}, json={})
    invalid = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "no model"},
                         headers={"Authorization": f"Bearer {API_KEY}", "x-request-id": "bad-1"})
    assert (ok.status_code, unauthorized.status_code, invalid.status_code) == (200, 401, 400)
    answered = line_for(gateway, "ok-1")
    assert answered["status"] == 200 and answered["policy"] == "kv_aware"
    assert answered["route_reason"].startswith("w0(cached_blocks=")  # why the worker ranked first
    refused = line_for(gateway, "no-key-1")
    assert (refused["status"], refused["tenant"], refused["outcome"]) == (401, "unauthenticated", "invalid_api_key")
    bad = line_for(gateway, "bad-1")
    assert bad["status"] == 400 and bad["tenant"] == "dev" and "model" in bad["error"]
    httpx.get(f"{gateway.url}/metrics")
    assert all(line["path"] != "/metrics" for line in request_lines(gateway.output()))  # nor probes


def test_tracing_off_still_names_the_callers_trace_and_passes_it_on(untraced):
    gateway, seen = untraced
    response = complete(gateway.url, {"traceparent": PARENT, "x-request-id": "off-1"})
    assert response.headers["traceparent"] == PARENT
    assert seen[-1]["traceparent"] == PARENT
    assert line_for(gateway, "off-1")["trace_id"] == TRACE_ID


def test_prompt_token_ids_are_logged_when_asked(untraced):
    gateway, _ = untraced
    complete(gateway.url, {"x-request-id": "ids-1"}, prompt=[5, 6, 7])
    assert line_for(gateway, "ids-1")["prompt_token_ids"] == [5, 6, 7]


def test_metrics_operators_can_window(untraced):
    gateway, _ = untraced
    complete(gateway.url)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)}
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    assert "kvgate_router_prediction_hit_ratio" not in families  # a since-start ratio: the counters instead
    for counter in ("kvgate_router_predicted_cached_tokens", "kvgate_router_confirmed_cached_tokens",
                    "kvgate_kv_events_applied", "kvgate_routed", "kvgate_requests"):
        assert families[counter].type == "counter", counter
    build = families["kvgate_build_info"].samples[0]
    assert build.value == 1 and build.labels["version"] and build.labels["python_version"]
    assert families["process_cpu_seconds"].samples[0].value > 0
    assert "python_gc_objects_collected" in families and "python_info" in families
    assert families["kvgate_requests_in_flight"].samples[0].value == 0
    assert {s.labels["worker"] for s in families["kvgate_worker_requests_in_flight"].samples} == {"w0"}
    routed = families["kvgate_routed"].samples
    assert any(s.labels == {"pool": "default", "policy": "kv_aware", "worker": "w0"} and s.value >= 1 for s in routed)
    answered = [s for s in families["kvgate_requests"].samples if s.labels.get("status") == "200"]
    assert answered and all(s.labels["pool"] == "default" for s in answered)
    assert [(s.labels, s.value) for s in families["kvgate_pool_healthy_workers"].samples] == [({"pool": "default"}, 1)]
    prompt = families["kvgate_prompt_tokens"].samples
    assert prompt and all(s.labels["pool"] == "default" for s in prompt)
    ttft = [s for s in families["kvgate_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft and ttft[0].labels == {"model": MODEL, "pool": "default"}


def test_an_exporter_set_by_the_standard_variable_is_used(tmp_path):
    seen: list[dict] = []
    with ExitStack() as stack:
        answering = stack.enter_context(serve_in_thread(recording_worker(seen), free_port()))
        config = gateway_config([worker_entry("w0", answering)], None)
        gateway = start_gateway(stack, config, tmp_path, env={"OTEL_TRACES_EXPORTER": "console"})
        assert complete(gateway.url, {"x-request-id": "console-1"}).status_code == 200
        # the SERVER span ends after the response's last byte: on a busy host the client can read the
        # answer before the exporter has printed it
        deadline = time.monotonic() + 10.0
        while '"name": "POST /v1/completions"' not in (output := gateway.output()) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert '"name": "POST /v1/completions"' in output and '"kvgate.request_id": "console-1"' in output


def test_an_unknown_exporter_stops_the_gateway_with_a_message(tmp_path):
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(json.dumps(gateway_config([worker_entry("w0", "http://127.0.0.1:1")], None)))
    done = subprocess.run([sys.executable, "-m", "kvgate", "gateway", "--config", str(config_path)],
                          env={"OTEL_TRACES_EXPORTER": "zipkin", "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "OTEL_TRACES_EXPORTER='zipkin'" in done.stderr


def test_a_batch_of_prompts_has_one_line_listing_each_prompts_fields(untraced):
    gateway, _ = untraced
    response = complete(gateway.url, {"x-request-id": "batch-1"}, prompt=[[5, 6], [7, 8, 9]])
    assert response.status_code == 200
    line = line_for(gateway, "batch-1")
    assert line["status"] == 200 and len(line["prompts"]) == 2
    assert [p["prompt_token_ids"] for p in line["prompts"]] == [[5, 6], [7, 8, 9]]
    assert all(p["worker"] == "w0" and p["outcome"] == "answered" for p in line["prompts"])
    assert not [other for other in request_lines(gateway.output()) if other["request_id"].startswith("batch-1-")]
