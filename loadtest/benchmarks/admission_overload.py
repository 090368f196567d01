"""Admission under overload, on a `sim` fleet: capacity C, then 2x, 5x and 10x C offered; a critical
tenant, a fair-share tenant and a light one (issue #50: 0.35x C, its loss and the share of refusals
decided at arrival) beside a flood; deadlines; the gateway's RSS. Every scenario runs through a gateway
with admission and one with admission off, in the same run, as ratios to C.

    kvgate bench admission-overload [--quick] [--no-doc]

Writes results/bench_overload.json and the `admission-overload` section of docs/benchmarks.md.
The pieces: loadtest/overload/: fleet.py (processes), scenarios.py (what is offered, the figures),
probe.py (the client side of a run), report.py (targets, the section).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.benchdoc import bench_command, machine_description, replace_section
from loadtest.driver import DriverConfig
from loadtest.overload.fleet import ADMISSION_OFF, GatewayVariant, OverloadFleet, SIM_TIMING_X4, TenantSpec
from loadtest.overload.metrics import GaugeSampler, queue_wait_by_priority, summarize_gauges
from loadtest.overload.probe import drive
from loadtest.overload.report import OFF, ON, judge, section_markdown
from loadtest.overload.scenarios import (RequestShape, Scenario, build_specs, capacity_rps, closed_loop_specs,
                                         deadline_figures, default_scenarios, in_window, marker_name, rss_growth,
                                         tenant_figures)
from loadtest.paths import RESULTS_DIR, ROOT
from loadtest.procs import process_cpu_s
from loadtest.recording_proxy import fetch_arrivals
from loadtest.slo import Slo, stats

SECTION = "admission-overload"
TENANTS = {"std-a": TenantSpec("std-a"), "std-b": TenantSpec("std-b"), "crit": TenantSpec("crit", "critical")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate bench admission-overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs (a smoke test, not figures to publish)")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    p.add_argument("--duration-s", type=float, default=None, help="each open-loop run (default 20, quick 3)")
    p.add_argument("--warmup-s", type=float, default=None, help="not counted at a run's start (default 3, quick 1)")
    p.add_argument("--capacity-duration-s", type=float, default=None, help="the closed-loop run (default 20, quick 4)")
    p.add_argument("--capacity-concurrency", type=int, default=32, help="requests in flight when measuring C")
    p.add_argument("--drain-timeout-s", type=float, default=None, help="after a run, for those in flight (default 8, quick 2)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput counts answers within this TTFT")
    p.add_argument("--levels", default="2,5,10", help="overload levels for one tenant, as multiples of C")
    p.add_argument("--deadline-ms", type=float, default=1000.0, help="x-request-deadline-ms in the deadline run")
    p.add_argument("--scenarios", default=None, help="only these scenarios (comma-separated names)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the gateways to one CPU and the workers, proxy and load generator to the others")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_overload.json")
    p.add_argument("--from-json", type=Path, default=None,
                   help="no runs: judge a saved result again and write its section (unless --no-doc)")
    args = p.parse_args(argv)
    quick = args.quick
    args.duration_s = args.duration_s or (3.0 if quick else 20.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (1.0 if quick else 3.0)
    args.capacity_duration_s = args.capacity_duration_s or (4.0 if quick else 20.0)
    args.drain_timeout_s = args.drain_timeout_s if args.drain_timeout_s is not None else (2.0 if quick else 8.0)
    args.levels = [float(v) for v in args.levels.split(",") if v]
    if args.warmup_s >= min(args.duration_s, args.capacity_duration_s):
        p.error("--warmup-s must be shorter than every run")
    return args


def chosen_scenarios(args: argparse.Namespace) -> list[Scenario]:
    scenarios = default_scenarios(args.levels, deadline_ms=args.deadline_ms)
    if args.scenarios:
        names = args.scenarios.split(",")
        unknown = set(names) - {s.name for s in scenarios}
        if unknown:
            raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(s.name for s in scenarios)})")
        scenarios = [s for s in scenarios if s.name in names]
    return scenarios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return publish(json.loads(args.from_json.read_text()), None, args.no_doc)
    scenarios = chosen_scenarios(args)
    keys = {name: f"kvg-bench-{name}-{secrets.token_hex(8)}" for name in TENANTS}
    variants = (GatewayVariant(ON), GatewayVariant(OFF, ADMISSION_OFF))
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp, \
            OverloadFleet(Path(tmp), TENANTS, keys, variants, pin=not args.no_pin) as fleet:
        bench = _Bench(args, fleet, keys)
        capacity = {v.name: bench.capacity(v.name) for v in variants}
        c_rps = capacity[ON]["rps"]
        print(f"C = {c_rps:.2f} req/s (no-admission: {capacity[OFF]['rps']:.2f})", file=sys.stderr)
        runs, rss = bench.overload(scenarios, c_rps)
        pin = fleet.pin
    result = {
        "benchmark": SECTION, "command": _command(argv), "machine": machine_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "python": sys.version.split()[0],
        "settings": _settings(args, pin), "load_average": {"start": load_start, "end": os.getloadavg()},
        "capacity": capacity, "c_rps": c_rps, "runs": [r for r, _ in runs], "rss": rss,
        "out_path": _display_path(args.out), "records": {f"{r['scenario']}/{r['variant']}": recs for r, recs in runs},
    }
    return publish(result, args.out, args.no_doc)


def publish(result: dict[str, Any], out: Path | None, no_doc: bool) -> int:
    """Judge the result, write it to out (when given), print the section and put it in docs/benchmarks.md."""
    rows = judge(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "judged": [{**dataclasses.asdict(r), "result": r.verdict} for r in rows]},
                                  indent=1))
    markdown = section_markdown(result, rows)
    print(markdown)
    if not no_doc:
        replace_section(SECTION, markdown)
    return 0


class _Bench:
    """Runs the closed-loop capacity run and the scenarios against a started OverloadFleet."""

    def __init__(self, args: argparse.Namespace, fleet: OverloadFleet, keys: dict[str, str]) -> None:
        self.args, self.fleet, self.keys = args, fleet, keys
        self.slo = Slo(ttft_ms=args.slo_ttft_ms)
        self.shape = RequestShape()

    def _driver(self, variant: str, **kwargs: Any) -> DriverConfig:
        return DriverConfig(base_url=self.fleet.gateway_urls[variant], model=self.fleet.model,
                            drain_timeout_s=self.args.drain_timeout_s, request_timeout_s=120.0,
                            tenant_api_keys=self.keys, progress=False, **kwargs)

    def capacity(self, variant: str) -> dict[str, Any]:
        """Answered req/s in a closed loop of one standard tenant (refusals are re-sent at once)."""
        duration_s = self.args.capacity_duration_s
        count = int(duration_s * 500) + 1000  # more than a closed loop sends, refusals re-sent included
        specs = closed_loop_specs(count, "std-a", self.shape, f"capacity-{variant}")
        run, _ = drive(specs, self._driver(variant, concurrency=self.args.capacity_concurrency, duration_s=duration_s))
        if len(run.records) == count:
            raise RuntimeError(f"the closed loop through {variant} sent all {count} requests before "
                               f"{duration_s:g} s: C would be cut short")
        self.fleet.quiesce()
        answered = [r for r in run.records if r.ok]
        return {"rps": capacity_rps(run.records, self.args.warmup_s, duration_s),
                "ttft_ms": stats([r.ttft_ms for r in answered if r.ttft_ms is not None]),
                "refused": sum(1 for r in run.records if r.status in (429, 503)), "answered": len(answered),
                "errors": sorted({r.error for r in run.records if r.error})}

    def overload(self, scenarios: list[Scenario], c_rps: float) -> tuple[list[tuple[dict, list]], dict[str, Any]]:
        """Each scenario through both gateways (alternating which goes first); RSS before, after each run."""
        rss_samples = {v: [("start", self.fleet.gateway_rss_kib(v))] for v in (ON, OFF)}
        runs = []
        for i, scenario in enumerate(scenarios):
            for variant in ((ON, OFF) if i % 2 == 0 else (OFF, ON)):
                runs.append(self.one_run(scenario, variant, c_rps))
                rss_samples[variant].append((f"after {scenario.name}", self.fleet.gateway_rss_kib(variant)))
        return runs, {v: rss_growth(s) for v, s in rss_samples.items()}

    def one_run(self, scenario: Scenario, variant: str, c_rps: float) -> tuple[dict[str, Any], list[dict]]:
        args, tag = self.args, f"{scenario.name}-{variant}"
        duration_s = args.duration_s * scenario.duration_x
        specs = build_specs(scenario, c_rps, duration_s, self.shape, tag, args.seed)
        headers = {} if scenario.deadline_ms is None else {"x-request-deadline-ms": f"{scenario.deadline_ms:g}"}
        pid, metrics_url = self.fleet.gateway_pid(variant), f"{self.fleet.gateway_urls[variant]}/metrics"
        metrics_before, sampler = _scrape(metrics_url), GaugeSampler(metrics_url).start()
        cpu_before, wall_before = process_cpu_s(pid), time.monotonic()
        run, probe = drive(specs, self._driver(variant, duration_s=duration_s), headers)
        cpu_share = (process_cpu_s(pid) - cpu_before) / (time.monotonic() - wall_before)
        gauges, queue_wait = sampler.stop(), queue_wait_by_priority(metrics_before, _scrape(metrics_url))
        quiesce_s = self.fleet.quiesce()
        codes = {s.index: probe.codes.get(marker_name(tag, s.index)) for s in specs}
        server_ms = {s.index: probe.server_ms.get(marker_name(tag, s.index)) for s in specs}
        window_s = duration_s - args.warmup_s
        tenants = {o.tenant: tenant_figures(in_window(run.records, args.warmup_s, duration_s, o.tenant),
                                            codes, self.slo, window_s, server_ms) for o in scenario.offers}
        summary = {"scenario": scenario.name, "variant": variant,
                   "offers": [[o.tenant, o.load_x_c] for o in scenario.offers], "deadline_ms": scenario.deadline_ms,
                   "duration_s": duration_s, "window_s": window_s, "tenants": tenants,
                   "gateway_cpu_share": cpu_share, "quiesce_s": quiesce_s, "sent": len(run.records),
                   "gauges": summarize_gauges(gauges), "queue_wait": queue_wait, "gauge_samples": gauges}
        if scenario.deadline_ms is not None:
            summary["deadline"] = deadline_figures(probe.sent_s, fetch_arrivals(self.fleet.proxy_url),
                                                   scenario.deadline_ms, run.records)
        print(f"{tag}: " + ", ".join(f"{t} goodput/C {f['goodput_rps'] / c_rps:.2f} refused {f['refused']}"
                                     for t, f in tenants.items()), file=sys.stderr)
        records = [{**r.to_json(), "code": codes.get(r.index), "server_ms": server_ms.get(r.index), "itl_ms": None}
                   for r in run.records]
        return summary, records


def _scrape(metrics_url: str) -> str:
    return httpx.get(metrics_url, timeout=10.0).text


def _settings(args: argparse.Namespace, pin: bool) -> dict[str, Any]:
    shape = RequestShape()
    return {"duration_s": args.duration_s, "warmup_s": args.warmup_s, "capacity_duration_s": args.capacity_duration_s,
            "capacity_concurrency": args.capacity_concurrency, "drain_timeout_s": args.drain_timeout_s,
            "slo_ttft_ms": args.slo_ttft_ms, "levels": args.levels, "deadline_ms": args.deadline_ms,
            "quick": args.quick, "seed": args.seed, "pin": pin, "num_workers": 2, "sim_timing": SIM_TIMING_X4,
            "sim_timing_name": SIM_TIMING_X4.split(",", 1)[0].removeprefix("name="),
            "admission_off": ADMISSION_OFF, "prompt_words": shape.prompt_words, "max_tokens": shape.max_tokens}


def _command(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return bench_command("admission-overload", args)


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
