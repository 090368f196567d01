"""Streamed answers at a live engine's pace: each proxy's CPU a request and a token, kvgate beside the floor
of a Python proxy and sglang-router (and another commit's kvgate with --baseline), in front of one worker
that streams a token every few milliseconds.

The proxy benchmarks hand a proxy whole answers in one read (proxy-peers: nginx writes an answer at once;
long-answers: 64 KiB writes), where a proxy's work a token is a parse in a loop. A live engine sends
a token a read, milliseconds apart, and each token wakes the proxy: its event loop, its task, caches gone
cold meanwhile. That is what a fleet's proxy spends its CPU on, and here it is measured as such.

One `sim` worker (prompt-cpu's: SmolLM2-135M-Instruct's tokenizer, a timing model for the engine, KV
events on) serves every proxy; the proxies run on a CPU of their own (idle while another is measured), the
worker and this client (one connection, streamed completions one after another) on the other. kvgate runs
as prompt-cpu runs it (kv_aware, `tokenizer: default`, the worker's KV events, no request log lines);
the floor is proxy-peers's (uvicorn and kvgate's upstream client passing each request on: no parsing,
routing or metrics); sglang-router cache_aware as proxy-peers starts it, when installed. Prompts share a
~600-token context (prompt-cpu's first cell); answers of 16 and 64 tokens. A token's CPU = (CPU a
64-token request - CPU a 16-token request) / 48: what each token costs at that pace, time-bound work (health
checks, the server's own ticks) included, as it is in a running fleet. The proxies take turns cell by cell,
the order mirrored each time; figures are medians of --rounds.
Writes results/bench_stream_pace.json and the "stream-pace" section of docs/benchmarks.md.
Run: kvgate bench stream-pace [--baseline REV] [--rounds 2] [--no-doc] [--doc-only]
(needs the default model: `make model`; sglang-router measured when installed: loadtest/peers)
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
from loadtest.harness.gateway import API_KEY, cpu_placement
from loadtest.harness.prompt_cells import CELL, LONG, SHORT, measure_cell, start_worker_and_gateways
from loadtest.harness.proxies import FLOOR, SGLANG, start_floor, start_sglang
from loadtest.paths import RESULTS_DIR
from loadtest.peers import SGLANG_ROUTER
from loadtest.procs import free_port

SECTION = "stream-pace"
RESULTS_PATH = RESULTS_DIR / "bench_stream_pace.json"
REQUESTS = {SHORT: 100, LONG: 50}  # ~0.5 s of kvgate's CPU a cell: 10 ms clock ticks are ~2% of it


def per_token_us(short_ms: float, long_ms: float) -> float:
    """A token's CPU (us) from the CPU a request of SHORT and of LONG tokens (ms)."""
    return (long_ms - short_ms) * 1000 / (LONG - SHORT)


def measure(proxies: dict[str, tuple[int, int]], rounds: int) -> dict[str, dict[str, Any]]:
    """Both cells through every proxy (name -> (pid, port)), the order mirrored from cell to cell; per proxy,
    each cell's rounds and medians (CPU ms a request, wall ms a token) and the CPU a token."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {SHORT: [], LONG: []} for name in proxies}
    clients = {name: httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {API_KEY}"},
                                  timeout=300) for name, (_pid, port) in proxies.items()}
    try:
        turn = 0
        for round_index in range(rounds):
            for tokens in (SHORT, LONG):
                names = list(proxies) if turn % 2 == 0 else list(proxies)[::-1]
                turn += 1
                for name in names:
                    run = measure_cell(clients[name], proxies[name][0], CELL, 1000 * round_index + tokens, tokens,
                                       REQUESTS[tokens])
                    runs[name][tokens].append(run)
                    print(f"{name}: {tokens} tokens: {run['cpu_ms_per_request']:.2f} ms a request", file=sys.stderr,
                          flush=True)
    finally:
        for client in clients.values():
            client.close()
    figures = {}
    for name, cells in runs.items():
        medians = {tokens: statistics.median(r["cpu_ms_per_request"] for r in cell) for tokens, cell in cells.items()}
        figures[name] = {
            "cpu_ms_per_request": medians,
            "rounds_cpu_ms_per_request": {tokens: [r["cpu_ms_per_request"] for r in cell] for tokens, cell in cells.items()},
            "wall_ms_per_token": statistics.median(r["wall_s"] * 1000 / r["requests"] / LONG for r in cells[LONG]),
            "cpu_us_per_token": per_token_us(medians[SHORT], medians[LONG]),
        }
    return figures


def markdown(result: dict[str, Any]) -> str:
    proxies = result["proxies"]
    kvgate = "kvgate, this checkout"
    peer = proxies.get(f"{SGLANG} cache_aware")
    rows = []
    for name, f in proxies.items():
        rounds = f["rounds_cpu_ms_per_request"]
        cells = " | ".join(f"{f['cpu_ms_per_request'][str(t)]:.2f} ({' / '.join(f'{x:.2f}' for x in rounds[str(t)])})"
                           for t in (SHORT, LONG))
        ratio = f"{f['cpu_us_per_token'] / peer['cpu_us_per_token']:.2f}x" if peer else "-"
        rows.append(f"| {name} | {cells} | {f['cpu_us_per_token']:.0f} | {ratio} |")
    pace = proxies[kvgate]["wall_ms_per_token"]
    floor = proxies.get(FLOOR)
    notes = []
    if floor:
        notes.append(f"kvgate's own work a token, above the floor: "
                     f"{proxies[kvgate]['cpu_us_per_token'] - floor['cpu_us_per_token']:.0f} us.")
    if peer is None:
        notes.append(f"sglang-router was not measured (not installed: `{SGLANG_ROUTER.install}`).")
    return f"""## Streamed answers at a live engine's pace: CPU a token

Command: `{result["command"]}`
Machine: {result["machine"]} (shared with other work; figures from one run)
Date: {result["date"]}

One `sim` worker streams each answer a token a read, ~{pace:.0f} ms apart (its timing model's pace); each proxy
runs alone on a CPU of its own, the worker and the client (one connection, streamed completions sharing a
~600-token context, one after another) on the other. CPU = the proxy process's CPU time (its children's
included) over a cell, a request: the median of {result["rounds"]} rounds (each round's figure in brackets). A
token = (64-token request - 16-token request) / 48: time-bound work (health checks, the server's ticks)
included. The floor: uvicorn and kvgate's upstream client passing each request on, nothing else.

| proxy | CPU ms a request, {SHORT} tokens | CPU ms a request, {LONG} tokens | CPU us a token | a token / sglang-router's |
|---|---|---|---|---|
{chr(10).join(rows)}

{" ".join(notes)}
Raw figures: `results/bench_stream_pace.json`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench stream-pace", description=__doc__.split("\n\n")[0])
    side_by_side.add_arguments(parser, RESULTS_PATH)
    parser.add_argument("--no-sglang", action="store_true", help="leave sglang-router out even where it is installed")
    args = parser.parse_args(argv)
    if args.doc_only:
        return replace_section(SECTION, markdown(json.loads(RESULTS_PATH.read_text())))
    started = time.perf_counter()
    proxy_cpus = cpu_placement()[0]
    with tempfile.TemporaryDirectory(prefix="bench-stream-pace-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        trees = side_by_side.compared_trees(args.baseline, tmp_dir)
        worker_port, gateways = start_worker_and_gateways(stack, tmp_dir, trees)
        proxies = {f"kvgate, {name}": gateway for name, gateway in gateways.items()}
        starters = [(FLOOR, start_floor)]
        if not args.no_sglang and SGLANG_ROUTER.present():
            starters.append((f"{SGLANG} cache_aware", start_sglang))
        for name, start in starters:
            port = free_port()
            proc = start(port, worker_port, tmp_dir, proxy_cpus)
            stack.callback(proc.stop)
            proc.wait_healthy(120)
            proxies[name] = (proc.popen.pid, port)
        figures = measure(proxies, args.rounds)
    result = {"benchmark": SECTION, "baseline": args.baseline,
              "command": side_by_side.command("stream-pace", args), "rounds": args.rounds,
              "machine": machine_description(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "python": sys.version.split()[0], "proxies": figures, "wall_s": round(time.perf_counter() - started)}
    save_result(RESULTS_PATH, result)
    result = json.loads(RESULTS_PATH.read_text())  # the doc reads what --doc-only reads (cell keys as strings)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
