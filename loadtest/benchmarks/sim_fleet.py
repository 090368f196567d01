"""Host cost of a simulated fleet: can one machine host 8 `sim` workers at load-test rates?

Starts N sim workers, sends a seeded multi-tenant long-prefix workload straight to them
(round robin, open loop, Poisson) over HTTP, and reads each worker process's CPU time from
/proc while it runs. If the host were the bottleneck, time to first token would exceed the sim's
own step-time model; the report gives both.

    kvgate bench sim-fleet [--workers 8] [--rate 16] [--duration-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from loadtest.benchdoc import bench_command, machine_description, replace_section
from loadtest.procs import ChildProcess, free_port, process_cpu_s
from loadtest.sse import StreamReader
from loadtest.stats import percentile
from loadtest.workloads import build_workload


def host_busy_seconds() -> tuple[float, float]:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values) - idle) / os.sysconf("SC_CLK_TCK"), sum(values) / os.sysconf("SC_CLK_TCK")


async def send_all(urls: list[str], specs, rate: float, duration_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records: list[dict] = []
    started = time.monotonic()
    tasks = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
        offset = 0.0
        for i, spec in enumerate(specs):
            offset += rng.expovariate(rate)
            if offset > duration_s:
                break
            delay = started + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, urls[i % len(urls)], spec, records)))
        await asyncio.gather(*tasks)
    return records


async def _one(client: httpx.AsyncClient, url: str, spec, records: list[dict]) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": spec.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    body.update({"messages": list(spec.messages)} if spec.kind == "chat" else {"prompt": spec.prompt})
    path = "/v1/chat/completions" if spec.kind == "chat" else "/v1/completions"
    reader = StreamReader(time.monotonic)
    sent = time.monotonic()
    status = 0
    try:
        async with client.stream("POST", url + path, json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                reader.feed_line(line)
    except httpx.HTTPError:
        status = -1
    ttft = reader.content_times_s[0] - sent if reader.content_times_s else None
    records.append({"status": status, "ttft_s": ttft, "e2e_s": time.monotonic() - sent, "usage": reader.usage})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench sim-fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rate", type=float, default=16.0, help="requests/s to the whole fleet")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-doc", action="store_true", help="don't write docs/benchmarks.md")
    args = parser.parse_args(argv)
    _, specs = build_workload("multi_tenant_long_prefix", args.seed, {"num_requests": str(int(args.rate * args.duration_s) + 50)})
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-simfleet-"))
    workers = []
    try:
        for i in range(args.workers):
            port = free_port()
            argv_worker = [sys.executable, "-m", "kvgate", "worker", "--model", "default", "--executor", "sim",
                           "--port", str(port), "--worker-id", f"w{i}"]
            workers.append(ChildProcess(f"w{i}", argv_worker, workdir / f"w{i}.log", f"http://127.0.0.1:{port}/health"))
        for worker in workers:
            worker.wait_healthy(180)
        urls = [w.health_url.removesuffix("/health") for w in workers]
        cpu_before = [process_cpu_s(w.popen.pid) for w in workers]
        busy_before, total_before = host_busy_seconds()
        self_before = time.process_time()
        wall_started = time.monotonic()
        records = asyncio.run(send_all(urls, specs, args.rate, args.duration_s, args.seed))
        wall_s = time.monotonic() - wall_started
        cpu_after = [process_cpu_s(w.popen.pid) for w in workers]
        driver_cores = (time.process_time() - self_before) / wall_s
        busy_after, total_after = host_busy_seconds()
    finally:
        for worker in workers:
            worker.stop()
    result = _summarize(args, records, wall_s, cpu_before, cpu_after, busy_after - busy_before,
                        total_after - total_before)
    result["driver_cpu_cores"] = round(driver_cores, 3)
    print(json.dumps(result, indent=2))
    Path("results").mkdir(exist_ok=True)
    Path("results/bench_sim_fleet.json").write_text(json.dumps(result, indent=2))
    if not args.no_doc:
        replace_section("sim-fleet", _markdown(result, argv if argv is not None else sys.argv[1:]))
    return 0


def _summarize(args, records, wall_s, cpu_before, cpu_after, host_busy_s, host_total_s) -> dict:
    per_worker = [(a - b) / wall_s for a, b in zip(cpu_after, cpu_before)]
    ok = [r for r in records if r["status"] == 200]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "workers": args.workers, "target_rate_rps": args.rate, "duration_s": round(wall_s, 1),
        "requests": len(records), "ok": len(ok), "achieved_rps": round(len(ok) / wall_s, 2),
        "cpu_per_worker_cores_mean": round(statistics.mean(per_worker), 4),
        "cpu_per_worker_cores_max": round(max(per_worker), 4),
        "fleet_cpu_cores": round(sum(per_worker), 3),
        "host_busy_fraction": round(host_busy_s / host_total_s, 3) if host_total_s else None,
        "host_cores": os.cpu_count(),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4) if ttfts else None,
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4) if ttfts else None,
        "prompt_tokens_mean": round(statistics.mean(r["usage"]["prompt_tokens"] for r in ok if r["usage"]), 1)
        if ok else None,
        "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _markdown(r: dict, argv: list[str]) -> str:
    fleet_share = r["fleet_cpu_cores"] / r["host_cores"]
    verdict = "yes" if fleet_share < 0.5 and r["ok"] == r["requests"] else "no"
    return "\n".join([
        "### Simulated fleet: host cost (`sim` executor, default timing)",
        "",
        f"Command: `{bench_command('sim-fleet', argv)}`",
        "",
        f"Machine: {machine_description()}; run {r['created_at']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| sim workers | {r['workers']} |",
        f"| offered rate (multi-tenant long prefix, ~{r['prompt_tokens_mean']} prompt tokens) | {r['target_rate_rps']} req/s |",
        f"| completed | {r['ok']} of {r['requests']} ({r['achieved_rps']} req/s) |",
        f"| CPU per simulated worker | {r['cpu_per_worker_cores_mean'] * 100:.1f}% of a core (max {r['cpu_per_worker_cores_max'] * 100:.1f}%) |",
        f"| whole fleet | {r['fleet_cpu_cores']:.2f} of {r['host_cores']} cores ({fleet_share * 100:.0f}%) |",
        f"| load generator | {r['driver_cpu_cores']:.2f} cores |",
        f"| host busy (every process on the machine, which is shared) | {r['host_busy_fraction'] * 100:.0f}% |",
        f"| TTFT p50 / p90 | {r['ttft_p50_s']} s / {r['ttft_p90_s']} s |",
        f"| host CPU not the bottleneck (fleet < 50% of the cores, no errors) | {verdict} |",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
