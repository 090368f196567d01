"""An OTLP/HTTP trace receiver for tests: a real HTTP server on a loopback port that decodes what an
exporter POSTs to /v1/traces (protobuf) into plain span records, as a collector would receive them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    status: str  # "unset", "ok" or "error"
    start_ns: int
    end_ns: int


class OtlpReceiver:
    """spans: every span received so far; url: the base URL to give an exporter."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def wait_for(self, check: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """The spans once check(spans) holds; AssertionError naming what arrived when it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if check(spans):
                return spans
            assert time.monotonic() < deadline, f"spans received: {[(s.service, s.name) for s in spans]}"
            time.sleep(0.05)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(service, s.name, KINDS.get(s.kind, str(s.kind)), s.trace_id.hex(),
                                          s.span_id.hex(), s.parent_span_id.hex(), _attributes(s.attributes),
                                          {0: "unset", 1: "ok", 2: "error"}[s.status.code],
                                          s.start_time_unix_nano, s.end_time_unix_nano)
                             for s in scope_spans.spans]
        with self.lock:
            self.spans += received


def _attributes(pairs) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        value = pair.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[pair.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[pair.key] = getattr(value, kind) if kind else None
    return out


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver listening on a free loopback port until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    server.receiver = receiver  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        self.server.receiver.add(body)  # type: ignore[attr-defined]
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass
