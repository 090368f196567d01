"""A real `kvgate worker` (sim executor) as an operator observes it: vLLM's series on /metrics, the
request id, one JSON log line per completion request on stderr, and traces sent over OTLP/HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.otlp_receiver import otlp_receiver
from tests.processes import Process, running, worker_process

pytestmark = pytest.mark.slow  # every test starts `kvgate worker` as a process

SIM = ("--executor", "sim", "--served-model-name", "tiny", "--max-model-len", "512", "--block-size", "8")
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # vLLM's build_1_2_5_buckets(max_model_len=512)
TOKEN_LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                           20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 7680.0]
NEW_SERIES = {  # name -> vLLM's buckets (None: a gauge)
    "vllm:gpu_cache_usage_perc": None,
    "vllm:time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS_S,
    "vllm:request_time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS_S,
    "vllm:request_prompt_tokens": TOKEN_BUCKETS,
    "vllm:request_generation_tokens": TOKEN_BUCKETS,
    "vllm:request_max_num_generation_tokens": TOKEN_BUCKETS,
    "vllm:request_params_max_tokens": TOKEN_BUCKETS,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS_S,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS_S,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS_S,
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}
# the 15 series vLLM's example dashboard reads (8 of them were all a kvgate worker exported before #19)
VLLM_EXAMPLE_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "gpu_cache_usage_perc", "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum")
PROMPT_IDS = [11, 12, 13, 14, 15, 16, 17]
PARENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PARENT_TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.fixture(scope="module")
def worker(tiny_llama_dir):
    with running(worker_process(tiny_llama_dir, *SIM)) as process:
        yield process


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def sample(families_: dict, family: str, suffix: str = "", **labels) -> float:
    (value,) = [s.value for s in families_[family].samples
                if s.name == family + suffix and labels.items() <= s.labels.items()]
    return value


def completion(url: str, request_id: str | None = None, path: str = "/v1/completions", *,
               headers: dict[str, str] | None = None, **body) -> httpx.Response:
    """POST a small request (the body's fields override the defaults) with X-Request-Id request_id."""
    body = {"model": "tiny", "max_tokens": 3, "ignore_eos": True,
            **({"prompt": PROMPT_IDS} if path == "/v1/completions" else {}), **body}
    headers = {**({} if request_id is None else {"x-request-id": request_id}), **(headers or {})}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)


def request_lines(process: Process, request_id: str, **fields) -> list[dict]:
    """The worker's request log lines (JSON on stderr) for request_id that have these fields."""
    lines = [json.loads(line) for line in process.output().splitlines() if line.startswith('{"ts"')]
    return [line for line in lines if line.get("event") == "request" and line.get("request_id") == request_id
            and fields.items() <= line.items()]


# ---- metrics -------------------------------------------------------------------------------------


def test_a_fresh_worker_exports_vllms_series_at_zero_with_vllms_labels_and_buckets(tiny_llama_dir):
    with running(worker_process(tiny_llama_dir, *SIM)) as process:
        text = httpx.get(f"{process.url}/metrics").text
    exported = {f.name: f for f in text_string_to_metric_families(text)}

    for name, buckets in NEW_SERIES.items():
        samples = exported[name].samples
        assert samples and all(s.labels.items() >= {"model_name": "tiny", "engine": "0"}.items() for s in samples)
        assert all(s.value == 0 for s in samples), name
        if buckets is not None:
            assert [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")] == [*buckets, float("inf")]
    reasons = {s.labels["finished_reason"] for s in exported["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    assert any(name.startswith("process_") for name in exported) and any(n.startswith("python_") for n in exported)
    assert "_created" not in text
    # every series vLLM's own example Grafana dashboard queries (examples/online_serving/prometheus_grafana)
    queried = [f"vllm:{name}" for name in VLLM_EXAMPLE_DASHBOARD_SERIES]
    samples = {s.name for f in exported.values() for s in f.samples}
    assert [name for name in queried if name not in samples] == []


def test_one_request_is_counted_in_the_token_histograms(worker):
    before = families(worker.url)

    assert completion(worker.url, max_tokens=4).status_code == 200

    after = families(worker.url)
    for family, observed in [("vllm:request_prompt_tokens", len(PROMPT_IDS)), ("vllm:request_generation_tokens", 4),
                             ("vllm:request_max_num_generation_tokens", 4), ("vllm:request_params_max_tokens", 4),
                             ("vllm:request_params_n", 1)]:
        assert sample(after, family, "_count") - sample(before, family, "_count") == 1, family
        assert sample(after, family, "_sum") - sample(before, family, "_sum") == observed, family
    steps, step_tokens = (sample(after, "vllm:iteration_tokens_total", suffix)
                          - sample(before, "vllm:iteration_tokens_total", suffix) for suffix in ("_count", "_sum"))
    assert (steps, step_tokens) == (4, len(PROMPT_IDS) + 4)  # one step per token; the prompt counts in the first
    for family in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                   "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds"):
        assert sample(after, family, "_count") - sample(before, family, "_count") == 1, family
    assert sample(after, "vllm:time_per_output_token_seconds", "_count") == sample(
        after, "vllm:inter_token_latency_seconds", "_count")
    assert sample(after, "vllm:gpu_cache_usage_perc") == sample(after, "vllm:kv_cache_usage_perc")


# ---- request id and request log ------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "stream", "response_id"), [
    ("completion", False, "cmpl-abc-123"),
    ("chat", False, "chatcmpl-abc-123"),
    ("chat", True, "chatcmpl-abc-123"),
], ids=["completion", "chat", "chat-stream"])
def test_the_callers_request_id_names_the_response_and_its_one_log_line(worker, kind, stream, response_id):
    body = {"messages": [{"role": "user", "content": "a secret prompt"}]} if kind == "chat" else {}
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    response = completion(worker.url, "abc-123", path, stream=stream, **body)

    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-123"
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        ids, usage = {c["id"] for c in chunks}, chunks[-1]["usage"]
    else:
        ids, usage = {response.json()["id"]}, response.json()["usage"]
    assert ids == {response_id}
    (line,) = request_lines(worker, "abc-123", kind=kind, stream=stream)  # each case's own line
    assert line["status"] == 200 and line["outcome"] == "finished" and line["finish_reason"] == "length"
    assert (line["prompt_tokens"], line["output_tokens"], line["cached_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    assert line["path"] == path and line["model"] == "tiny" and line["priority"] == 0
    assert 0 <= line["queue_s"] and 0 < line["prefill_s"] <= line["ttft_s"] <= line["e2e_s"] and line["decode_s"] > 0
    assert "prompt_token_ids" not in line and "secret" not in json.dumps(line)


def test_with_tracing_off_the_log_line_names_the_callers_trace(worker):
    assert completion(worker.url, "from-a-trace", headers={"traceparent": TRACEPARENT}).status_code == 200
    assert completion(worker.url, "no-trace").status_code == 200

    (line,) = request_lines(worker, "from-a-trace")
    assert line["trace_id"] == PARENT_TRACE_ID
    assert "trace_id" not in request_lines(worker, "no-trace")[0]


def test_a_request_id_that_is_not_valid_is_replaced_by_a_new_one(worker):
    response = completion(worker.url, "not a valid id")

    request_id = response.headers["x-request-id"]
    assert request_id != "not a valid id" and response.json()["id"] == f"cmpl-{request_id}"
    assert len(request_lines(worker, request_id)) == 1


def test_the_same_request_id_twice_at_once_runs_as_two_requests(worker):
    async def twice():
        async with httpx.AsyncClient(base_url=worker.url, timeout=30) as client:
            body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 16, "ignore_eos": True}
            return await asyncio.gather(*[client.post("/v1/completions", json=body, headers={"x-request-id": "twice"})
                                          for _ in range(2)])

    responses = asyncio.run(twice())

    assert [r.status_code for r in responses] == [200, 200]
    assert [r.json()["id"] for r in responses] == ["cmpl-twice"] * 2
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [16, 16]
    assert [line["outcome"] for line in request_lines(worker, "twice")] == ["finished", "finished"]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"headers": {"x-priority": "high"}}, 400, "X-Priority"),
], ids=["bad-max-tokens", "unknown-model", "bad-priority-header"])
def test_a_rejected_request_gets_one_log_line_with_its_status(worker, body, status, param):
    request_id = f"rejected-{param}"
    response = completion(worker.url, request_id, **body)

    assert response.status_code == status and response.headers["x-request-id"] == request_id
    (line,) = request_lines(worker, request_id)
    assert (line["status"], line["outcome"], line["error_param"]) == (status, "rejected", param)
    assert "output_tokens" not in line and "ttft_s" not in line and line["e2e_s"] >= 0


def test_log_prompt_token_ids_adds_the_prompts_token_ids_to_the_line(tiny_llama_dir):
    with running(worker_process(tiny_llama_dir, *SIM, "--log-prompt-token-ids")) as process:
        assert completion(process.url, "with-ids").status_code == 200
        assert completion(process.url, "bad-with-ids", max_tokens=0).status_code == 400
        (line,) = request_lines(process, "with-ids")
        (rejected,) = request_lines(process, "bad-with-ids")

    assert line["prompt_token_ids"] == PROMPT_IDS
    assert "prompt_token_ids" not in rejected  # rejected before it was tokenized


def test_no_request_log_writes_no_lines(tiny_llama_dir):
    with running(worker_process(tiny_llama_dir, *SIM, "--no-request-log")) as process:
        assert completion(process.url, "quiet").status_code == 200
        assert completion(process.url, "quiet", max_tokens=0).status_code == 400
        output = process.output()

    assert '"event":"request"' not in output and "quiet" not in output


# ---- traces --------------------------------------------------------------------------------------


@pytest.fixture
def receiver():
    with otlp_receiver() as receiver:
        yield receiver


def traced_worker(model_dir, *flags: str, env: dict[str, str] | None = None) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "kvgate", "worker", "--model", str(model_dir), "--port", str(port), *SIM, *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return Process(argv, f"http://127.0.0.1:{port}", env={**clean, **(env or {})})


def traced_requests(process: Process) -> dict[str, dict]:
    """A completion continuing the caller's trace, and a chat stream starting a new one; then stop the
    worker (which exports what it has buffered). Their log lines by request id."""
    assert completion(process.url, "traced-1", temperature=0.5, max_tokens=5, presence_penalty=0.25,
                      headers={"traceparent": TRACEPARENT}).status_code == 200
    assert completion(process.url, "traced-2", "/v1/chat/completions", stream=True, max_tokens=2,
                      messages=[{"role": "user", "content": "hi"}]).status_code == 200
    lines = {request_id: line for request_id in ("traced-1", "traced-2") for line in request_lines(process, request_id)}
    process.stop()
    return lines


@pytest.mark.parametrize("how", ["flags", "otel-variables"])
def test_a_request_is_traced_as_a_server_span_continuing_the_callers_trace(tiny_llama_dir, receiver, how):
    if how == "flags":
        process = traced_worker(tiny_llama_dir, "--tracing-exporter", "otlp", "--tracing-endpoint", receiver.url)
    else:
        process = traced_worker(tiny_llama_dir, env={"OTEL_TRACES_EXPORTER": "otlp",
                                                     "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    with running(process):
        lines = traced_requests(process)

    assert process.proc.returncode == 0  # SIGTERM is a clean stop, which exports the spans still buffered
    spans = receiver.spans
    assert {span.service for span in spans} == {"kvgate-worker"}
    servers = {s.attributes["kvgate.request_id"]: s for s in spans if s.kind == "server"}
    server = servers["traced-1"]
    assert server.name == "text_completion tiny" and server.status == "unset"
    assert (server.trace_id, server.parent_span_id) == (PARENT_TRACE_ID, PARENT_SPAN_ID)
    attributes = server.attributes
    assert attributes == {**attributes, "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "kvgate",
                          "gen_ai.request.model": "tiny", "gen_ai.request.max_tokens": 5,
                          "gen_ai.request.temperature": 0.5, "gen_ai.request.presence_penalty": 0.25,
                          "gen_ai.response.id": "cmpl-traced-1",
                          "gen_ai.response.finish_reasons": ["length"], "gen_ai.usage.input_tokens": len(PROMPT_IDS),
                          "gen_ai.usage.output_tokens": 5, "gen_ai.usage.cache_read.input_tokens": 0,
                          "http.response.status_code": 200}
    assert "gen_ai.request.top_p" not in attributes and "gen_ai.request.frequency_penalty" not in attributes
    children = sorted((s for s in spans if s.parent_span_id == server.span_id), key=lambda s: s.start_ns)
    assert [(c.name, c.kind, c.trace_id) for c in children] == [
        ("queue", "internal", PARENT_TRACE_ID), ("prefill", "internal", PARENT_TRACE_ID),
        ("decode", "internal", PARENT_TRACE_ID)]
    marks = [server.start_ns, *[t for child in children for t in (child.start_ns, child.end_ns)], server.end_ns]
    assert marks == sorted(marks) and children[0].end_ns == children[1].start_ns
    chat = servers["traced-2"]
    assert chat.name == "chat tiny" and chat.parent_span_id == "" and chat.trace_id != PARENT_TRACE_ID
    assert chat.attributes["gen_ai.response.id"] == "chatcmpl-traced-2"
    assert [lines[i]["trace_id"] for i in ("traced-1", "traced-2")] == [PARENT_TRACE_ID, chat.trace_id]


def test_tracing_exporter_none_sends_nothing_even_where_otel_variables_ask(tiny_llama_dir, receiver):
    process = traced_worker(tiny_llama_dir, "--tracing-exporter", "none",
                            env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    with running(process):
        traced_requests(process)

    assert process.proc.returncode == 0 and receiver.spans == []
