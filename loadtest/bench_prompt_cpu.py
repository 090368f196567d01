"""The gateway's CPU per request on real prompts: tokenized with the served model's tokenizer (SmolLM2's),
keyed, routed, streamed from a worker that publishes KV events, beside another commit's gateway in the
same run. The proxy benchmarks send a tiny prompt to a fixed-response upstream with `tokenizer: null`;
here the prompt is long and shares its start with the prompts before it, as a RAG context, an agent's
instructions or a chat's system prompt does, and the answer comes a token at a time.

One `sim` worker (`kvgate worker --model default --executor sim`: SmolLM2-135M-Instruct's tokenizer and
chat template, a timing model for the engine, KV events on) serves both gateways (`python -m kvgate
gateway`, one process each, kv_aware, `tokenizer: default`, no request log lines), started at once on a
CPU of their own, idle while the other is measured; the worker and this client (httpx, one connection,
streamed requests of 16 tokens, one after another) run on the other CPU. Cells: completions prompts that
share a context of ~600 or ~6,000 tokens and end in a question of their own; chats that share a
~2,000-token system prompt; and completions prompts of ~600 tokens that share nothing (where a prefix
cache can only cost). The gateways take turns cell by cell, --rounds times; figures are the medians of
the gateway process's CPU time a request.
Writes results/bench_prompt_cpu.json and the "prompt-cpu" section of docs/benchmarks.md.
Run: .venv/bin/python -m loadtest.bench_prompt_cpu --baseline REV [--rounds 2] [--no-doc] [--doc-only]
(needs the default model: `make model`)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from loadtest import side_by_side
from loadtest.bench_gateway import API_KEY, cpu_placement
from loadtest.benchdoc import machine_description, replace_section
from loadtest.engines import DEFAULT_SERVED_MODEL_NAME
from loadtest.procs import ChildProcess, free_port, tree_cpu_s

SECTION = "prompt-cpu"
ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "results" / "bench_prompt_cpu.json"
REQUESTS_PER_CELL = 150  # ~0.5 s of the gateway's CPU a cell: 10 ms clock ticks are ~2% of it
OUTPUT_TOKENS = 16
WORDS = ("the of and to in is was for on that with as by at from his her an were are which cache router "
         "gateway prefix block worker token stream answer question context system prompt").split()
# name -> (kind, shared words, own words): ~1.1 tokens a word in SmolLM2's tokenizer
CELLS: dict[str, tuple[str, int, int]] = {
    "completions, ~600-token shared context": ("completion", 550, 40),
    "completions, ~6,000-token shared context": ("completion", 5500, 40),
    "chat, ~2,000-token shared system prompt": ("chat", 1800, 40),
    "completions, ~600 tokens, nothing shared": ("completion", 0, 590),
}


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def request_bodies(kind: str, shared_words: int, own_words: int, seed: int, output_tokens: int = OUTPUT_TOKENS,
                   requests: int = REQUESTS_PER_CELL) -> list[dict[str, Any]]:
    """requests + 1 streamed requests of output_tokens (the first warms the caches), all starting with one
    shared text of shared_words, each ending in own_words of its own."""
    rng = random.Random(seed)
    shared = words(rng, shared_words)
    bodies = []
    for i in range(requests + 1):
        own = f"Question {i}: {words(rng, own_words)}"
        body: dict[str, Any] = {"model": DEFAULT_SERVED_MODEL_NAME, "max_tokens": output_tokens, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}
        if kind == "chat":
            body["messages"] = [{"role": "system", "content": shared}, {"role": "user", "content": own}]
        else:
            body["prompt"] = f"{shared}\n{own}" if shared else own
        bodies.append(body)
    return bodies


def send(client: httpx.Client, body: dict[str, Any]) -> int:
    """One streamed request to its end; the completion tokens its usage counts."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    usage = None
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                usage = json.loads(line[6:]).get("usage") or usage
    return int((usage or {}).get("completion_tokens") or 0)


def measure_cell(client: httpx.Client, pid: int, name: str, seed: int, output_tokens: int = OUTPUT_TOKENS,
                 requests: int = REQUESTS_PER_CELL) -> dict[str, Any]:
    """The CPU time of pid (and its children) over one cell of CELLS sent through client."""
    kind, shared_words, own_words = CELLS[name]
    first, *bodies = request_bodies(kind, shared_words, own_words, seed, output_tokens, requests)
    send(client, first)
    cpu_before, started = tree_cpu_s([pid]), time.perf_counter()
    for body in bodies:
        if send(client, body) != output_tokens:
            raise RuntimeError(f"{name}: an answer of other than {output_tokens} tokens")
    cpu_s = tree_cpu_s([pid]) - cpu_before
    return {"cell": name, "requests": len(bodies), "cpu_s": cpu_s, "wall_s": time.perf_counter() - started,
            "cpu_ms_per_request": cpu_s * 1000 / len(bodies)}


def start_worker(tmp_dir: Path, cpus: set[int] | None) -> tuple[ChildProcess, int, int]:
    port, kv_port = free_port(), free_port()
    worker = ChildProcess("worker", [sys.executable, "-m", "kvgate", "worker", "--model", "default", "--executor", "sim",
                                     "--port", str(port), "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}",
                                     "--worker-id", "w0"],
                          tmp_dir / "worker.log", f"http://127.0.0.1:{port}/health", env={"PYTHONPATH": str(ROOT)},
                          cpus=cpus)
    worker.wait_healthy(300)
    return worker, port, kv_port


def start_worker_and_gateways(stack: ExitStack, tmp_dir: Path, trees: dict[str, Path]
                              ) -> tuple[int, dict[str, tuple[int, int]]]:
    """The worker, on the CPUs beside the gateways' (this process, the client, moves there too), and each
    tree's gateway in front of it (side_by_side.start_gateway); all stopped with stack. (The worker's port,
    {tree's name: (its gateway's pid, port)})."""
    other_cpus = cpu_placement()[1]
    worker, worker_port, kv_port = start_worker(tmp_dir, other_cpus)
    stack.callback(worker.stop)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)  # the client beside the worker, off the gateways' CPU
    gateways = {}
    for name, tree in trees.items():
        gateway, port = side_by_side.start_gateway(
            tree, lambda port: gateway_config(port, worker_port, kv_port), tmp_dir, name.split(" ")[0])
        stack.callback(gateway.stop, 30)
        gateways[name] = (gateway.popen.pid, port)
    return worker_port, gateways


def gateway_config(port: int, worker_port: int, kv_port: int) -> dict[str, Any]:
    """One pool of the one worker, with SmolLM2's tokenizer and the worker's KV events; no request log lines."""
    pool = {"model": DEFAULT_SERVED_MODEL_NAME, "tokenizer": "default", "policy": {"type": "kv_aware"},
            "workers": [{"name": "w0", "url": f"http://127.0.0.1:{worker_port}",
                         "kv_events_endpoint": f"tcp://127.0.0.1:{kv_port}"}]}
    return {"gateway": {"host": "127.0.0.1", "port": port}, "pools": {"default": pool}, "logging": {"requests": False}}


def measure(gateways: dict[str, tuple[int, int]], rounds: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Every cell through every gateway (name -> (pid, port)), their order alternating from cell to cell;
    per gateway and cell, the runs and the median CPU a request. Each round's prompts are new (its own seed)."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {cell: [] for cell in CELLS} for name in gateways}
    clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                                  timeout=300) for name, (_pid, port) in gateways.items()}
    try:
        turn = 0
        for round_index in range(rounds):
            for cell_index, cell in enumerate(CELLS):
                names = list(gateways) if turn % 2 == 0 else list(gateways)[::-1]
                turn += 1
                for gateway_index, name in enumerate(names):
                    seed = 1000 * round_index + 10 * cell_index + gateway_index
                    run = measure_cell(clients[name], gateways[name][0], cell, seed)
                    runs[name][cell].append(run)
                    print(f"{name}: {cell}: {run['cpu_ms_per_request']:.2f} ms a request", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            client.close()
    return {name: {cell: {"cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in cell_runs),
                          "rounds_cpu_ms_per_request": [r["cpu_ms_per_request"] for r in cell_runs]}
                   for cell, cell_runs in tree_runs.items()}
            for name, tree_runs in runs.items()}


def markdown(result: dict[str, Any]) -> str:
    names = list(result["trees"])
    header = " | ".join(f"{name}: CPU ms a request (rounds)" for name in names)
    rows = []
    for cell in CELLS:
        figures = [result["trees"][name][cell] for name in names]
        cells = " | ".join(f"{f['cpu_ms_per_request']:.2f} ({' / '.join(f'{x:.2f}' for x in f['rounds_cpu_ms_per_request'])})"
                           for f in figures)
        ratio = (f" | {figures[-1]['cpu_ms_per_request'] / figures[0]['cpu_ms_per_request']:.2f}x"
                 if len(figures) > 1 else "")
        rows.append(f"| {cell} | {cells}{ratio} |")
    ratio_header = f" | this checkout / {names[0]}" if len(names) > 1 else ""
    return f"""## The gateway's CPU per request on real prompts

Command: `{result["command"]}`
Machine: {result["machine"]} (shared with other work; figures from one run)
Date: {result["date"]}

One `sim` worker (SmolLM2-135M-Instruct's tokenizer and chat template, a timing model for the engine, KV
events on) serves the gateways (one process each, kv_aware, `tokenizer: default`, no request log lines),
which run on a CPU of their own and take turns cell by cell; the worker and the client (one connection,
streamed requests of {OUTPUT_TOKENS} tokens one after another) share the other. Each cell's
{REQUESTS_PER_CELL} prompts start with one shared text (new each round) and end in a question of their own;
the last cell's share nothing. CPU = the gateway process's CPU time over the cell, a request: the median
of {result["rounds"]} rounds (each round's figure in brackets).

| prompts | {header}{ratio_header} |
|---|{"---|" * (len(names) + (1 if len(names) > 1 else 0))}
{chr(10).join(rows)}

Raw figures: `results/bench_prompt_cpu.json`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_arguments(parser, RESULTS_PATH)
    args = parser.parse_args()
    if args.doc_only:
        return replace_section(SECTION, markdown(json.loads(RESULTS_PATH.read_text())))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-prompt-cpu-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        trees = side_by_side.compared_trees(args.baseline, tmp_dir)
        _worker_port, gateways = start_worker_and_gateways(stack, tmp_dir, trees)
        trees_figures = measure(gateways, args.rounds)
    result = {"benchmark": SECTION, "baseline": args.baseline,
              "command": side_by_side.command("loadtest.bench_prompt_cpu", args),
              "rounds": args.rounds,
              "machine": machine_description(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": sys.version.split()[0], "trees": trees_figures, "wall_s": round(time.perf_counter() - started)}
    RESULTS_PATH.parent.mkdir(exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(trees_figures, indent=2))


if __name__ == "__main__":
    main()
