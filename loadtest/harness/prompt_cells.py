"""Real prompts through gateways on a `sim` worker that publishes KV events: SmolLM2's tokenizer and chat
template, prompts that share a context or a system prompt (or nothing), streamed answers of a few tokens,
and the gateway process's CPU time over a cell of them. The cells the prompt-cpu and stream-pace benchmarks
and the instruction counter measure.

One worker (`kvgate worker --model default --executor sim`) on the CPUs beside the gateways'; each tree's
gateway (harness/side_by_side.py) in front of it, kv_aware, `tokenizer: default`, no request log lines."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from loadtest.engines import DEFAULT_SERVED_MODEL_NAME
from loadtest.harness import side_by_side
from loadtest.harness.gateway import cpu_placement
from loadtest.paths import ROOT
from loadtest.procs import ChildProcess, free_port, tree_cpu_s

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

# the cell a live engine's pace is measured on (stream-pace, instructions --paced), at two answer lengths
CELL = "completions, ~600-token shared context"

SHORT, LONG = 16, 64  # output tokens of the two cells
