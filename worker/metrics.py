"""The worker's Prometheus metrics under vLLM's `vllm:*` names, labels and buckets, so vLLM's dashboards
and scrapers work (per request log lines and traces: worker/request_telemetry.py).

Metrics follow vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py): labels model_name and engine
("0"; request_success adds finished_reason), histogram buckets as vLLM's (token counts by
build_1_2_5_buckets(max_model_len)), every series exported from the start at zero, counters with
prometheus_client's `_total` suffix and no `_created` series. Time to first token and e2e latency count
from the moment the HTTP handler received the request; queue time from when the engine took it.
Beside them: process_* and python_* (the worker process), and `kvgate_worker_info{executor=...}`,
which says whether figures come from real model math or `sim`.
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, disable_created_metrics, generate_latest)

from worker.async_engine import RequestTiming
from worker.engine.engine import Engine, RequestOutput
from worker.engine.sequence import FinishReason

disable_created_metrics()  # no `_created` series beside every counter and histogram (vLLM exports none)

# vLLM's buckets (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                              120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_MAX_MODEL_LEN = 32768  # token-count buckets where the context length is not given


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM's token-count buckets: 100 -> [1, 2, 5, 10, 20, 50, 100]."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class WorkerMetrics:
    """Owns one registry; updated by the engine thread after every step (StepObserver)."""

    def __init__(self, model_name: str, executor_name: str, *, block_size: int | None = None,
                 num_blocks: int | None = None, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self._labels = {"model_name": model_name, "engine": "0"}
        self._scheduler_series()
        self._request_series(build_1_2_5_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN))
        info = Gauge("kvgate_worker_info", "Which executor serves this worker (sim: timing model, no model math).",
                     ["model_name", "executor"], registry=self.registry)
        info.labels(model_name=model_name, executor=executor_name).set(1)
        if num_blocks is not None:  # as vLLM names it: a gateway learns the KV capacity from it
            cache = Gauge("vllm:cache_config_info", "Information of the KV cache config.",
                          ["block_size", "num_gpu_blocks"], registry=self.registry)
            cache.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)
        self._last: dict[str, int] = {}

    def _scheduler_series(self) -> None:
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = self._gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent "
                                           "usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.prefix_queries = self._counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.iteration_tokens = self._histogram("vllm:iteration_tokens_total", "Histogram of number of tokens "
                                                "per engine_step.", _ITERATION_TOKENS_BUCKETS)

    def _request_series(self, token_buckets: list[int]) -> None:
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*self._labels, "finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(**self._labels, finished_reason=str(reason))
                                for reason in FinishReason}
        h = self._histogram
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_buckets)
        self.request_generation_tokens = h("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           token_buckets)
        self.max_num_generation_tokens = h("vllm:request_max_num_generation_tokens",
                                           "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.", _PARAMS_N_BUCKETS)
        self.params_max_tokens = h("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                   token_buckets)
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                      _TTFT_BUCKETS_S)
        self.itl = h("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                     _TOKEN_LATENCY_BUCKETS_S)
        self.tpot = h("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                      "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", _TOKEN_LATENCY_BUCKETS_S)
        self.request_tpot = h("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", _TOKEN_LATENCY_BUCKETS_S)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     _REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = h("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                            _REQUEST_LATENCY_BUCKETS_S)
        self.inference_time = h("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", _REQUEST_LATENCY_BUCKETS_S)
        self.prefill_time = h("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS_S)
        self.decode_time = h("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                             _REQUEST_LATENCY_BUCKETS_S)

    def _gauge(self, name: str, documentation: str):
        return Gauge(name, documentation, list(self._labels), registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, documentation: str):
        return Counter(name, documentation, list(self._labels), registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]):
        return Histogram(name, documentation, list(self._labels), buckets=buckets,
                         registry=self.registry).labels(**self._labels)

    def on_step(self, engine: Engine, outputs: Sequence[RequestOutput], timings: dict[str, RequestTiming]) -> None:
        stats = engine.stats()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self._advance(self.prefix_queries, "queries", stats.prefix_cache_queries_tokens)
        self._advance(self.prefix_hits, "hits", stats.prefix_cache_hits_tokens)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions)
        step_tokens = (self._advance(self.prompt_tokens, "prompt", stats.num_prompt_tokens)
                       + self._advance(self.generation_tokens, "generation", stats.num_generation_tokens))
        if step_tokens > 0:  # as vLLM: a request's prompt tokens count in the step of its first token
            self.iteration_tokens.observe(step_tokens)
        for output in outputs:
            timing = timings.get(output.request_id)
            if timing is not None and output.finished:
                self._observe_finished(output, timing)

    def _advance(self, counter, key: str, total: int) -> int:
        """Counters follow the engine's cumulative totals; returns the increase."""
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = total
        return max(delta, 0)

    def _observe_finished(self, output: RequestOutput, timing: RequestTiming) -> None:
        num_generated = output.num_output_tokens
        self.request_success[output.finish_reason or FinishReason.STOP].inc()
        self.request_prompt_tokens.observe(output.num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)
        self.max_num_generation_tokens.observe(num_generated)  # the largest of the request's n (= 1) outputs
        self.params_n.observe(1)
        if timing.max_tokens:
            self.params_max_tokens.observe(timing.max_tokens)
        if timing.first_token_s is None or timing.first_step_s is None or timing.last_token_s is None:
            return
        decode_s = timing.last_token_s - timing.first_token_s
        self.ttft.observe(timing.first_token_s - timing.arrival_s)
        self.e2e.observe(timing.last_token_s - timing.arrival_s)
        queued_s = timing.queued_s if timing.queued_s is not None else timing.arrival_s
        self.queue_time.observe(max(0.0, timing.first_step_s - queued_s))
        self.prefill_time.observe(timing.first_token_s - timing.first_step_s)
        self.decode_time.observe(decode_s)
        self.inference_time.observe(timing.last_token_s - timing.first_step_s)
        self.request_tpot.observe(decode_s / (num_generated - 1) if num_generated > 1 else 0.0)
        for gap in timing.token_gaps_s:
            self.itl.observe(gap)
            self.tpot.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
