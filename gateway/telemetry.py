"""The gateway's traces and request log lines: which tracer (None while tracing is off), where the
lines go, and the spans a completion request opens inside its SERVER span (gateway/middleware.py).

A completion's trace: SERVER `POST /v1/chat/completions` (the middleware) > `auth` > `admission`
(the wait for a permit) > `route` (chosen worker, candidates, predicted cached tokens) > one CLIENT
span per upstream attempt (`chat {model}` / `text_completion {model}`, GenAI names; its context is
the traceparent the worker continues) > `failover` around a continuation on another worker.
Attribute names follow OpenTelemetry's GenAI and HTTP semantic conventions where they have one,
`kvgate.*` otherwise. With the tracer None (tracing off) no span work happens: a branch per step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvgate.config import KvgateConfig
from kvgate.request_log import RequestLog
from kvgate.tracing import Tracing, resolve_settings

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: open without a key, no span or line
OPERATIONS = {"chat": "chat", "completion": "text_completion"}  # gen_ai.operation.name per request kind
_propagator = TraceContextTextMapPropagator()


class Telemetry:
    """tracer: spans (None: tracing off); request_log: one JSON line per request;
    log_prompt_token_ids: add the routed prompt's token ids to it."""

    def __init__(self, tracing: Tracing | None = None, request_log: RequestLog | None = None,
                 log_prompt_token_ids: bool = False) -> None:
        self.tracing = tracing
        self.tracer = tracing.tracer("kvgate.gateway") if tracing is not None else None
        self.request_log = request_log or RequestLog("gateway", enabled=False)
        self.log_prompt_token_ids = log_prompt_token_ids

    @classmethod
    def from_config(cls, config: KvgateConfig) -> Telemetry:
        settings = resolve_settings("kvgate-gateway", config.tracing.exporter, config.tracing.endpoint,
                                    config.tracing.sample_ratio)
        return cls(Tracing(settings), RequestLog("gateway", enabled=config.logging.requests),
                   config.logging.prompt_token_ids)

    def shutdown(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()


def step_span(tracer: trace.Tracer | None, name: str, attributes: dict[str, Any] | None = None
              ) -> AbstractContextManager[trace.Span | None]:
    """An INTERNAL span around a step of the request, as a context manager giving the span (None, from
    one shared no-op, while tracing is off); an exception that leaves it is recorded on it."""
    if tracer is None:
        return _NO_SPAN
    return tracer.start_as_current_span(name, attributes=attributes)


_NO_SPAN: AbstractContextManager[None] = nullcontext()


def start_attempt_span(tracer: trace.Tracer, kind: str, model: str, worker_id: str, url: str, attempt_no: int,
                       failovers: int, headers: dict[str, str]) -> tuple[trace.Span, dict[str, str]]:
    """A CLIENT span for one upstream attempt, and the headers to send it with: the request's, with
    this span's traceparent, so the worker's spans are its children."""
    operation = OPERATIONS[kind]
    span = tracer.start_span(f"{operation} {model}", kind=trace.SpanKind.CLIENT, attributes={
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "kvgate", "gen_ai.request.model": model,
        "server.address": url, "kvgate.worker": worker_id, "kvgate.attempt": attempt_no,
        "kvgate.failovers": failovers})
    carrier = dict(headers)
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


def end_attempt_span(span: trace.Span, outcome: str, usage: dict[str, Any] | None = None,
                     finish_reason: str | None = None) -> None:
    """End an attempt's span: outcome "ok" or why it failed; the worker's usage when it sent one."""
    span.set_attribute("kvgate.outcome", outcome)
    if usage:
        set_usage(span, usage)
    if finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
    if outcome != "ok":
        span.set_status(trace.StatusCode.ERROR, outcome)
    span.end()


def set_usage(span: trace.Span, usage: dict[str, Any]) -> None:
    span.set_attribute("gen_ai.usage.input_tokens", usage.get("prompt_tokens") or 0)
    span.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached)
