"""What the worker reports about each completion request once it has ended: one JSON log line
(kvgate/request_log.py) and, while tracing is on, one trace continuing the caller's (kvgate/tracing.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from opentelemetry import trace

from kvgate.api_error import ApiError
from kvgate.request_log import RequestLog
from kvgate.tracing import caller_context, trace_id_of
from worker.async_engine import RequestTiming
from worker.engine.engine import RequestOutput
from worker.openai_api import GenerateRequest

FINISHED, ERROR, CLIENT_GONE, REJECTED = "finished", "error", "client_gone", "rejected"  # a request's outcome


@dataclass(slots=True)
class RequestRecord:
    """One completion request as the worker reports it, filled in by the handler as it runs.

    arrival_s is on the engine's clock (the clock of timing's marks); arrival_ns is the same moment
    on the wall clock (time.time_ns), from which span times are derived."""

    request_id: str
    kind: str  # "completion" or "chat"
    path: str
    arrival_s: float
    arrival_ns: int
    traceparent: str | None = None
    tracestate: str | None = None
    request: GenerateRequest | None = None
    response_id: str | None = None
    prompt_token_ids: list[int] | None = None
    timing: RequestTiming | None = None
    last_outputs: dict[int, RequestOutput] = field(default_factory=dict)  # each choice's latest output, by index
    status: int | None = None
    outcome: str | None = None
    error: ApiError | None = None
    end_s: float | None = None

    @property
    def last_output(self) -> RequestOutput | None:
        """The first choice's latest output (its finish reason and cached tokens stand for the request's)."""
        return self.last_outputs.get(0)

    @property
    def num_output_tokens(self) -> int:
        """The tokens of every choice."""
        return sum(output.num_output_tokens for output in self.last_outputs.values())

    def wall_ns(self, t_s: float) -> int:
        """A mark on the engine's clock as wall-clock nanoseconds."""
        return self.arrival_ns + round((t_s - self.arrival_s) * 1e9)


class RequestTelemetry:
    """Reports each completion request once, when it has ended: a JSON line on request_log and, with a
    tracer, a SERVER span continuing the caller's traceparent with children queue, prefill and decode.

    Spans follow OpenTelemetry's GenAI conventions: named "{gen_ai.operation.name} {model}", with
    gen_ai.* request, response and usage attributes. They are made after the fact from the request's
    marks; tracer None (tracing off) skips all span work. The log line never holds prompt or output
    text; log_prompt_token_ids adds the prompt's token ids.
    """

    def __init__(self, model_name: str, request_log: RequestLog, tracer: trace.Tracer | None = None, *,
                 log_prompt_token_ids: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.model_name = model_name
        self.request_log = request_log
        self.tracer = tracer
        self.log_prompt_token_ids = log_prompt_token_ids
        self.clock = clock

    def start(self, kind: str, path: str, request_id: str, traceparent: str | None = None,
              tracestate: str | None = None) -> RequestRecord:
        return RequestRecord(request_id, kind, path, self.clock(), time.time_ns(), traceparent, tracestate)

    def report(self, record: RequestRecord, status: int, outcome: str, error: ApiError | None = None) -> None:
        """End the record and report it; a record already reported is left alone (one line per request)."""
        if record.outcome is not None:
            return
        record.end_s = self.clock()
        record.status, record.outcome, record.error = status, outcome, error
        span = self._trace(self.tracer, record) if self.tracer is not None else None
        if self.request_log.enabled:
            self.request_log.write(self._line(record, span))

    def _line(self, record: RequestRecord, span: trace.Span | None) -> dict:
        req, last, timing = record.request, record.last_output, record.timing
        line = {
            "request_id": record.request_id, "trace_id": trace_id_of(span, record.traceparent),
            "model": self.model_name, "kind": record.kind, "path": record.path,
            "stream": req.stream if req is not None else None, "status": record.status, "outcome": record.outcome,
            "finish_reason": str(last.finish_reason) if last is not None and last.finish_reason else None,
            "prompt_tokens": len(record.prompt_token_ids) if record.prompt_token_ids is not None else None,
            "cached_tokens": last.num_cached_tokens if last is not None else None,
            "output_tokens": (record.num_output_tokens if last is not None
                              else 0 if record.response_id is not None else None),  # None: it never ran
            "priority": req.priority if req is not None else None,
            "error_type": record.error.type if record.error is not None else None,
            "error_param": record.error.param if record.error is not None else None,
            **_timings(record, timing),
        }
        if self.log_prompt_token_ids:
            line["prompt_token_ids"] = record.prompt_token_ids
        return line

    def _trace(self, tracer: trace.Tracer, record: RequestRecord) -> trace.Span:
        operation = "chat" if record.kind == "chat" else "text_completion"
        model = (record.request.model if record.request is not None else None) or self.model_name
        server = tracer.start_span(
            f"{operation} {model}", context=caller_context(record.traceparent, record.tracestate), kind=trace.SpanKind.SERVER,
            start_time=record.arrival_ns,
            attributes={"gen_ai.operation.name": operation, "gen_ai.system": "kvgate",
                        "gen_ai.provider.name": "kvgate", "gen_ai.request.model": model,
                        "kvgate.request_id": record.request_id})
        if server.is_recording():
            server.set_attributes(self._result_attributes(record))
            phases = trace.set_span_in_context(server)
            for name, start_s, end_s in _phases(record):
                tracer.start_span(name, context=phases, start_time=record.wall_ns(start_s)).end(
                    end_time=record.wall_ns(end_s))
            if record.outcome == ERROR:
                server.set_status(trace.Status(trace.StatusCode.ERROR,
                                               record.error.message if record.error is not None else None))
        server.end(end_time=record.wall_ns(_end_s(record)))
        return server

    def _result_attributes(self, record: RequestRecord) -> dict:
        attributes: dict = {"http.response.status_code": record.status, "gen_ai.response.model": self.model_name}
        req, last = record.request, record.last_output
        if req is not None:
            attributes["gen_ai.request.max_tokens"] = req.sampling.max_tokens
            for param in req.sampling_given:
                value = getattr(req.sampling, param)
                if value is not None:
                    attributes[f"gen_ai.request.{param}"] = value
        if record.response_id is not None:
            attributes["gen_ai.response.id"] = record.response_id
        if record.prompt_token_ids is not None:
            attributes["gen_ai.usage.input_tokens"] = len(record.prompt_token_ids)
        if last is not None:
            attributes["gen_ai.usage.output_tokens"] = record.num_output_tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = last.num_cached_tokens
            reasons = [str(record.last_outputs[index].finish_reason) for index in sorted(record.last_outputs)
                       if record.last_outputs[index].finish_reason is not None]
            if reasons:
                attributes["gen_ai.response.finish_reasons"] = reasons
        if record.error is not None:
            attributes["error.type"] = record.error.type
        return attributes


def _phases(record: RequestRecord) -> list[tuple[str, float, float]]:
    """(name, start, end) on the engine's clock: queue (the engine took it -> the first step that ran it),
    prefill (-> its first token), decode (first token -> last token), as far as the request got."""
    timing = record.timing
    if timing is None or timing.queued_s is None:
        return []
    phases = [("queue", timing.queued_s, timing.first_step_s if timing.first_step_s is not None else _end_s(record))]
    if timing.first_step_s is not None and timing.first_token_s is not None:
        last_token_s = timing.last_token_s if timing.last_token_s is not None else timing.first_token_s
        phases += [("prefill", timing.first_step_s, timing.first_token_s),
                   ("decode", timing.first_token_s, last_token_s)]
    return phases


def _end_s(record: RequestRecord) -> float:
    return record.end_s if record.end_s is not None else record.arrival_s


def _timings(record: RequestRecord, timing: RequestTiming | None) -> dict[str, float | None]:
    """The log line's durations in seconds: queue_s, prefill_s, decode_s (as the spans), ttft_s and e2e_s
    (from the moment the worker received the request)."""
    def between(start: float | None, end: float | None) -> float | None:
        return round(end - start, 6) if start is not None and end is not None else None

    if timing is None:
        return {"e2e_s": between(record.arrival_s, record.end_s)}
    return {"queue_s": between(timing.queued_s, timing.first_step_s),
            "prefill_s": between(timing.first_step_s, timing.first_token_s),
            "decode_s": between(timing.first_token_s, timing.last_token_s),
            "ttft_s": between(record.arrival_s, timing.first_token_s),
            "e2e_s": between(record.arrival_s, record.end_s)}
