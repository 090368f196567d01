"""Long answers: the gateway's CPU per token as one answer grows from 1,000 to 32,000 tokens, and per
byte as one event grows from 1 to 16 MiB. A cost that grows with the answer (a string or list copied at
each chunk) stalls the event loop for every other request on it, and shows here as a per-token cost that
rises with the answer's length.

A fixed-answer worker (raw ASGI on uvicorn, in its own process) streams a chat answer of `max_tokens`
chunks at once, in 64 KiB writes: each chunk one token of text ("text"), or with its logprobs
("logprobs"), or a piece of a tool call's arguments ("tool call"); every chunk carries its token id, as
vLLM's do when the gateway asks for them. With `bench_event_bytes` it sends instead one tool-call chunk
whose arguments are that many bytes. The gateway (`python -m kvgate gateway`, one process, kv_aware,
`tokenizer: null`) runs on a CPU of its own; the worker and this client (httpx, one connection,
sequential requests) on the others. Each cell sends requests until it has TOKENS_PER_CELL tokens (or
BYTES_PER_CELL bytes), so every cell measures about as much work; figures are the gateway process's CPU
time over the cell. Streamed ("stream") and collected (a non-streaming client, the answer assembled by the
gateway: "collect") both run. With --baseline REV, REV's gateway (git archive, its C extensions built)
runs beside this checkout's (both started at once, on the same CPU, idle while the other is measured),
the two taking turns cell by cell. Every cell runs --rounds times; figures are the medians.
Writes results/bench_long_answers.json and the "long-answers" section of docs/benchmarks.md.
Run: kvgate bench long-answers [--baseline REV] [--rounds 2] [--no-doc] [--doc-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from loadtest.benchdoc import machine_description, replace_section, save_result
from loadtest.harness import side_by_side
from loadtest.harness.fake_worker import fake_worker_request
from loadtest.harness.gateway import API_KEY, MODEL, cpu_placement, gateway_config
from loadtest.paths import RESULTS_DIR, ROOT
from loadtest.procs import ChildProcess, free_port, process_cpu_s

SECTION = "long-answers"
RESULTS_PATH = RESULTS_DIR / "bench_long_answers.json"
SIZES = (1000, 8000, 32000)  # tokens an answer
TOKENS_PER_CELL = 128_000
EVENT_SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes of one tool-call event's arguments
BYTES_PER_CELL = 128 << 20
MODES = ("stream", "collect")
TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}
VARIANTS: dict[str, dict[str, Any]] = {"text": {}, "logprobs": {"logprobs": True, "top_logprobs": 1},
                                       "tool call": {"tools": [TOOL]}}
# CPU per token at 32,000 tokens / at 1,000 (per byte at 16 MiB / at 1 MiB for one event), at most. Work that
# grows with the answer (a list or string copied at each chunk) reads ~3x (one event) to 7-11x (logprobs) here
# (7635707, before the fix);
# for tokens the bound leaves room for the interpreter's collector, which walks an assembled answer's objects
# (logprobs: ~5 objects a token) more often as they grow; one event is one string, with nothing of the kind.
TARGET_GROWTH = {"tokens": 3.0, "one event": 2.0}
WRITE_BYTES = 64 * 1024


# -- the fixed-answer worker ----------------------------------------------------------------------

def _sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n"


def answer_stream(num_tokens: int, variant: str, event_bytes: int | None = None) -> bytes:
    """The whole SSE answer: num_tokens chunks of the variant (or one tool-call chunk of event_bytes
    argument bytes), a usage chunk and [DONE]."""
    head = {"id": "chatcmpl-long", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    chunks = []
    count = 1 if event_bytes else num_tokens
    for i in range(count):
        if event_bytes or variant == "tool call":
            arguments = "x" * event_bytes if event_bytes else "abcd"
            function = {"name": TOOL["function"]["name"], "arguments": arguments} if i == 0 else {"arguments": arguments}
            call = {"index": 0, **({"id": "call_0", "type": "function"} if i == 0 else {}), "function": function}
            delta: dict[str, Any] = {"tool_calls": [call]}
        else:
            delta = {"content": "tok "}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "token_ids": [i % 50_000],
                                  "finish_reason": ("tool_calls" if "tool_calls" in delta else "length") if i == count - 1 else None}
        if variant == "logprobs":
            choice["logprobs"] = {"content": [{"token": "tok", "logprob": -0.25, "bytes": [116, 111, 107],
                                               "top_logprobs": [{"token": "tok", "logprob": -0.25, "bytes": [116, 111, 107]}]}]}
        chunks.append(_sse({**head, "choices": [choice]}))
    usage = {"prompt_tokens": 12, "completion_tokens": count, "total_tokens": 12 + count}
    return ("".join(chunks) + _sse({**head, "choices": [], "usage": usage}) + "data: [DONE]\n\n").encode()


_ANSWERS: dict[tuple[int, str, int | None], bytes] = {}


async def long_answer_worker(scope, receive, send) -> None:
    request = await fake_worker_request(scope, receive, send)
    if request is None:
        return
    variant = "logprobs" if request.get("logprobs") else "tool call" if request.get("tools") else "text"
    key = (int(request.get("max_tokens") or 1), variant, request.get("bench_event_bytes"))
    if key not in _ANSWERS:
        _ANSWERS[key] = answer_stream(*key)
    answer = _ANSWERS[key]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for start in range(0, len(answer), WRITE_BYTES):
        await send({"type": "http.response.body", "body": answer[start:start + WRITE_BYTES], "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def run_worker(port: int) -> None:
    import uvicorn

    uvicorn.run(long_answer_worker, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")


# -- the run --------------------------------------------------------------------------------------

def request_body(mode: str, variant: str, num_tokens: int, event_bytes: int | None = None) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write it all out."}], "max_tokens": num_tokens,
            "stream": mode == "stream", **VARIANTS[variant]}
    if event_bytes:
        body["bench_event_bytes"] = event_bytes
    return body


def answered_tokens(response: httpx.Response, mode: str, variant: str) -> int:
    """The completion tokens the client got (from the usage the answer carries); raises if it is not whole."""
    if response.status_code != 200:
        raise RuntimeError(f"{variant} {mode}: {response.status_code} {response.text[:300]}")
    if mode == "collect":
        return response.json()["usage"]["completion_tokens"]
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    if events[-1] != "[DONE]":
        raise RuntimeError(f"{variant} {mode}: the stream did not end with [DONE]")
    return json.loads(events[-2])["usage"]["completion_tokens"]


def measure_cell(client: httpx.Client, pid: int, mode: str, variant: str, num_tokens: int,
                 event_bytes: int | None = None) -> dict[str, Any]:
    """Requests of one kind until the cell's tokens (bytes) are sent; the gateway's CPU over them."""
    body = request_body(mode, variant, num_tokens, event_bytes)
    stream = {"stream_options": {"include_usage": True}} if mode == "stream" else {}
    answered_tokens(client.post("/v1/chat/completions", json={**body, **stream}), mode, variant)  # warm the worker's cache
    requests = max(1, (BYTES_PER_CELL // event_bytes) if event_bytes else TOKENS_PER_CELL // num_tokens)
    cpu_before, started = process_cpu_s(pid), time.perf_counter()
    for _ in range(requests):
        tokens = answered_tokens(client.post("/v1/chat/completions", json={**body, **stream}), mode, variant)
        if tokens != (1 if event_bytes else num_tokens):
            raise RuntimeError(f"{variant} {mode}: {tokens} tokens answered, {num_tokens} expected")
    cpu_s = process_cpu_s(pid) - cpu_before
    units = requests * (event_bytes or num_tokens)
    return {"mode": mode, "variant": "one event" if event_bytes else variant, "size": event_bytes or num_tokens,
            "requests": requests, "cpu_s": cpu_s, "wall_s": time.perf_counter() - started,
            "cpu_us_per_unit": cpu_s * 1e6 / units}


def cells() -> list[tuple[str, str, int, int | None]]:
    """(mode, variant, tokens, event bytes) of every cell, in the order they run."""
    out: list[tuple[str, str, int, int | None]] = []
    for mode in MODES:
        out += [(mode, variant, size, None) for variant in VARIANTS for size in SIZES]
        out += [(mode, "tool call", 1, event_bytes) for event_bytes in EVENT_SIZES]
    return out


def measure(gateways: dict[str, tuple[int, int]], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Every cell through every gateway (name -> (pid, port)), the gateways' order alternating from
    cell to cell, `rounds` times; per tree, each cell's runs and its median CPU a unit."""
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [[] for _ in cells()] for name in gateways}
    clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                                  timeout=600) for name, (_pid, port) in gateways.items()}
    try:
        turn = 0
        for _ in range(rounds):
            for index, (mode, variant, size, event_bytes) in enumerate(cells()):
                names = list(gateways) if turn % 2 == 0 else list(gateways)[::-1]
                turn += 1
                for name in names:
                    run = measure_cell(clients[name], gateways[name][0], mode, variant, size, event_bytes)
                    runs[name][index].append(run)
                    print(f"{name}: {_describe(run)}", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            client.close()
    return {name: [{**cell_runs[0], "cpu_us_per_unit": statistics.median(r["cpu_us_per_unit"] for r in cell_runs),
                    "rounds_cpu_us_per_unit": [r["cpu_us_per_unit"] for r in cell_runs]}
                   for cell_runs in tree_runs]
            for name, tree_runs in runs.items()}


def _describe(cell: dict[str, Any]) -> str:
    unit = "MiB event" if cell["variant"] == "one event" else "tokens"
    size = cell["size"] >> 20 if cell["variant"] == "one event" else cell["size"]
    per = "byte" if cell["variant"] == "one event" else "token"
    return (f"{cell['mode']} {cell['variant']} {size:,} {unit}: {cell['requests']} requests, "
            f"{cell['cpu_s'] * 1e3:,.0f} ms CPU, {cell['cpu_us_per_unit']:.4g} us a {per}")


def growth(cells: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{mode: {variant: CPU per unit at the largest size / at the smallest}}."""
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        for variant in [*VARIANTS, "one event"]:
            mine = sorted((c for c in cells if c["mode"] == mode and c["variant"] == variant), key=lambda c: c["size"])
            out.setdefault(mode, {})[variant] = mine[-1]["cpu_us_per_unit"] / mine[0]["cpu_us_per_unit"]
    return out


# -- the report -----------------------------------------------------------------------------------

def _size(cell: dict[str, Any]) -> str:
    return f"{cell['size'] >> 20} MiB" if cell["variant"] == "one event" else f"{cell['size']:,}"


def markdown(result: dict[str, Any]) -> str:
    trees = result["trees"]
    names = list(trees)
    header = " | ".join(f"{name}: CPU us a token (a KiB for one event)" for name in names)
    rows = []
    for index, cell in enumerate(trees[names[0]]["cells"]):
        figures = []
        for name in names:
            other = trees[name]["cells"][index]
            per = other["cpu_us_per_unit"] * (1024 if cell["variant"] == "one event" else 1)
            figures.append(f"{per:,.2f}")
        rows.append(f"| {cell['mode']} | {cell['variant']} | {_size(cell)} | {cell['requests']} | " + " | ".join(figures) + " |")
    verdict_rows = []
    mine = trees["this checkout"]["growth"]
    for mode in MODES:
        for variant, value in mine[mode].items():
            base = "" if len(names) == 1 else f" ({names[0]}: {trees[names[0]]['growth'][mode][variant]:.2f}x)"
            largest = "16 MiB / 1 MiB" if variant == "one event" else f"{SIZES[-1]:,} / {SIZES[0]:,} tokens"
            bound = TARGET_GROWTH["one event" if variant == "one event" else "tokens"]
            verdict_rows.append(f"| {mode}, {variant}: CPU a unit, {largest} | {value:.2f}x{base} | <= {bound:g}x "
                                f"| {'pass' if value <= bound else 'FAIL'} |")
    baseline = (f" Beside it, `{result['baseline']}`'s gateway (its tree from `git archive`), started at the same time on the "
                "same CPU, the two taking turns cell by cell." if result.get("baseline") else "")
    return f"""## Long answers: the gateway's CPU per token as an answer grows

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; figures from one run)
Date: {result['date']}

A fixed-answer worker streams a chat answer of 1,000 to 32,000 chunks at once (64 KiB writes), each
chunk one token of text, or text with its logprobs, or a piece of a tool call's arguments; each carries
its token id, as vLLM's chunks do when the gateway asks for them. "One event": a single tool-call chunk of
1 to 16 MiB of arguments. The gateway runs on a CPU of its own; the client sends one request at a time,
streamed ("stream": the gateway passes each chunk on) or not ("collect": the gateway assembles the answer),
until a cell holds {TOKENS_PER_CELL:,} tokens ({BYTES_PER_CELL >> 20} MiB for one event). CPU = the gateway
process's CPU time over the cell, per token (per KiB): the median of {result['rounds']} rounds.{baseline}

| mode | answer | tokens (event size) | requests | {header} |
|---|---|---|---|{'---|' * len(names)}
{chr(10).join(rows)}

| target | this checkout | target | result |
|---|---|---|---|
{chr(10).join(verdict_rows)}

A cost per token that rises with the answer's length is work that grows with the square of the answer,
done on the event loop: for a 32,000-token answer it stalls every other request on the gateway. Copying
what was kept at each chunk reads ~3x (one event) to 7-11x (logprobs) here. The bound for tokens leaves
room for the interpreter's collector, which walks an assembled answer's objects (logprobs: about five a
token) as they grow; one event is one string, with no such room.
Raw figures: `results/bench_long_answers.json`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench long-answers", description=__doc__.split("\n\n")[0])
    side_by_side.add_arguments(parser, RESULTS_PATH)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args.worker)
    if args.doc_only:
        return replace_section(SECTION, markdown(json.loads(RESULTS_PATH.read_text())))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-long-answers-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        trees = side_by_side.compared_trees(args.baseline, tmp_dir)
        worker_port = free_port()
        worker = ChildProcess("worker", [sys.executable, "-m", "loadtest.benchmarks.long_answers", "--worker", str(worker_port)],
                              tmp_dir / "worker.log", f"http://127.0.0.1:{worker_port}/health", env={"PYTHONPATH": str(ROOT)},
                              cpus=cpu_placement()[1])
        stack.callback(worker.stop)
        worker.wait_healthy(60)
        if cpu_placement()[1]:
            os.sched_setaffinity(0, cpu_placement()[1])  # the client beside the worker, off the gateway's CPU
        gateways = {}
        for name, tree in trees.items():
            gateway, port = side_by_side.start_gateway(
                tree, lambda port: {**gateway_config(port, worker_port), "logging": {"requests": False}}, tmp_dir,
                name.split(" ")[0])
            stack.callback(gateway.stop, 30)
            gateways[name] = (gateway.popen.pid, port)
        results = {name: {"cells": tree_cells} for name, tree_cells in measure(gateways, args.rounds).items()}
    for figures in results.values():
        figures["growth"] = growth(figures["cells"])
    result = {"benchmark": SECTION, "baseline": args.baseline,
              "command": side_by_side.command("long-answers", args),
              "rounds": args.rounds,
              "machine": machine_description(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": sys.version.split()[0], "target_growth": TARGET_GROWTH, "trees": results,
              "wall_s": round(time.perf_counter() - started)}
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps({name: figures["growth"] for name, figures in results.items()}, indent=2))


if __name__ == "__main__":
    main()
