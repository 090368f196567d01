"""Gateway overhead benchmark: added latency, saturation rate, per-chunk cost, 1,000 streams.

A fake OpenAI-compatible worker (raw ASGI on uvicorn, answers at once) runs in one child
process, the real gateway (`python -m kvgate gateway`, one uvicorn process) in another, and the
load generator (raw asyncio HTTP/1.1 on uvloop, not httpx) in a third, so none of them shares
an event loop. Every request is measured twice: through the gateway and to the fake worker
directly; the difference is what the gateway adds. Writes results/bench_gateway.json and the
"gateway" section of docs/benchmarks.md.
Run: kvgate bench gateway [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
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

import yaml

from loadtest.benchdoc import bench_command, save_result
from loadtest.harness import load_jobs
from loadtest.harness.fake_worker import run_fake_worker
from loadtest.harness.gateway import (API_KEY, WIDE_ADMISSION, child, cpu_placement, gateway_argv, gateway_config,
                                      raise_fd_limit)
from loadtest.harness.raw_http import Connection, Pool, check_answer, completion_body, http_request
from loadtest.paths import RESULTS_DIR
from loadtest.procs import free_port, process_cpu_s
from loadtest.stats import percentile

MODULE = "loadtest.benchmarks.gateway"  # its load-generator jobs run as `python -m MODULE --job SPEC`
RESULTS_PATH = RESULTS_DIR / "bench_gateway.json"
# Added latency is reported, not judged here: on a shared 2-core machine an absolute figure (once "p99 <= 5 ms
# at 70% of saturation") measured the host, not the gateway (issue #17). It is judged as a ratio against a peer
# router measured in the same run: loadtest/benchmarks/proxy_peers.py (added p50 <= 2x sglang-router's).
TARGETS = {"per_chunk_overhead_ms": 0.2, "concurrent_streams": 1000}
LOAD_FRACTION = 0.7
LATENCY_ROUNDS = 5  # each: saturation now, then gateway and direct at 70% of it; the figures are the median round
OPEN_LOOP_CONNECTIONS = 64  # the load generator's connection pool in the latency phase (like wrk2's -c)
WARMUP_REQUESTS = 20


# -- the load generator (raw HTTP/1.1 over asyncio) ---------------------------------------------


async def closed_loop(port: int, concurrency: int, duration_s: float, warmup_s: float) -> dict[str, Any]:
    """Saturation: `concurrency` clients back to back; completed non-streaming requests per second."""
    raw = http_request(port, "/v1/completions", completion_body(stream=False))
    counts = {"ok": 0, "errors": 0, "all": 0}
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    cpu_from = None

    async def client() -> None:
        nonlocal cpu_from
        conn = await Connection.open(port)
        while time.perf_counter() < stop_at:
            status, body = await conn.request(raw)
            counts["all"] += 1
            if time.perf_counter() >= measure_from:
                if cpu_from is None:
                    cpu_from = time.process_time()
                counts["ok" if check_answer(status, body, False, 1) else "errors"] += 1
        conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    cpu_s = time.process_time() - (cpu_from or time.process_time())
    return {"requests_per_s": counts["ok"] / duration_s, "errors": counts["errors"], "requests_total": counts["all"],
            "concurrency": concurrency,
            "duration_s": duration_s, "load_generator_cpu_frac": cpu_s / duration_s}


async def open_loop(port: int, rate_per_s: float, duration_s: float, warmup_s: float, seed: int,
                    connections: int, arrivals: str = "poisson") -> dict[str, Any]:
    """Arrivals at rate_per_s over a pool of connections, Poisson or evenly spaced ("uniform", as
    wrk2 and k6's constant-arrival-rate send); latency counts from the scheduled arrival (no
    coordinated omission)."""
    raw = http_request(port, "/v1/completions", completion_body(stream=False))
    pool, rng = Pool(port, connections), random.Random(seed)
    await pool.open()
    latencies_s: list[float] = []
    late_s: list[float] = []  # how late each request left the load generator (its own stalls)
    errors = 0
    tasks = set()

    async def one(scheduled: float, measured: bool) -> None:
        nonlocal errors
        if measured:
            late_s.append(time.perf_counter() - scheduled)
        try:
            status, body = await pool.send(raw)
            ok = check_answer(status, body, False, 1)
        except (OSError, asyncio.IncompleteReadError):
            ok = False
        if measured and ok:
            latencies_s.append(time.perf_counter() - scheduled)
        elif measured:
            errors += 1

    start = time.perf_counter()
    t, cpu_from, sent = start, time.process_time(), 0
    while t < start + warmup_s + duration_s:
        t += rng.expovariate(rate_per_s) if arrivals == "poisson" else 1.0 / rate_per_s
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent += 1
        task = asyncio.create_task(one(t, t >= start + warmup_s))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    cpu_s = time.process_time() - cpu_from
    pool.close()
    return {"rate_per_s": rate_per_s, "arrivals": arrivals, "connections": connections, "requests": len(latencies_s),
            "errors": errors, "requests_total": sent,
            "p50_ms": percentile(latencies_s, 0.50) * 1e3, "p90_ms": percentile(latencies_s, 0.90) * 1e3,
            "p99_ms": percentile(latencies_s, 0.99) * 1e3, "mean_ms": statistics.fmean(latencies_s) * 1e3,
            "load_generator_cpu_frac": cpu_s / (warmup_s + duration_s),
            "send_late_p99_ms": percentile(late_s, 0.99) * 1e3, "send_late_max_ms": max(late_s) * 1e3}


async def sequential_streams(port: int, num_requests: int, num_tokens: int) -> dict[str, Any]:
    """One streaming request at a time; e2e (request sent -> [DONE] read) per request."""
    raw = http_request(port, "/v1/completions", completion_body(stream=True, num_tokens=num_tokens))
    conn = await Connection.open(port)
    samples, errors = [], 0
    for i in range(num_requests + WARMUP_REQUESTS):
        started = time.perf_counter()
        status, body = await conn.request(raw)
        elapsed = time.perf_counter() - started
        if i >= WARMUP_REQUESTS:
            samples.append(elapsed)
            errors += not check_answer(status, body, True, num_tokens)
    conn.close()
    return {"num_tokens": num_tokens, "requests": num_requests, "errors": errors,
            "p50_ms": percentile(samples, 0.5) * 1e3, "mean_ms": statistics.fmean(samples) * 1e3}


async def concurrent_streams(port: int, num_streams: int, num_tokens: int, chunk_delay_ms: float) -> dict[str, Any]:
    """num_streams streaming requests at once, each on its own connection; all must finish whole."""
    raw = http_request(port, "/v1/completions", completion_body(True, num_tokens, chunk_delay_ms))
    state = {"open": 0, "peak_open": 0, "ok": 0, "errors": 0}
    messages: list[str] = []
    started = time.perf_counter()

    async def one() -> None:
        try:
            conn = await Connection.open(port)
            conn.writer.write(raw)
            state["open"] += 1
            state["peak_open"] = max(state["peak_open"], state["open"])
            status, body = await conn.request(b"")
            state["open"] -= 1
            conn.close()
            ok = check_answer(status, body, True, num_tokens)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            messages.append(repr(exc))
            ok = False
        state["ok" if ok else "errors"] += 1

    await asyncio.gather(*(one() for _ in range(num_streams)))
    return {"streams": num_streams, "ok": state["ok"], "errors": state["errors"], "peak_open": state["peak_open"],
            "chunks_per_stream": num_tokens, "chunk_delay_ms": chunk_delay_ms,
            "wall_s": time.perf_counter() - started, "error_samples": messages[:5]}


JOBS = {"closed_loop": closed_loop, "open_loop": open_loop, "sequential_streams": sequential_streams,
        "concurrent_streams": concurrent_streams}


def run_job(job: str, **kwargs: Any) -> dict[str, Any]:
    """One load-generator job in a fresh child process (its own CPU and event loop)."""
    return load_jobs.run(MODULE, job, **kwargs)


# -- the run ------------------------------------------------------------------------------------

def cpu_times(cpu: int) -> list[int]:
    """One CPU's /proc/stat counters (user nice system idle iowait irq softirq steal ...)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            return [int(x) for x in line.split()[1:]]
    return []


def with_cpu(pid: int, job: str, **kwargs: Any) -> dict[str, Any]:
    """run_job, plus the CPU seconds process pid used meanwhile (robust to other load on the
    machine) and the share of the gateway's CPU that the hypervisor gave to other guests
    (steal: the host's noise, made visible)."""
    before, watched = process_cpu_s(pid), sorted(cpu_placement()[0] or [0])[0]
    stat_before = cpu_times(watched)
    result = run_job(job, **kwargs)
    stat_after = cpu_times(watched)
    deltas = [b - a for a, b in zip(stat_before, stat_after)]
    steal = deltas[7] / max(1, sum(deltas[:8])) if len(deltas) >= 8 else float("nan")
    return {**result, "server_cpu_s": process_cpu_s(pid) - before, "steal_frac": steal}


def latency_round(index: int, gateway: tuple[int, int], direct: tuple[int, int], scale: float) -> dict[str, Any]:
    """One round: the gateway's saturation now, then Poisson and evenly spaced arrivals at 70% of
    it, through the gateway and straight to the fake worker (the order alternates by round).
    Fixing the rate from a saturation measured seconds before keeps it at 70% when the machine's
    speed drifts over a run."""
    sat = with_cpu(gateway[1], "closed_loop", port=gateway[0], concurrency=32, duration_s=3 * scale,
                   warmup_s=1 * scale)
    rate = round(LOAD_FRACTION * sat["requests_per_s"], 1)
    targets = [("gateway", gateway), ("direct", direct)]
    result: dict[str, Any] = {"saturation": sat, "rate_per_s": rate}
    for arrivals in ("poisson", "uniform"):
        result[arrivals] = {name: with_cpu(pid, "open_loop", port=port, rate_per_s=rate, duration_s=8 * scale,
                                           warmup_s=1 * scale, seed=index, connections=OPEN_LOOP_CONNECTIONS,
                                           arrivals=arrivals)
                            for name, (port, pid) in (targets if index % 2 == 0 else targets[::-1])}
    return result


def measure(gateway_port: int, worker_port: int, gateway_pid: int, worker_pid: int, quick: bool) -> dict[str, Any]:
    """Each phase records the CPU seconds of the process under test (the fake worker for direct)."""
    scale = 0.3 if quick else 1.0
    saturation = {"concurrency": 32, "duration_s": 8 * scale, "warmup_s": 2 * scale}
    sat = {"direct": with_cpu(worker_pid, "closed_loop", port=worker_port, **saturation),
           "gateway": with_cpu(gateway_pid, "closed_loop", port=gateway_port, **saturation)}
    rounds = [latency_round(i, (gateway_port, gateway_pid), (worker_port, worker_pid), scale)
              for i in range(LATENCY_ROUNDS)]
    streams = {}
    for n in (1, 100):
        streams[f"direct_{n}"] = run_job("sequential_streams", port=worker_port, num_requests=int(300 * scale),
                                         num_tokens=n)
        streams[f"gateway_{n}"] = with_cpu(gateway_pid, "sequential_streams", port=gateway_port,
                                           num_requests=int(300 * scale), num_tokens=n)
    many = run_job("concurrent_streams", port=gateway_port, num_streams=1000, num_tokens=20, chunk_delay_ms=50)
    return {"saturation": sat, "latency_rounds": rounds, "sequential_streams": streams, "concurrent_streams": many}


def round_figures(one: dict[str, Any]) -> dict[str, Any]:
    """Added p50/p99 (gateway minus direct), the gateway's busy fraction and the steal on its CPU."""
    out: dict[str, Any] = {"rate_per_s": one["rate_per_s"], "saturation_rps": one["saturation"]["requests_per_s"]}
    for arrivals in ("poisson", "uniform"):
        gw, direct = one[arrivals]["gateway"], one[arrivals]["direct"]
        out[arrivals] = {"added_p50_ms": gw["p50_ms"] - direct["p50_ms"], "added_p99_ms": gw["p99_ms"] - direct["p99_ms"],
                         "gateway_p99_ms": gw["p99_ms"], "direct_p99_ms": direct["p99_ms"],
                         "gateway_busy": _busy(gw), "gateway_cpu_ms_per_request": _cpu_ms_per_request(gw),
                         "direct_cpu_ms_per_request": _cpu_ms_per_request(direct),
                         "steal_frac": gw["steal_frac"], "errors": gw["errors"] + direct["errors"],
                         "send_late_p99_ms": max(gw["send_late_p99_ms"], direct["send_late_p99_ms"])}
    return out


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    streams = raw["sequential_streams"]
    per_chunk = (streams["gateway_100"]["p50_ms"] - streams["direct_100"]["p50_ms"]) / 100
    marginal = ((streams["gateway_100"]["p50_ms"] - streams["gateway_1"]["p50_ms"])
                - (streams["direct_100"]["p50_ms"] - streams["direct_1"]["p50_ms"])) / 99
    many, sat_gw = raw["concurrent_streams"], raw["saturation"]["gateway"]
    rounds = [round_figures(one) for one in raw["latency_rounds"]]

    def median_of(arrivals: str, key: str) -> float:
        return statistics.median(r[arrivals][key] for r in rounds)

    figures = {
        "saturation_rps": sat_gw["requests_per_s"],
        "direct_saturation_rps": raw["saturation"]["direct"]["requests_per_s"],
        "rounds": rounds,
        "added_p50_ms": median_of("poisson", "added_p50_ms"),
        "added_p99_ms": median_of("poisson", "added_p99_ms"),
        "added_p50_ms_uniform": median_of("uniform", "added_p50_ms"),
        "added_p99_ms_uniform": median_of("uniform", "added_p99_ms"),
        "per_chunk_overhead_ms": per_chunk,
        "per_chunk_marginal_ms": marginal,
        "gateway_cpu_ms_per_request": _cpu_ms_per_request(sat_gw),
        "gateway_cpu_ms_per_request_at_load": median_of("poisson", "gateway_cpu_ms_per_request"),
        "gateway_busy_at_load": median_of("poisson", "gateway_busy"),
        "direct_cpu_ms_per_request": _cpu_ms_per_request(raw["saturation"]["direct"]),
        "direct_cpu_ms_per_request_at_load": median_of("poisson", "direct_cpu_ms_per_request"),
        "gateway_cpu_ms_per_chunk": 1e3 * (streams["gateway_100"]["server_cpu_s"] - streams["gateway_1"]["server_cpu_s"])
        / (99 * (streams["gateway_100"]["requests"] + WARMUP_REQUESTS)),
        "concurrent_streams_ok": many["ok"],
        "concurrent_streams_errors": many["errors"],
        "open_loop_errors": sum(r[a]["errors"] for r in rounds for a in ("poisson", "uniform")),
    }
    figures["pass"] = {
        "per_chunk": per_chunk <= TARGETS["per_chunk_overhead_ms"],
        "concurrent_streams": many["ok"] == TARGETS["concurrent_streams"] and many["errors"] == 0,
    }
    return figures


def _cpu_ms_per_request(phase: dict[str, Any]) -> float:
    return 1e3 * phase["server_cpu_s"] / phase["requests_total"]


def _busy(phase: dict[str, Any]) -> float:
    """CPU per request x arrivals per second: the fraction of its CPU the process used at that rate."""
    return _cpu_ms_per_request(phase) * phase["rate_per_s"] / 1e3


def markdown(result: dict[str, Any]) -> str:
    f, raw = result["figures"], result["raw"]
    sat, rounds = raw["saturation"], f["rounds"]
    mark = {True: "pass", False: "FAIL"}
    many = raw["concurrent_streams"]
    p99s = [r["poisson"]["added_p99_ms"] for r in rounds]
    round_rows = "\n".join(
        f"| {i + 1} | {r['saturation_rps']:.0f} | {r['rate_per_s']:.0f} | {r['poisson']['added_p50_ms']:.2f} "
        f"| {r['poisson']['added_p99_ms']:.2f} ({r['poisson']['gateway_p99_ms']:.2f} vs {r['poisson']['direct_p99_ms']:.2f}) "
        f"| {r['uniform']['added_p50_ms']:.2f} / {r['uniform']['added_p99_ms']:.2f} | {r['poisson']['gateway_busy']:.0%} "
        f"| {r['poisson']['steal_frac']:.1%} | {r['poisson']['send_late_p99_ms']:.2f} |"
        for i, r in enumerate(rounds))
    return f"""## Gateway overhead

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; figures from one run)
Date: {result['date']}

A fake worker that answers at once (raw ASGI on uvicorn) behind the real gateway (`python -m kvgate gateway`,
one uvicorn process, `tokenizer: null`, kv_aware policy, admission limits wide enough for 1,000 streams: they are not what is measured); the load generator is a separate process (raw HTTP/1.1
on asyncio + uvloop). "Added" = through the gateway minus straight to the fake worker, same requests, same rate.
Placement: the gateway runs on CPU {result['cpus']['gateway']}, the fake worker and the load generator on CPUs
{result['cpus']['worker_and_load_generator']} (in both the gateway and the direct runs), as a proxy process would
have a core of its own in production.
Latency is measured in {len(rounds)} rounds; each round measures the gateway's saturation again, then sends Poisson
and evenly spaced arrivals at 70% of it through the gateway and straight to the fake worker (the order alternates),
so the rate follows the machine's speed as it drifts. The judged figures are the median round's.

| figure | value | target | result |
|---|---|---|---|
| saturation, non-streaming (32 clients, closed loop) | {f['saturation_rps']:.0f} req/s (direct, load generator and fake worker on the same CPUs: {f['direct_saturation_rps']:.0f} req/s) | | |
| added latency p50 at 70% of saturation (Poisson, {OPEN_LOOP_CONNECTIONS} pooled connections), median round | {f['added_p50_ms']:.2f} ms | (reported: judged against sglang-router in the same run, section proxy-peers) | |
| added latency p99 at the same rate, median round | {f['added_p99_ms']:.2f} ms (rounds: {min(p99s):.2f} to {max(p99s):.2f}) | (reported, as above) | |
| the same rate, evenly spaced arrivals (as wrk2 / k6 constant-arrival-rate send), added p50 / p99, median round | {f['added_p50_ms_uniform']:.2f} / {f['added_p99_ms_uniform']:.2f} ms | (reported) | |
| per-chunk streaming overhead, 100-chunk stream, (gateway - direct) / 100 | {f['per_chunk_overhead_ms']:.3f} ms (marginal, 100 vs 1 chunk: {f['per_chunk_marginal_ms']:.3f} ms) | <= {TARGETS['per_chunk_overhead_ms']} ms | {mark[f['pass']['per_chunk']]} |
| concurrent streams through the gateway ({many['chunks_per_stream']} chunks, {many['chunk_delay_ms']:.0f} ms apart) | {many['ok']} ok, {many['errors']} errors, peak {many['peak_open']} open | 1000, no errors | {mark[f['pass']['concurrent_streams']]} |

The rounds (Poisson unless marked; busy = the gateway process's CPU use at that rate; steal = the share of the
gateway's CPU the hypervisor gave to other guests during the Poisson phase; late = the load generator's p99
lateness against its schedule, which both latencies include):

| round | saturation req/s | rate req/s | added p50 ms | added p99 ms (gateway vs direct) | uniform added p50 / p99 ms | busy | steal | late p99 ms |
|---|---|---|---|---|---|---|---|---|
{round_rows}

Gateway CPU per non-streaming request (at saturation): {f['gateway_cpu_ms_per_request']:.2f} ms; per extra streamed
chunk: {f['gateway_cpu_ms_per_chunk']:.3f} ms. These count only the gateway process's own CPU time, so they depend
less on what else runs on the machine than the latencies do.
CPU per request at saturation vs at the 70% rate (requests arriving one by one, open loop; median round): gateway
{f['gateway_cpu_ms_per_request']:.2f} vs {f['gateway_cpu_ms_per_request_at_load']:.2f} ms, the fake worker
{f['direct_cpu_ms_per_request']:.3f} vs {f['direct_cpu_ms_per_request_at_load']:.3f} ms: on this machine a request
served alone costs more CPU than one served in a batch (any server here: the trivial fake worker too; the same
code runs uniformly slower, not more of it), so at the 70% rate the gateway process was {f['gateway_busy_at_load']:.0%} busy. This machine's
speed also drifts within a run (seen with a loop-lag probe in the gateway: windows of a few hundred ms in which
its CPU per request rose ~25% with no more requests arriving): near 80% busy, such a window pushes the gateway
past saturation for a moment, and the queue it leaves is the p99.
Failed requests in the open-loop phases (connection errors at the load generator): {f['open_loop_errors']}.
Load generator CPU at saturation: {sat['gateway']['load_generator_cpu_frac']:.0%} of a core (it is not the
bottleneck when this is well under 100%). Raw figures: `results/bench_gateway.json`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench gateway", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter phases (a smoke run; figures are noisier)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--fake-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return load_jobs.job_main(JOBS, args.job)
    if args.fake_worker:
        return run_fake_worker(args.fake_worker)
    fd_limit = raise_fd_limit()
    worker_port, gateway_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        config_path = tmp_dir / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(gateway_config(gateway_port, worker_port, WIDE_ADMISSION)))
        gateway_cpus, other_cpus = cpu_placement()
        worker = stack.enter_context(child([sys.executable, "-m", "loadtest.benchmarks.gateway", "--fake-worker", str(worker_port)],
                                  worker_port, "/health", tmp_dir, cpus=other_cpus))
        env = {**os.environ, "KVGATE_API_KEY": API_KEY}
        gateway = stack.enter_context(child(gateway_argv(config_path), gateway_port, "/ready", tmp_dir, env=env,
                                            cpus=gateway_cpus))
        raw = measure(gateway_port, worker_port, gateway.pid, worker.pid, args.quick)
    from loadtest.benchdoc import machine_description, replace_section

    result = {
        "command": bench_command("gateway", ["--quick"] if args.quick else []),
        "machine": machine_description(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "fd_limit": fd_limit, "targets": TARGETS, "raw": raw,
        "cpus": {"gateway": sorted(cpu_placement()[0] or []), "worker_and_load_generator": sorted(cpu_placement()[1] or [])},
    }
    result["figures"] = summarise(raw)
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section("gateway", markdown(result))
    print(json.dumps(result["figures"], indent=2))


if __name__ == "__main__":
    main()
