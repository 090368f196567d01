"""Requests that fail or whose client leaves, as their log line and span report them: a real worker
server in this process (tests/worker/inprocess.py) over a paged fake executor that fails or slows down on
demand, with the OpenTelemetry SDK exporting to memory."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvgate.request_log import RequestLog
from tests.worker.fake_executor import FailingExecutor, PagedFakeExecutor
from tests.worker.inprocess import MODEL_NAME, serving
from worker.cli import build_state
from worker.engine.config import EngineConfig
from worker.model.tokenizer import load_tokenizer

PROMPT_IDS = [3, 4, 5, 6, 7]


class SlowExecutor(FailingExecutor):
    """Fails on demand, and takes step_s per step (so a client can leave while its request runs)."""

    step_s = 0.0

    def execute(self, batch):
        time.sleep(self.step_s)
        return super().execute(batch)


class Lines:
    """The worker's request lines, as the stream RequestLog writes them to."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write(self, data: bytes) -> int:
        self.lines.append(json.loads(data))
        return len(data)

    def of(self, request_id: str) -> list[dict]:
        return [line for line in self.lines if line["request_id"] == request_id]


@pytest.fixture
def lines() -> Lines:
    return Lines()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def executor() -> SlowExecutor:
    return SlowExecutor(PagedFakeExecutor(num_blocks=64, block_size=4, max_model_len=256))


@pytest.fixture
def worker(tiny_llama_dir, executor, spans, lines):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    config = EngineConfig(model_name=MODEL_NAME, block_size=executor.block_size, num_blocks=executor.num_blocks)
    state = build_state(executor, load_tokenizer(tiny_llama_dir), tiny_llama_dir, config,
                        request_log=RequestLog("worker", stream=lines), tracer=provider.get_tracer("test"))
    with serving(state) as served:
        yield served
    provider.shutdown()


def post(url: str, request_id: str, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 4, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=30)


def server_span(spans: InMemorySpanExporter, request_id: str):
    (span,) = [s for s in spans.get_finished_spans()
               if s.kind == SpanKind.SERVER and s.attributes["kvgate.request_id"] == request_id]
    return span


def wait_until_running(url: str, timeout_s: float = 10.0) -> None:
    """Until the engine runs a request and has generated a token (vllm:generation_tokens_total > 0)."""
    deadline = time.monotonic() + timeout_s
    while "vllm:generation_tokens_total{engine=\"0\",model_name=\"tiny\"} 0.0" in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.01)


def wait_for_line(lines: Lines, request_id: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not lines.of(request_id):
        assert time.monotonic() < deadline, f"no log line for {request_id}"
        time.sleep(0.01)
    (line,) = lines.of(request_id)
    return line


def test_a_failed_step_ends_the_span_with_status_error_and_logs_the_500(worker, executor, spans, lines):
    executor.fail_next_steps(1)

    assert post(worker.url, "fails").status_code == 500

    span = server_span(spans, "fails")
    assert span.status.status_code == StatusCode.ERROR
    assert (span.attributes["http.response.status_code"], span.attributes["error.type"]) == (500, "server_error")
    (line,) = lines.of("fails")
    assert (line["status"], line["outcome"], line["error_type"], line["output_tokens"]) == (500, "error",
                                                                                           "server_error", 0)


def test_a_stream_that_fails_is_logged_as_an_error_under_its_200(worker, executor, spans, lines):
    executor.fail_next_steps(1)

    response = post(worker.url, "stream-fails", stream=True)

    assert response.status_code == 200 and '"server_error"' in response.text
    assert server_span(spans, "stream-fails").status.status_code == StatusCode.ERROR
    (line,) = lines.of("stream-fails")
    assert (line["status"], line["outcome"], line["stream"]) == (200, "error", True)


def test_a_finished_request_leaves_its_span_status_unset(worker, spans, lines):
    assert post(worker.url, "fine").status_code == 200

    assert server_span(spans, "fine").status.status_code == StatusCode.UNSET
    assert [s.name for s in spans.get_finished_spans() if s.parent is not None
            and s.parent.span_id == server_span(spans, "fine").context.span_id] == ["queue", "prefill", "decode"]


def test_a_client_that_leaves_a_stream_is_logged_as_gone_with_the_tokens_it_got(worker, executor, spans, lines):
    executor.step_s = 0.01
    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, headers={"x-request-id": "leaves"},
                      timeout=30) as response:
        for received, _ in enumerate(response.iter_lines(), start=1):
            if received == 6:
                break

    line = wait_for_line(lines, "leaves")
    assert (line["status"], line["outcome"]) == (200, "client_gone") and 0 < line["output_tokens"] < 200
    assert "finish_reason" not in line
    assert server_span(spans, "leaves").status.status_code == StatusCode.UNSET


def test_a_client_that_leaves_before_the_answer_is_logged_as_gone_with_499(worker, executor, lines):
    executor.step_s = 0.01
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 200, "ignore_eos": True}).encode()
    host, port = worker.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\n"
                     b"x-request-id: hangs-up\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until_running(worker.url)

    line = wait_for_line(lines, "hangs-up")
    assert (line["status"], line["outcome"]) == (499, "client_gone") and 0 < line["output_tokens"] < 200
