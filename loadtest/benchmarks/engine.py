"""Engine benchmark: continuous batching, prefix-cache TTFT, scheduler overhead, KV memory, GPU MBU.

Drives worker.engine in-process (no HTTP) over the torch executor on the embedded default model
(SmolLM2-135M-Instruct); every ratio comes from one run on one machine. Prints JSON, writes
results/bench_engine.json and the `engine` section of docs/benchmarks.md (plus `engine-gpu` when
a GPU took part). Run: kvgate bench engine [--quick] [--only NAME ...] [--model DIR]
The bundled worker beside vLLM's CPU build, as servers, is its own benchmark: engine_side_by_side.py.

Over ~400 lines, and one module all the same: five short parts of one in-process benchmark (batching, prefix,
overhead, memory, GPU bandwidth) that share its helpers and its report, and that nothing else uses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from loadtest.benchdoc import bench_command, gpu_description, machine_description, replace_section, save_result
from loadtest.paths import RESULTS_DIR
from loadtest.stats import percentile
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.executor.base import StepBatch
from worker.executor.torch_executor import TorchExecutor
from worker.model.default_model import DEFAULT_SERVED_MODEL_NAME, resolve_model_path

RESULTS_PATH = RESULTS_DIR / "bench_engine.json"
BLOCK_SIZE = 16
CPU_NUM_BLOCKS = 384  # 6,144 tokens of KV, preallocated once at start-up
FIRST_ORDINARY_TOKEN = 100  # SmolLM2's special tokens sit below this
PEAK_BANDWIDTH_ENV = "KVGATE_GPU_PEAK_BW_BYTES_S"
# HBM peak bytes/s by nvidia-smi name; more specific names first ("A100" would match "A10").
PEAK_BANDWIDTH_BY_GPU = (
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
    ("L40S", 0.864e12), ("A10", 0.6e12), ("L4", 0.3e12),
)
TARGETS = {
    "batching_speedup": (">=", 8.0),
    "prefix_ttft_ratio": ("<=", 0.2),
    "step_overhead_mean_ms": ("<=", 2.0),
    "rss_growth_ratio": ("<=", 1.05),
}


# ---- helpers ------------------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_tokens(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]


def make_engine(executor, **config) -> Engine:
    return Engine(executor, None, EngineConfig(model_name="bench", block_size=executor.block_size, **config))


def run_to_completion(engine: Engine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def step_until_all_decode(engine: Engine, num_seqs: int) -> None:
    """Step until every one of num_seqs requests has its prompt computed and samples each step."""
    while len(engine.step()) < num_seqs or engine.stats().num_waiting:
        pass


def rss_bytes() -> int:
    """This process's resident set size, from /proc/self/status (VmRSS, in kB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---- continuous batching ------------------------------------------------------------------------


def bench_continuous_batching(executor: TorchExecutor, num_requests: int, prompt_tokens: int,
                              output_tokens: int) -> dict:
    """Output tokens/s with every request submitted at once vs the same requests one at a time."""
    rng = random.Random(1)
    vocab = executor.config.vocab_size
    prompts = [random_tokens(rng, prompt_tokens, vocab) for _ in range(num_requests)]
    params = greedy(output_tokens)
    run_to_completion(_with_requests(make_engine(executor), [prompts[0]], greedy(4)))  # warm-up

    engine = make_engine(executor, enable_prefix_caching=False, max_num_seqs=num_requests)
    start, start_cpu = time.perf_counter(), time.process_time()
    batched = run_to_completion(_with_requests(engine, prompts, params))
    batched_s, batched_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu

    sequential: dict[str, RequestOutput] = {}
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine = make_engine(executor, enable_prefix_caching=False)
        sequential.update({f"r{i}": out for out in run_to_completion(_with_requests(engine, [prompt], params,
                                                                                     first_id=i)).values()})
    sequential_s, sequential_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu

    total_tokens = num_requests * output_tokens
    same = sum(batched[rid].output_token_ids == sequential[rid].output_token_ids for rid in batched)
    return {
        "num_requests": num_requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "batched_s": batched_s, "sequential_s": sequential_s,
        "batched_tokens_per_s": total_tokens / batched_s, "sequential_tokens_per_s": total_tokens / sequential_s,
        "batching_speedup": sequential_s / batched_s,
        # CPU seconds of this process: less sensitive than wall time to other load on a shared machine.
        "batched_cpu_s": batched_cpu_s, "sequential_cpu_s": sequential_cpu_s,
        "batching_speedup_cpu_time": sequential_cpu_s / batched_cpu_s,
        "load_average_1m_after": os.getloadavg()[0],
        "identical_outputs": f"{same}/{num_requests}",
    }


def _with_requests(engine: Engine, prompts: list[list[int]], params: SamplingParams, first_id: int = 0) -> Engine:
    for i, prompt in enumerate(prompts, start=first_id):
        engine.add_request(f"r{i}", prompt, params)
    return engine


# ---- prefix caching -----------------------------------------------------------------------------


def time_to_first_token(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, RequestOutput]:
    """Seconds of step() calls until the engine produces request_id's first token (run alone)."""
    engine.add_request(request_id, prompt, greedy(1))
    start = time.perf_counter()
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                return time.perf_counter() - start, out


def bench_prefix_cache(executor: TorchExecutor, repeats: int, prompt_tokens: int = 1024,
                       cached_tokens: int = 960) -> dict:
    """TTFT of a prompt whose first cached_tokens are in the prefix cache vs the same prompt cold."""
    rng = random.Random(2)
    vocab = executor.config.vocab_size
    tail_tokens = prompt_tokens - cached_tokens
    time_to_first_token(make_engine(executor), "warm-up", random_tokens(rng, prompt_tokens, vocab))
    cold, warm, hits = [], [], []
    for r in range(repeats):
        prefix = random_tokens(rng, cached_tokens, vocab)
        prompt = prefix + random_tokens(rng, tail_tokens, vocab)
        cold.append(time_to_first_token(make_engine(executor), "cold", prompt)[0])
        engine = make_engine(executor)
        run_to_completion(_with_requests(engine, [prefix + random_tokens(rng, tail_tokens, vocab)], greedy(1)))
        ttft_s, out = time_to_first_token(engine, "warm", prompt)
        warm.append(ttft_s)
        hits.append(out.num_cached_tokens)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {
        "prompt_tokens": prompt_tokens, "shared_prefix_tokens": cached_tokens, "block_size": executor.block_size,
        "repeats": repeats, "num_cached_tokens": hits, "cold_ttft_ms": cold_s * 1e3, "warm_ttft_ms": warm_s * 1e3,
        "prefix_ttft_ratio": warm_s / cold_s,
    }


# ---- scheduler + block manager overhead ---------------------------------------------------------


class NullExecutor:
    """Benchmark-only executor without model math: each sampling chunk gets a token at once.

    The token depends on the sequence and position, so block keys (and prefix-cache work) stay
    as varied as with a real model.
    """

    name = "null"

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int, vocab_size: int = 49152) -> None:
        self.block_size, self.num_blocks, self.max_model_len = block_size, num_blocks, max_model_len
        self.vocab_size = vocab_size

    def execute(self, batch: StepBatch) -> list[int]:
        return [(c.seq_id * 7919 + c.start_pos * 31) % self.vocab_size
                for c in batch.chunks if c.sampling is not None]


def bench_step_overhead(num_seqs: int, num_steps: int, prompt_tokens: int = 512, shared_tokens: int = 256) -> dict:
    """step() time with num_seqs decoding sequences over the null executor (no tokenizer)."""
    rng = random.Random(3)
    max_model_len = prompt_tokens + num_steps + 64
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    executor = NullExecutor(BLOCK_SIZE, num_seqs * blocks_per_seq + 64, max_model_len)
    engine = make_engine(executor, max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * prompt_tokens)
    shared = random_tokens(rng, shared_tokens, executor.vocab_size)
    prompts = [shared + random_tokens(rng, prompt_tokens - shared_tokens, executor.vocab_size) for _ in range(num_seqs)]
    _with_requests(engine, prompts, greedy(num_steps + 8))
    step_until_all_decode(engine, num_seqs)
    step_s = []
    for _ in range(num_steps):
        start = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - start)
        if len(outputs) != num_seqs:
            raise RuntimeError(f"expected {num_seqs} decodes per step, got {len(outputs)}")
    return {
        "num_running_seqs": num_seqs, "num_steps": num_steps, "prompt_tokens": prompt_tokens,
        "step_overhead_mean_ms": statistics.fmean(step_s) * 1e3,
        "step_overhead_p50_ms": percentile(step_s, 0.5) * 1e3, "step_overhead_p99_ms": percentile(step_s, 0.99) * 1e3,
    }


# ---- KV memory ----------------------------------------------------------------------------------


def bench_kv_memory(executor: TorchExecutor, num_requests: int, warmup_requests: int, concurrency: int = 32,
                    num_blocks: int = 128, num_samples: int = 20) -> dict:
    """RSS across num_requests short requests (torch executor), sampled after warm-up.

    num_blocks is far below what the requests need in total, so blocks are reused and cached
    prefixes evicted all through the run; the KV tensors were allocated when the executor started.
    """
    rng = random.Random(4)
    vocab = executor.config.vocab_size
    system_prompts = [random_tokens(rng, 2 * BLOCK_SIZE, vocab) for _ in range(4)]
    engine = make_engine(executor, num_blocks=num_blocks, max_num_seqs=concurrency)
    sample_every = max(1, (num_requests - warmup_requests) // num_samples)
    submitted = finished = 0
    samples: list[int] = []
    start = time.perf_counter()
    while finished < num_requests:
        while submitted < num_requests and submitted - finished < concurrency:
            engine.add_request(f"r{submitted}", _short_prompt(rng, system_prompts, vocab), greedy(rng.randint(1, 4)))
            submitted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                if finished >= warmup_requests and (finished - warmup_requests) % sample_every == 0:
                    samples.append(rss_bytes())
    mib = 2**20
    return {
        "num_requests": num_requests, "warmup_requests": warmup_requests, "concurrency": concurrency,
        "num_blocks": num_blocks, "elapsed_s": time.perf_counter() - start,
        "kv_cache_bytes": executor.kv_cache.spec.bytes_per_block * (executor.num_blocks + 1),
        "rss_first_mib": samples[0] / mib, "rss_last_mib": samples[-1] / mib, "rss_max_mib": max(samples) / mib,
        "rss_growth_ratio": max(samples) / samples[0], "num_rss_samples": len(samples),
        "prefix_cache_hit_rate": _hit_rate(engine),
    }


def _short_prompt(rng: random.Random, system_prompts: list[list[int]], vocab: int) -> list[int]:
    """4-24 fresh tokens, half of them after one of a few shared 32-token system prompts."""
    tail = random_tokens(rng, rng.randint(4, 24), vocab)
    return rng.choice(system_prompts) + tail if rng.random() < 0.5 else tail


def _hit_rate(engine: Engine) -> float:
    stats = engine.stats()
    return stats.prefix_cache_hits_tokens / max(1, stats.prefix_cache_queries_tokens)


# ---- GPU decode bandwidth -----------------------------------------------------------------------


class TimedExecutor:
    """Wraps an executor; records each execute()'s seconds and the KV tokens it attended."""

    def __init__(self, inner: TorchExecutor) -> None:
        self.inner = inner
        self.name, self.block_size = inner.name, inner.block_size
        self.num_blocks, self.max_model_len = inner.num_blocks, inner.max_model_len
        self.steps: list[tuple[float, int]] = []

    def execute(self, batch: StepBatch) -> list[int]:
        start = time.perf_counter()
        tokens = self.inner.execute(batch)  # returns Python ints: the device has finished
        context_tokens = sum(c.start_pos + len(c.token_ids) for c in batch.chunks)
        self.steps.append((time.perf_counter() - start, context_tokens))
        return tokens


def peak_bandwidth_bytes_s(gpu_name: str) -> float | None:
    configured = os.environ.get(PEAK_BANDWIDTH_ENV)
    if configured:
        return float(configured)
    return next((peak for name, peak in PEAK_BANDWIDTH_BY_GPU if name in gpu_name), None)


def bench_gpu_bandwidth(model_dir: Path, batch_sizes: tuple[int, ...] = (1, 64), context_tokens: int = 1024,
                        decode_steps: int = 64) -> dict:
    """Decode model-bandwidth utilisation: (weights + KV read) bytes per step / step time / peak (bf16)."""
    gpu = gpu_description()
    if gpu is None:
        return {"skipped": "no NVIDIA GPU (nvidia-smi not found)"}
    max_len = context_tokens + decode_steps + 16
    num_blocks = max(batch_sizes) * -(-max_len // BLOCK_SIZE) + 16
    try:
        inner = TorchExecutor.from_pretrained(model_dir, device="cuda", dtype="bfloat16", block_size=BLOCK_SIZE,
                                              num_blocks=num_blocks)
    except (RuntimeError, AssertionError) as exc:  # torch without CUDA raises AssertionError
        return {"skipped": f"CUDA executor unavailable: {exc}"}
    gpu_name = gpu.split(",")[0].strip()
    peak = peak_bandwidth_bytes_s(gpu_name)
    weight_bytes = sum(p.numel() * p.element_size() for p in inner.model.parameters())
    kv_bytes_per_token = inner.kv_cache.spec.bytes_per_block // BLOCK_SIZE
    result = {"gpu": gpu, "dtype": "bfloat16", "peak_bytes_per_s": peak, "weight_bytes": weight_bytes,
              "kv_bytes_per_token": kv_bytes_per_token, "context_tokens": context_tokens, "batches": {}}
    for batch_size in batch_sizes:
        result["batches"][str(batch_size)] = _decode_bandwidth(
            TimedExecutor(inner), batch_size, context_tokens, decode_steps, weight_bytes, kv_bytes_per_token, peak)
    return result


def _decode_bandwidth(executor: TimedExecutor, batch_size: int, context_tokens: int, decode_steps: int,
                      weight_bytes: int, kv_bytes_per_token: int, peak: float | None) -> dict:
    rng = random.Random(5)
    vocab = executor.inner.config.vocab_size
    engine = make_engine(executor, max_num_seqs=batch_size, enable_prefix_caching=False,
                         max_num_batched_tokens=max(2048, context_tokens))
    warmup_steps = 8  # CUDA-graph capture and Triton compilation happen here
    prompts = [random_tokens(rng, context_tokens, vocab) for _ in range(batch_size)]
    _with_requests(engine, prompts, greedy(warmup_steps + decode_steps + 1))
    step_until_all_decode(engine, batch_size)
    for _ in range(warmup_steps):
        engine.step()
    executor.steps.clear()
    step_s = []
    for _ in range(decode_steps):
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    execute_s = statistics.median(s for s, _ in executor.steps)
    kv_bytes = statistics.median(n for _, n in executor.steps) * kv_bytes_per_token
    bytes_per_step = weight_bytes + kv_bytes
    return {
        "execute_ms": execute_s * 1e3, "engine_step_ms": statistics.median(step_s) * 1e3,
        "bytes_per_step": bytes_per_step, "achieved_bytes_per_s": bytes_per_step / execute_s,
        "mbu": None if peak is None else bytes_per_step / execute_s / peak,
        "mbu_engine_step": None if peak is None else bytes_per_step / statistics.median(step_s) / peak,
    }


# ---- report -------------------------------------------------------------------------------------


def verdict(key: str, value: float) -> str:
    op, target = TARGETS[key]
    ok = value >= target if op == ">=" else value <= target
    return "pass" if ok else "FAIL"


def engine_markdown(result: dict) -> str:
    rows = []
    batching, prefix = result.get("continuous_batching"), result.get("prefix_cache")
    overhead, memory = result.get("step_overhead"), result.get("kv_memory")
    if batching:
        rows.append((f"continuous batching: output tokens/s, {batching['num_requests']} concurrent vs one at a time "
                     f"({batching['prompt_tokens']}-token prompts, {batching['output_tokens']} output tokens)",
                     f"{batching['batched_tokens_per_s']:.1f} vs {batching['sequential_tokens_per_s']:.1f} tok/s = "
                     f"**{batching['batching_speedup']:.1f}x** (CPU-time ratio "
                     f"{batching['batching_speedup_cpu_time']:.1f}x)", "batching_speedup", batching["batching_speedup"]))
    if prefix:
        rows.append((f"prefix caching: TTFT of a {prefix['prompt_tokens']}-token prompt with "
                     f"{prefix['shared_prefix_tokens']} tokens cached vs cold (block {prefix['block_size']}, "
                     f"median of {prefix['repeats']})",
                     f"{prefix['warm_ttft_ms']:.0f} vs {prefix['cold_ttft_ms']:.0f} ms = "
                     f"**{prefix['prefix_ttft_ratio']:.3f}x** (cached tokens {prefix['num_cached_tokens'][0]})",
                     "prefix_ttft_ratio", prefix["prefix_ttft_ratio"]))
    if overhead:
        rows.append((f"scheduler + block manager per step, {overhead['num_running_seqs']} running sequences, "
                     f"null executor, {overhead['num_steps']} steps",
                     f"mean **{overhead['step_overhead_mean_ms']:.3f} ms**, p50 {overhead['step_overhead_p50_ms']:.3f}"
                     f", p99 {overhead['step_overhead_p99_ms']:.3f} ms", "step_overhead_mean_ms",
                     overhead["step_overhead_mean_ms"]))
    if memory:
        rows.append((f"RSS across {memory['num_requests']} requests after {memory['warmup_requests']} warm-up "
                     f"(torch executor, {memory['num_blocks']} KV blocks, {memory['num_rss_samples']} samples)",
                     f"first {memory['rss_first_mib']:.1f}, last {memory['rss_last_mib']:.1f}, max "
                     f"{memory['rss_max_mib']:.1f} MiB: max/first **{memory['rss_growth_ratio']:.4f}**",
                     "rss_growth_ratio", memory["rss_growth_ratio"]))
    table = ["| figure | measured | target | result |", "|---|---|---|---|"]
    for label, measured, key, value in rows:
        op, target = TARGETS[key]
        table.append(f"| {label} | {measured} | {op} {target:g} | {verdict(key, value)} |")
    return "\n".join([_header(result, "Engine (CPU, torch executor, fp32)"), "", *table, _gpu_note(result)])


def _header(result: dict, title: str) -> str:
    return "\n".join([
        f"### {title}", "",
        f"- Command: `{result['command']}`",
        f"- Machine: {result['machine']} (shared; 1-minute load average {result['load_average_1m']:.1f} at "
        f"start, {os.getloadavg()[0]:.1f} at the end)",
        f"- Date: {result['date']}",
        f"- Model: {result['model']}",
        f"- Results JSON: `results/bench_engine.json`",
    ])


def _gpu_note(result: dict) -> str:
    gpu = result.get("gpu_bandwidth")
    if gpu is None:
        return ""
    if "skipped" in gpu:
        return f"\nGPU decode bandwidth: skipped ({gpu['skipped']})."
    return "\nGPU decode bandwidth: see the `engine-gpu` section."


def gpu_markdown(result: dict) -> str:
    gpu = result["gpu_bandwidth"]
    table = ["| decode batch | execute ms (median) | engine step ms | bytes / step | achieved | MBU |",
             "|---|---|---|---|---|---|"]
    for batch_size, row in gpu["batches"].items():
        mbu = "n/a (unknown peak)" if row["mbu"] is None else f"**{row['mbu']:.1%}**"
        table.append(f"| {batch_size} | {row['execute_ms']:.2f} | {row['engine_step_ms']:.2f} | "
                     f"{row['bytes_per_step'] / 1e6:.1f} MB | {row['achieved_bytes_per_s'] / 1e9:.0f} GB/s | {mbu} |")
    peak = "unknown" if gpu["peak_bytes_per_s"] is None else f"{gpu['peak_bytes_per_s'] / 1e12:.2f} TB/s"
    notes = (f"\nbf16; {gpu['context_tokens']}-token context per sequence; bytes = weights "
             f"({gpu['weight_bytes'] / 1e6:.0f} MB) + KV of every context token ({gpu['kv_bytes_per_token']} B/token); "
             f"peak {peak} (table by GPU name, or ${PEAK_BANDWIDTH_ENV}). MBU uses the executor's time (CUDA-graph "
             "decode + sampling); the engine step adds scheduling. No target: reported for reference.")
    return "\n".join([_header(result, f"Engine decode bandwidth (GPU: {gpu['gpu']})"), "", *table, notes])


# ---- main ---------------------------------------------------------------------------------------

BENCHMARKS = ("batching", "prefix", "overhead", "memory", "gpu")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke test, not for the docs)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these parts")
    parser.add_argument("--model", default="default", help="model folder, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    only = set(args.only or BENCHMARKS)
    model_dir = resolve_model_path(args.model)
    quick = args.quick
    result: dict = {
        "command": bench_command("engine", argv),
        "machine": machine_description(), "load_average_1m": os.getloadavg()[0],
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": DEFAULT_SERVED_MODEL_NAME if args.model == "default" else str(model_dir),
    }
    parts: list[tuple[str, str, Callable[[], dict]]] = []
    executor = None
    if only & {"batching", "prefix", "memory"}:
        executor = TorchExecutor.from_pretrained(model_dir, block_size=BLOCK_SIZE, num_blocks=CPU_NUM_BLOCKS)
    parts.append(("batching", "continuous_batching",
                  lambda: bench_continuous_batching(executor, 8 if quick else 32, 64, 16 if quick else 64)))
    parts.append(("prefix", "prefix_cache", lambda: bench_prefix_cache(executor, 1 if quick else 3)))
    parts.append(("overhead", "step_overhead", lambda: bench_step_overhead(64, 300 if quick else 2000)))
    parts.append(("memory", "kv_memory",
                  lambda: bench_kv_memory(executor, 300 if quick else 2000, 100 if quick else 300)))
    parts.append(("gpu", "gpu_bandwidth", lambda: bench_gpu_bandwidth(model_dir, decode_steps=16 if quick else 64)))
    for name, key, bench in parts:
        if name in only:
            start = time.perf_counter()
            result[key] = bench()
            print(f"{name}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run(args, argv)
    text = json.dumps(result, indent=2)
    print(text)
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        if any(k in result for k in ("continuous_batching", "prefix_cache", "step_overhead", "kv_memory")):
            replace_section("engine", engine_markdown(result))
        if "skipped" not in result.get("gpu_bandwidth", {"skipped": ""}):
            replace_section("engine-gpu", gpu_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
