"""Tracing setup, shared by the gateway and the worker: the OpenTelemetry SDK with a console or OTLP
exporter, configured by YAML (`tracing:`) or worker flags, and by the standard OTEL_* variables for
every setting those leave open.

Off (the default, exporter none) installs nothing: tracer() answers None, and callers skip span
work altogether. A tracer provider installed from outside (`opentelemetry-instrument`, or a host
application) is used when kvgate's own exporter is none, so outside instrumentation keeps working.

Sampling is parent-based: a request whose traceparent says sampled is traced whatever the ratio, one
that says not sampled is not, and a new trace is sampled with the configured ratio.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import context, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
EXPORTERS = ("none", "console", "otlp")
OTLP_TRACES_PATH = "/v1/traces"


class TracingSettingError(ValueError):
    """A tracing setting (YAML, flag or OTEL_* variable) that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """What start_tracing() installs. endpoint: the OTLP/HTTP traces URL (None: the exporter's
    default, http://localhost:4318/v1/traces)."""

    exporter: str = "none"
    endpoint: str | None = None
    sample_ratio: float = 1.0
    service_name: str = "kvgate"

    @property
    def enabled(self) -> bool:
        return self.exporter != "none"


def resolve_settings(service_name: str, exporter: str | None = None, endpoint: str | None = None,
                     sample_ratio: float | None = None, env: Mapping[str, str] | None = None) -> TracingSettings:
    """Settings from explicit values (YAML or flags; None: not given), else the OTEL_* variables in
    env (default os.environ), else off. endpoint is an OTLP/HTTP base URL (as
    OTEL_EXPORTER_OTLP_ENDPOINT: /v1/traces is added) or the traces URL itself."""
    env = os.environ if env is None else env
    if exporter is None:
        exporter = _exporter_from_env(env)
    if exporter not in EXPORTERS:
        raise TracingSettingError(f"tracing exporter {exporter!r}: expected one of {', '.join(EXPORTERS)}")
    if endpoint is None:
        endpoint = _endpoint_from_env(env)
    elif not endpoint.rstrip("/").endswith(OTLP_TRACES_PATH):
        endpoint = endpoint.rstrip("/") + OTLP_TRACES_PATH
    if sample_ratio is None:
        sample_ratio = _ratio_from_env(env)
    if not 0.0 <= sample_ratio <= 1.0:
        raise TracingSettingError(f"tracing sample ratio {sample_ratio}: expected a number in [0, 1]")
    return TracingSettings(exporter, endpoint, sample_ratio, env.get("OTEL_SERVICE_NAME") or service_name)


class Tracing:
    """The process's tracing: tracer(name) for spans (None while off), shutdown() flushes the exporter."""

    def __init__(self, settings: TracingSettings) -> None:
        self.settings = settings
        self._provider = _sdk_provider(settings) if settings.enabled else None

    def tracer(self, name: str) -> trace.Tracer | None:
        if self._provider is not None:
            return self._provider.get_tracer(name)
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return trace.get_tracer(name)  # a provider installed from outside
        return None

    def shutdown(self) -> None:
        """Export what is buffered and stop (at process end); idempotent."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


def _sdk_provider(settings: TracingSettings):
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    if settings.exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
    return provider


def _exporter_from_env(env: Mapping[str, str]) -> str:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "none"
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if not named:
        return "none"
    if len(named) > 1:
        raise TracingSettingError(f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: kvgate exports to one "
                                  f"of {', '.join(EXPORTERS)}")
    if named[0] not in EXPORTERS:
        raise TracingSettingError(f"OTEL_TRACES_EXPORTER={named[0]!r}: expected one of {', '.join(EXPORTERS)}")
    return named[0]


def _endpoint_from_env(env: Mapping[str, str]) -> str | None:
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + OTLP_TRACES_PATH
    return None


def _ratio_from_env(env: Mapping[str, str]) -> float:
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in ("", "always_on", "parentbased_always_on"):
        return 1.0
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        arg = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            return float(arg)
        except ValueError:
            raise TracingSettingError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: expected a number in [0, 1]") from None
    raise TracingSettingError(f"OTEL_TRACES_SAMPLER={sampler!r}: kvgate samples by trace id ratio (traceidratio, "
                              "parentbased_traceidratio, always_on, always_off and their parentbased_ forms)")


def trace_context_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """A caller's W3C trace context as headers to pass on ({} without a traceparent; a tracestate
    alone means nothing)."""
    if traceparent is None:
        return {}
    return {"traceparent": traceparent} if tracestate is None else {"traceparent": traceparent,
                                                                     "tracestate": tracestate}


def caller_context(traceparent: str | None, tracestate: str | None) -> context.Context:
    """The caller's trace context, for a SERVER span to continue (an empty context without one)."""
    return _propagator.extract(trace_context_headers(traceparent, tracestate))


def trace_id_of(span: trace.Span | None, traceparent: str | None = None) -> str | None:
    """The trace id (32 hex digits) a log line names: the span's, else the incoming traceparent's
    (tracing off still links the line to the caller's trace), else None."""
    if span is not None:
        context = span.get_span_context()
        if context.is_valid:
            return trace.format_trace_id(context.trace_id)
    if traceparent:
        parts = traceparent.strip().split("-")
        if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
            return parts[1].lower()
    return None
