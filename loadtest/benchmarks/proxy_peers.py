"""Proxy overhead side by side, in one run: kvgate's gateway, SGLang's Rust router (LiteLLM too when
installed), the floor of a Python proxy on kvgate's HTTP stack (loadtest/peers/proxy_floor.py: what kvgate's
own per-request work adds is kvgate less the floor) and no proxy at all in front of a fixed-response
nginx, loaded by wrk; requests/s on one core and the latency each adds to direct.

The upstream is nginx (`worker_processes 1`, no daemon, a temp config) answering POST
/v1/chat/completions and /v1/completions with a fixed OpenAI-style answer: JSON when the request body
says `"stream": false`, SSE (4 content chunks, a usage chunk, `data: [DONE]`, one write with a
content-length) when it says `"stream": true`. nginx cannot branch on a body by itself: the echo module
reads the body, a `map` on `$request_body` picks the answer and `echo_exec` jumps to it, so each proxy
gets what it asks for (kvgate always asks its worker for a stream, also for a non-streaming client).
The proxy under test runs on CPU 0 (`taskset`), nginx and wrk on the other CPU. Each cell (mode x
connections) runs every proxy in turn, the order mirrored in the second round; figures are medians.
Writes results/bench_proxy.json and the "proxy-peers" section of docs/benchmarks.md.
Run: kvgate bench proxy-peers [--quick] [--no-doc] [--no-litellm] [--doc-only]
Needs nginx with its echo module, wrk and sglang-router (loadtest/peers: each missing one is named with its install).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from loadtest.benchdoc import bench_command, machine_description, number, replace_section, save_result
from loadtest.harness.fixed_upstream import NUM_CHUNKS, check_answers, request_body, start_nginx
from loadtest.harness.gateway import cpu_placement
from loadtest.harness.proxies import (CONNECTIONS, FLOOR, KVGATE, LITELLM, MODES, NUM_ROUNDS, SGLANG, healthy,
                                      interference, measure, phase_seconds, start_proxies, summarise, versions)
from loadtest.harness.wrk import wrk_script
from loadtest.paths import RESULTS_DIR
from loadtest.peers import LITELLM as LITELLM_PEER
from loadtest.peers import NGINX, NGINX_ECHO, SGLANG_ROUTER, WRK, require
from loadtest.procs import free_port

SECTION = "proxy-peers"
RESULTS_PATH = RESULTS_DIR / "bench_proxy.json"
SHARED_CORES = 0.1  # a run during which other work took more CPU than this shared the machine
# issue #17, non-streaming: kvgate's req/s per core >= 0.5x sglang-router's (32 connections), its added
# p50 <= 2x sglang-router's (1 connection); streaming: keep the lead (>= 1x req/s, <= 1x added p50)
TARGETS = {"non-streaming": {"rps_ratio_min": 0.5, "added_p50_ratio_max": 2.0},
           "streaming": {"rps_ratio_min": 1.0, "added_p50_ratio_max": 1.0}}


# -- figures ------------------------------------------------------------------------------------


def verdict(figures: dict[str, Any]) -> dict[str, Any]:
    """Per mode: kvgate's req/s at 32 connections over sglang-router's, its added p50 at 1 connection
    over sglang-router's, and no failed requests through either; each against TARGETS."""
    out = {}
    for mode, target in TARGETS.items():
        many, one = figures[mode][str(CONNECTIONS[-1])], figures[mode][str(CONNECTIONS[0])]
        rps_ratio = many[KVGATE]["requests_per_s"] / many[SGLANG]["requests_per_s"]
        kv_added, sg_added = one[KVGATE]["added_p50_ms"], one[SGLANG]["added_p50_ms"]
        cpu_kv, cpu_sg = many[KVGATE]["cpu_ms_per_request"], many[SGLANG]["cpu_ms_per_request"]
        errors = sum(cell[p]["errors"] for cell in figures[mode].values() for p in (KVGATE, SGLANG))
        out[mode] = {"rps_ratio": rps_ratio, "rps_pass": rps_ratio >= target["rps_ratio_min"],
                     "added_p50_ratio": kv_added / sg_added if sg_added > 0 else None,
                     "added_p50_pass": kv_added <= target["added_p50_ratio_max"] * sg_added,
                     "cpu_per_request_ratio": cpu_kv / cpu_sg if cpu_kv and cpu_sg else None,
                     "errors": errors, "errors_pass": errors == 0}
    return out


# -- the report ---------------------------------------------------------------------------------


def _table(figures: dict[str, Any]) -> str:
    rows = []
    for mode, cells in figures.items():
        for connections, cell in cells.items():
            for proxy, f in cell.items():
                rounds = " / ".join(f"{x:,.0f}" for x in f["requests_per_s_rounds"])
                busy_pct = None if f["cpu_busy"] is None else f["cpu_busy"] * 100
                rows.append(f"| {mode} | {connections} | {proxy} | {f['requests_per_s']:,.0f} ({rounds}) "
                            f"| {number(f['p50_ms'], 3)} | {number(f['p99_ms'], 3)} | {number(f['added_p50_ms'], 3)} "
                            f"| {number(f['added_p99_ms'], 3)} | {number(busy_pct, 0)} "
                            f"| {number(f['cpu_ms_per_request'], 3)} | {f['errors']} |")
    return "\n".join(rows)


def _verdict_rows(v: dict[str, Any]) -> str:
    mark = {True: "pass", False: "FAIL"}
    rows = []
    for mode, target in TARGETS.items():
        m = v[mode]
        rows += [f"| {mode}: kvgate req/s at {CONNECTIONS[-1]} connections / sglang-router's | {m['rps_ratio']:.2f}x "
                 f"(kvgate's CPU per request: {number(m['cpu_per_request_ratio'], 1)}x sglang-router's) "
                 f"| >= {target['rps_ratio_min']:g}x | {mark[m['rps_pass']]} |",
                 f"| {mode}: kvgate added p50 at {CONNECTIONS[0]} connection / sglang-router's "
                 f"| {number(m['added_p50_ratio'])}x | <= {target['added_p50_ratio_max']:g}x "
                 f"| {mark[m['added_p50_pass']]} |",
                 f"| {mode}: failed requests through kvgate and sglang-router | {m['errors']} | 0 "
                 f"| {mark[m['errors_pass']]} |"]
    return "\n".join(rows)


def _cpus(cpus: list[int]) -> str:
    return ", ".join(map(str, cpus)) or "(any: one CPU only)"


def markdown(result: dict[str, Any]) -> str:
    s, v, i = result["settings"], result["versions"], result["interference"]
    measured = {proxy for cells in result["figures"].values() for cell in cells.values() for proxy in cell}
    litellm = (f" LiteLLM {v['litellm']} (`litellm --num_workers 1`, no master key, no access log),"
               if LITELLM in measured else "")
    floor = (" the floor of a proxy built the same way (\"python floor\", `loadtest/peers/proxy_floor.py`: uvicorn as kvgate "
             "runs it and kvgate's upstream client passing each request on and its answer back, and nothing else: no "
             "auth, parsing, admission, routing or metrics)," if FLOOR in measured else "")
    return f"""## Proxy overhead beside SGLang's router

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; figures from one run; load average
{result['load_average']['start'][0]:.1f} at the start, {result['load_average']['end'][0]:.1f} at the end)
Date: {result['date']}

A fixed-response upstream ({v['nginx']}, one worker process, echo module) answers chat completions at once:
JSON for `"stream": false`, SSE ({NUM_CHUNKS} content chunks, a usage chunk, `data: [DONE]`, in one write) for
`"stream": true` (nginx reads the body and picks the answer with a `map` on it). In front of it, each on CPU
{_cpus(s['cpus']['proxy'])} alone: kvgate's gateway (`python -m kvgate gateway`, one uvicorn process, kv_aware routing
with `tokenizer: null`, no request log lines (`logging.requests: false`: the peers write none); it always asks
its worker for a stream, also for a non-streaming client),{floor} SGLang's router {v['sglang-router']}
(`--policy round_robin --disable-health-check --log-level warn`),{litellm} and no proxy ("direct"). nginx and {v['wrk']} (one thread, keep-alive connections, a fixed chat request) share CPU(s)
{_cpus(s['cpus']['upstream_and_load'])}. Every cell runs each proxy in turn for {s['duration_s']:g} s after a
{s['warmup_s']:g} s warm-up; {s['rounds']} rounds, the order mirrored in the second; figures are medians over
rounds (req/s of each round in brackets). Added = the proxy's latency minus direct's in the same round and cell.
Proxy CPU = the proxy process's CPU time over the run (100 = one core busy); ms/req = its CPU per request.
Other work on the machine during the measured runs (busy CPU time not spent by the proxies, nginx or wrk):
{i['median_cores']:.2f} cores in the median run, {i['max_cores']:.2f} in the worst{_shared_note(result['raw'])}.

| mode | connections | proxy | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | proxy CPU % | CPU ms/req | failed |
|---|---|---|---|---|---|---|---|---|---|---|
{_table(result['figures'])}

| target (issue #17) | value | target | result |
|---|---|---|---|
{_verdict_rows(result['verdict'])}

{_floor_note(result['figures'])}{_stall_note(result['figures'])}Raw figures: `results/bench_proxy.json`.
"""


def _shared_note(runs: list[dict[str, Any]]) -> str:
    shared = [f"{r['proxy']} {r['mode']} c={r['connections']} round {r['round']}" for r in runs
              if r["foreign_cores"] > SHARED_CORES]
    return f" (above {SHARED_CORES:g}: {', '.join(shared)})" if shared else f" (none above {SHARED_CORES:g})"


def _floor_note(figures: dict[str, Any]) -> str:
    """Lines splitting kvgate's CPU per request at 32 connections into the floor's (the HTTP stack) and
    the rest (its own per-request work), when the floor was measured."""
    lines = []
    for mode in MODES:
        cell = figures[mode][str(CONNECTIONS[-1])]
        if FLOOR not in cell:
            return ""
        kvgate, floor = cell[KVGATE]["cpu_ms_per_request"], cell[FLOOR]["cpu_ms_per_request"]
        if not kvgate or not floor:
            return ""
        lines.append(f"{mode}: kvgate {kvgate:.3f} ms of CPU a request, the floor {floor:.3f} ms "
                     f"({cell[FLOOR]['requests_per_s'] / cell[SGLANG]['requests_per_s']:.2f}x sglang-router's req/s): "
                     f"{kvgate - floor:.3f} ms ({(kvgate - floor) / kvgate:.0%}) is kvgate's own work")
    return ("At " + str(CONNECTIONS[-1]) + " connections, what the HTTP stack costs and what kvgate does on it:\n"
            + "".join(f"- {line}.\n" for line in lines) + "\n")


def _stall_note(figures: dict[str, Any]) -> str:
    """A line on sglang-router's streams when they wait rather than work (its CPU mostly idle at 32)."""
    one, many = figures["streaming"][str(CONNECTIONS[0])][SGLANG], figures["streaming"][str(CONNECTIONS[-1])][SGLANG]
    if many["cpu_busy"] is None or many["cpu_busy"] > 0.5:
        return ""
    return (f"Streaming through sglang-router waits rather than works: {one['p50_ms']:.0f} ms per answer at "
            f"{CONNECTIONS[0]} connection (p50) and {many['requests_per_s']:,.0f} req/s at {CONNECTIONS[-1]}, its CPU "
            f"{many['cpu_busy']:.0%} busy (a stall per stream on this harness).\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench proxy-peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s runs (a smoke run; figures are noisier)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--doc-only", action="store_true",
                        help="measure nothing: rewrite the docs section from results/bench_proxy.json (after a "
                             "change to the section's wording; the figures and command stay the run's)")
    parser.add_argument("--no-litellm", action="store_true",
                        help=f"leave LiteLLM out (measured when installed: {LITELLM_PEER.install})")
    args = parser.parse_args(argv)
    if args.doc_only:
        return rewrite_doc(json.loads(RESULTS_PATH.read_text()))
    require(NGINX, NGINX_ECHO, WRK, SGLANG_ROUTER)
    duration_s, warmup_s = phase_seconds(args.quick)
    proxy_cpus, load_cpus = cpu_placement()
    started, load_start = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        scripts = {mode: tmp_dir / f"{mode}.lua" for mode in MODES}
        for mode, path in scripts.items():
            path.write_text(wrk_script(mode == "streaming"))
        nginx_port = free_port()
        nginx = healthy(stack, start_nginx(nginx_port, tmp_dir, load_cpus))
        names = [KVGATE, FLOOR, SGLANG] + ([LITELLM] if LITELLM_PEER.present() and not args.no_litellm else [])
        targets = start_proxies(stack, names, nginx_port, tmp_dir, proxy_cpus)
        for name, (port, _) in targets.items():
            check_answers(name, port)
        own_pids = [nginx.popen.pid, *(pid for _, pid in targets.values() if pid)]
        runs = measure(targets, scripts, duration_s, warmup_s, load_cpus, own_pids)
    load_average = {"start": list(load_start), "end": list(os.getloadavg())}
    write_result(runs, args, (proxy_cpus, load_cpus), time.time() - started, load_average)


def rewrite_doc(result: dict[str, Any]) -> None:
    """The docs section again from a saved run: its figures and verdict recomputed from its raw runs."""
    result["figures"] = figures = summarise(result["raw"])
    result |= {"verdict": verdict(figures), "interference": interference(result["raw"])}
    replace_section(SECTION, markdown(result))


def write_result(runs: list[dict[str, Any]], args: argparse.Namespace,
                 cpus: tuple[set[int] | None, set[int] | None], wall_s: float,
                 load_average: dict[str, list[float]]) -> None:
    figures = summarise(runs)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "benchmark": SECTION, "command": bench_command("proxy-peers", ["--quick"] if args.quick else []),
        "machine": machine_description(), "date": now.isoformat(timespec="seconds"),
        "versions": versions(), "wall_s": round(wall_s, 1), "load_average": load_average,
        "settings": {"rounds": NUM_ROUNDS, "duration_s": runs[0]["duration_s"],
                     "warmup_s": phase_seconds(args.quick)[1],
                     "connections": list(CONNECTIONS), "chunks": NUM_CHUNKS, "request": json.loads(request_body(True)),
                     "cpus": {"proxy": sorted(cpus[0] or []), "upstream_and_load": sorted(cpus[1] or [])}},
        "targets": TARGETS, "figures": figures, "verdict": verdict(figures), "interference": interference(runs),
        "raw": runs,
    }
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(result["verdict"], indent=2))


if __name__ == "__main__":
    main()
