"""Worker metrics under vLLM's `vllm:*` names and labels, so existing dashboards and scrapers work.

Counters are exported with prometheus_client's `_total` suffix, as vLLM's are. The extra gauge
`kvgate_worker_info{executor=...}` says whether figures come from real model math or `sim`.
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from worker.async_engine import RequestTiming
from worker.engine.engine import Engine, RequestOutput

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class WorkerMetrics:
    """Owns one registry; updated by the engine thread after every step (StepObserver)."""

    def __init__(self, model_name: str, executor_name: str, *, block_size: int | None = None,
                 num_blocks: int | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": "0"}
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                              registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", labels,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Successfully processed requests.",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", labels,
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", labels,
                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", labels,
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to the first step that ran the request, in seconds.",
                                    labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        info = Gauge("kvgate_worker_info", "Which executor serves this worker (sim: timing model, no model math).",
                     ["model_name", "executor"], registry=r)
        info.labels(model_name=model_name, executor=executor_name).set(1)
        if num_blocks is not None:  # as vLLM names it: a gateway learns the KV capacity from it
            cache = Gauge("vllm:cache_config_info", "Information of the KV cache config.",
                          ["block_size", "num_gpu_blocks"], registry=r)
            cache.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)
        for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.queue_time):
            metric.labels(**self._labels)  # export every series from the start, at zero
        self._last: dict[str, float] = {}

    def on_step(self, engine: Engine, outputs: Sequence[RequestOutput], timings: dict[str, RequestTiming]) -> None:
        stats = engine.stats()
        lab = self._labels
        self.running.labels(**lab).set(stats.num_running)
        self.waiting.labels(**lab).set(stats.num_waiting)
        self.kv_usage.labels(**lab).set(stats.kv_cache_usage)
        self._advance(self.prefix_queries, "queries", stats.prefix_cache_queries_tokens)
        self._advance(self.prefix_hits, "hits", stats.prefix_cache_hits_tokens)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.prompt_tokens, "prompt", stats.num_prompt_tokens)
        self._advance(self.generation_tokens, "generation", stats.num_generation_tokens)
        for output in outputs:
            timing = timings.get(output.request_id)
            if timing is not None and output.finished:
                self._observe_finished(output, timing)

    def _advance(self, counter: Counter, key: str, total: int) -> None:
        """Counters follow the engine's cumulative totals."""
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.labels(**self._labels).inc(delta)
        self._last[key] = total

    def _observe_finished(self, output: RequestOutput, timing: RequestTiming) -> None:
        lab = self._labels
        reason = output.finish_reason.value if output.finish_reason is not None else "stop"
        self.request_success.labels(**lab, finished_reason=reason).inc()
        if timing.first_token_s is None:
            return
        self.ttft.labels(**lab).observe(timing.first_token_s - timing.arrival_s)
        if timing.first_step_s is not None:
            self.queue_time.labels(**lab).observe(max(0.0, timing.first_step_s - timing.arrival_s))
        for gap in timing.token_gaps_s:
            self.itl.labels(**lab).observe(gap)
        self.e2e.labels(**lab).observe((timing.last_token_s or timing.first_token_s) - timing.arrival_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
