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
Run: kvgate bench prompt-cpu --baseline REV [--rounds 2] [--no-doc] [--doc-only]
(needs the default model: `make model`)
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from loadtest.harness.gateway import API_KEY
from loadtest.harness.prompt_cells import (CELLS, OUTPUT_TOKENS, REQUESTS_PER_CELL, measure_cell,
                                           start_worker_and_gateways)
from loadtest.paths import RESULTS_DIR

SECTION = "prompt-cpu"
RESULTS_PATH = RESULTS_DIR / "bench_prompt_cpu.json"


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench prompt-cpu", description=__doc__.split("\n\n")[0])
    side_by_side.add_arguments(parser, RESULTS_PATH)
    args = parser.parse_args(argv)
    if args.doc_only:
        return replace_section(SECTION, markdown(json.loads(RESULTS_PATH.read_text())))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-prompt-cpu-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        trees = side_by_side.compared_trees(args.baseline, tmp_dir)
        _worker_port, gateways = start_worker_and_gateways(stack, tmp_dir, trees)
        trees_figures = measure(gateways, args.rounds)
    result = {"benchmark": SECTION, "baseline": args.baseline,
              "command": side_by_side.command("prompt-cpu", args),
              "rounds": args.rounds,
              "machine": machine_description(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": sys.version.split()[0], "trees": trees_figures, "wall_s": round(time.perf_counter() - started)}
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(trees_figures, indent=2))


if __name__ == "__main__":
    main()
