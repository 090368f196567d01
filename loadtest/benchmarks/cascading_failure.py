"""A cascading failure on a two-pool `sim` fleet (issue #50, "Move the work"): healthy; one primary worker
degraded (restarted 5x slower); a second one killed; both back, restarted cold. The same seeded open-loop
load (0.9 of the primary pool's capacity measured at the start, tenants of different priorities, the
`openai` SDK with its default retries) goes through (a) kvgate with fallbacks to the small pool and slow
start, (b) kvgate without fallbacks, (c) SGLang's router (cache_aware, the primary pool only) and (d) LiteLLM
with its fallbacks to the small model, each on a fresh fleet.

    kvgate bench cascading-failure [--quick] [--phase-s S] [--configs a,b,c,d] [--no-doc]

Writes results/bench_cascading_failure.json and the `cascading-failure` section of docs/benchmarks.md.
The harness: loadtest/cascade/ (phases, workload, clients, fleet, routers, run, figures, analysis).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from loadtest.benchdoc import bench_command, machine_description, number, replace_section, save_result
from loadtest.cascade.analysis import analyse
from loadtest.cascade.capacity import pool_capacity_rps
from loadtest.cascade.figures import capacity_left_rps
from loadtest.cascade.fleet import PRIMARY, SMALL, CascadeFleet, FleetShape, sim_timing
from loadtest.cascade.phases import PHASES, PhasePlan
from loadtest.cascade.run import ConfigSpec, RunSettings, run_config
from loadtest.cascade.workload import DEFAULT_TENANTS, RequestShape, build_arrivals
from loadtest.paths import RESULTS_DIR
from loadtest.peers import LITELLM, SGLANG_ROUTER, VenvPeer

SECTION = "cascading-failure"
CONFIGS = {"a": ConfigSpec("kvgate-fallbacks", "kvgate", True), "b": ConfigSpec("kvgate-no-fallbacks", "kvgate"),
           "c": ConfigSpec("sglang-cache_aware", "sglang"), "d": ConfigSpec("litellm-fallbacks", "litellm", True)}
PEERS: dict[str, VenvPeer] = {"sglang": SGLANG_ROUTER, "litellm": LITELLM}
GOODPUT_OF_LEFT, MAX_RETRY_SHARE, TWO_DOWN_RATIO, RETURNING_OF_STEADY, RECOVERY_P99_RATIO = 0.9, 0.1, 1.5, 0.5, 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvgate bench cascading-failure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 s phases (a smoke test of ~15 minutes)")
    p.add_argument("--phase-s", type=float, default=None, help="each phase's length (default 120, quick 40)")
    p.add_argument("--down-s", type=float, default=5.0, help="the degraded worker's time down before both restart")
    p.add_argument("--slow-factor", type=float, default=5.0, help="how much slower the degraded worker runs")
    p.add_argument("--load", type=float, default=0.9, help="offered load, as a share of the primary pool's capacity")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput counts answers within this TTFT")
    p.add_argument("--slow-start-s", type=float, default=30.0, help="kvgate's pools.<name>.slow_start_s")
    p.add_argument("--probe-s", type=float, default=None, help="the capacity probe (default 15, quick 8)")
    p.add_argument("--configs", default="a,b,c,d", help="which of a (kvgate fallbacks), b (kvgate, none), "
                   "c (sglang-router), d (LiteLLM) to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pin", action="store_true", help="do not pin the router to one CPU and the rest to the others")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_cascading_failure.json")
    p.add_argument("--from-json", type=Path, default=None, help="no runs: judge a saved result and write its section")
    args = p.parse_args(argv)
    args.phase_s = args.phase_s or (40.0 if args.quick else 120.0)
    args.probe_s = args.probe_s or (8.0 if args.quick else 15.0)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)} (known: {', '.join(CONFIGS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return publish(json.loads(args.from_json.read_text()), None, args.no_doc)
    return publish(measure(args, sys.argv[1:] if argv is None else argv), args.out, args.no_doc)


def measure(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """The capacity probe, then every configuration asked for on a fresh fleet: the result JSON."""
    plan = PhasePlan(args.phase_s, args.slow_factor, args.down_s)
    shape, request = FleetShape(), RequestShape()
    keys = {t.name: f"kvg-cascade-{t.name}-{os.urandom(8).hex()}" for t in DEFAULT_TENANTS}
    settings = RunSettings(shape, plan, DEFAULT_TENANTS, keys, args.slow_start_s, request.max_tokens)
    own = os.sched_getaffinity(0)
    router_cpus = {min(own)} if not args.no_pin and len(own) > 1 else None
    fleet_cpus = own - router_cpus if router_cpus else None
    work_dir = RESULTS_DIR / SECTION
    shutil.rmtree(work_dir, ignore_errors=True)
    if fleet_cpus:
        os.sched_setaffinity(0, fleet_cpus)  # the load generator beside the workers, off the router's CPU
    try:
        with CascadeFleet(work_dir / "probe", shape, fleet_cpus) as fleet:
            capacity = pool_capacity_rps(list(fleet.specs.values()), request, shape.max_num_seqs, args.probe_s,
                                         min(2.0, args.probe_s / 4))
        primary_rps = sum(capacity[w.name] for w in fleet.pool_workers(PRIMARY))
        arrivals = build_arrivals(DEFAULT_TENANTS, args.load * primary_rps, plan.total_s, request, args.seed)
        print(f"primary {primary_rps:.2f} req/s; offering {args.load * primary_rps:.2f} req/s", file=sys.stderr)
        runs, not_measured = {}, {}
        for key in args.configs.split(","):
            spec = CONFIGS[key]
            peer = PEERS.get(spec.kind)
            if peer is not None and not peer.present():
                not_measured[spec.name] = f"{peer.name} is not installed (install: {peer.install})"
                continue
            print(f"running {spec.name}", file=sys.stderr)
            runs[spec.name] = run_config(spec, settings, arrivals, work_dir / spec.name, router_cpus, fleet_cpus)
    finally:
        os.sched_setaffinity(0, own)
    return {"benchmark": SECTION, "command": bench_command(SECTION, argv), "machine": machine_description(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "pinned": router_cpus is not None,
            "settings": {"phase_s": plan.phase_s, "down_s": plan.down_s, "slow_factor": plan.slow_factor,
                         "load": args.load, "slo_ttft_ms": args.slo_ttft_ms, "slow_start_s": args.slow_start_s,
                         "probe_s": args.probe_s, "seed": args.seed, "quick": args.quick,
                         "primary_timing": sim_timing(shape.primary_scale), "small_timing": sim_timing(shape.small_scale),
                         "max_num_seqs": shape.max_num_seqs, "request": dataclasses.asdict(request),
                         "tenants": [[t.name, t.priority, t.share] for t in DEFAULT_TENANTS]},
            "capacity": capacity, "offered_rps": args.load * primary_rps, "num_calls": len(arrivals),
            "peers": {p.name: p.version() for p in PEERS.values()}, "not_measured": not_measured, "runs": runs}


def plan_of(result: Mapping[str, Any]) -> PhasePlan:
    s = result["settings"]
    return PhasePlan(s["phase_s"], s["slow_factor"], s["down_s"])


def analyses(result: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    s, plan = result["settings"], plan_of(result)
    primary = [w for w in result["capacity"] if w.startswith("p")]
    return {name: analyse(run, plan, s["slo_ttft_ms"], s["slow_start_s"], len(primary))
            for name, run in result["runs"].items()}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One target of the issue: what was measured against what it must reach; passed None: not measured."""

    target: str
    figure: str
    passed: bool | None

    @property
    def word(self) -> str:
        return "not measured" if self.passed is None else ("pass" if self.passed else "FAIL")


def capacity_left(result: Mapping[str, Any]) -> dict[str, float]:
    """phase -> the req/s both pools can still serve (figures.capacity_left_rps on the probe's figures)."""
    cap, plan = result["capacity"], plan_of(result)
    workers = {w: rps for w, rps in cap.items() if w.startswith("p")}
    small = sum(rps for w, rps in cap.items() if w.startswith("s"))
    return {phase: capacity_left_rps(phase, plan, workers, small) for phase in PHASES}


def judge(result: Mapping[str, Any], found: Mapping[str, Mapping[str, Any]]) -> list[Verdict]:
    """The issue's targets for (a), one row each (a phase, a returning worker)."""
    a, b = found.get(CONFIGS["a"].name), found.get(CONFIGS["b"].name)
    if a is None:
        return [Verdict("(a) kvgate with fallbacks", "not run", None)]
    left, phases = capacity_left(result), {f["phase"]: f for f in a["phases"]}
    rows = []
    for phase, f in phases.items():
        need = GOODPUT_OF_LEFT * min(f["offered_rps"], left[phase])
        rows.append(Verdict(f"(a) goodput in {phase} >= {GOODPUT_OF_LEFT:.0%} of min(offered, capacity left)",
                            f"{f['goodput_rps']:.2f} vs {need:.2f} req/s", f["goodput_rps"] >= need))
    worst = max(phases.values(), key=lambda f: f["retry_share"] or 0.0)
    rows.append(Verdict(f"(a) client retries <= {MAX_RETRY_SHARE:.0%} of offered in every phase",
                        f"worst {worst['phase']}: {worst['retry_share'] or 0:.1%}",
                        all((f["retry_share"] or 0.0) <= MAX_RETRY_SHARE for f in phases.values())))
    a2 = phases["two-down"]["goodput_rps"]
    b2 = next((f["goodput_rps"] for f in b["phases"] if f["phase"] == "two-down"), None) if b else None
    rows.append(Verdict(f"(a) >= {TWO_DOWN_RATIO:g}x (b)'s goodput with two primary workers down",
                        "(b) not run" if b2 is None else f"{a2:.2f} / {b2:.2f} = " + (f"{a2 / b2:.2f}x" if b2 else "inf"),
                        None if b2 is None else (b2 == 0 or a2 / b2 >= TWO_DOWN_RATIO)))
    for worker, w in a["returning"].get("workers", {}).items():
        steady, first = w["steady_share"], w["first_third_share"]
        rows.append(Verdict(f"(a) returning {worker}: first third of slow_start_s <= {RETURNING_OF_STEADY:g} x its "
                            "steady share", f"{_pct(first)} vs {_pct(steady)} steady",
                            None if first is None or steady is None else first <= RETURNING_OF_STEADY * steady))
    healthy, recovery = phases["healthy"]["primary_ttft_p99_ms"], phases["recovery"]["primary_ttft_p99_ms"]
    rows.append(Verdict(f"(a) primary pool's TTFT p99 in recovery <= {RECOVERY_P99_RATIO:g}x healthy",
                        f"{number(recovery, 0)} vs {number(healthy, 0)} ms",
                        None if healthy is None or recovery is None else recovery <= RECOVERY_P99_RATIO * healthy))
    return rows


def publish(result: dict[str, Any], out: Path | None, no_doc: bool) -> int:
    found = analyses(result)
    rows = judge(result, found)
    if out is not None:
        save_result(out, {**result, "analysis": found, "judged": [[r.target, r.figure, r.word] for r in rows]})
    markdown = section_markdown(result, found, rows)
    print(markdown)
    if not no_doc:
        replace_section(SECTION, markdown)
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None) -> str:
    return number(value, 0)


def _moves(f: Mapping[str, Any]) -> str:
    if "fallbacks" not in f:
        return "-"
    return ", ".join(f"{reason} {n:.0f}" for reason, n in f["fallbacks"].items()) or "0"


def section_markdown(result: Mapping[str, Any], found: Mapping[str, Mapping[str, Any]],
                     rows: Sequence[Verdict]) -> str:
    """The `cascading-failure` section of docs/benchmarks.md."""
    s, cap, left = result["settings"], result["capacity"], capacity_left(result)
    primary = {w: r for w, r in cap.items() if w.startswith("p")}
    small = {w: r for w, r in cap.items() if w.startswith("s")}
    peers = result["peers"]
    lines = [
        "### Cascading failure: fallbacks and slow start (`sim` executor)", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {result['machine']}; run {result['date']}"
        + (" (each router pinned to one CPU; workers and clients on the other)." if result["pinned"] else "."), "",
        f"Fleet: pool `{PRIMARY}` = {len(primary)} sim workers serving `big-model` (`{s['primary_timing'].split(',')[0]}`),"
        f" pool `{SMALL}` = {len(small)} serving `small-model`, twice as fast (`{s['small_timing'].split(',')[0]}`); "
        f"each runs {s['max_num_seqs']} requests at once. Capacity at the start (closed loops straight at each "
        f"worker, {s['probe_s']:g} s): primary {sum(primary.values()):.2f} req/s "
        f"({', '.join(f'{w} {r:.2f}' for w, r in primary.items())}), small {sum(small.values()):.2f} req/s.",
        "",
        f"Load: {result['offered_rps']:.2f} req/s offered ({s['load']:g} x the primary pool's capacity), open loop, "
        f"Poisson per tenant ({', '.join(f'{n} {p} {sh:.0%}' for n, p, sh in s['tenants'])}; priorities from kvgate's "
        f"tenant config), {result['num_calls']} calls in all, the same for every configuration; streamed chat, "
        f"each prompt one of its tenant's {s['request']['prefixes_per_tenant']} system prompts "
        f"(~{s['request']['system_tokens']} tokens) and a question of its own, {s['request']['max_tokens']} output "
        "tokens; the `openai` SDK with its default retries (max_retries=2, Retry-After honoured), its requests counted "
        "per call by a hook on its HTTP client.", "",
        f"Phases of {s['phase_s']:g} s: healthy; p0 degraded (SIGKILLed and restarted at once with every sim "
        f"coefficient x{s['slow_factor']:g}); p1 killed (SIGKILL); p0 taken down and both restarted cold "
        f"{s['down_s']:g} s later. Goodput: calls answered with TTFT <= {s['slo_ttft_ms']:g} ms, counted from the "
        "call's start (the SDK's retries and their waits included), per second of the phase; calls belong to the "
        "phase they arrive in. Capacity left: each worker's probed capacity, the degraded one at "
        f"1/{s['slow_factor']:g} of it, the killed one at 0, plus the small pool.", "",
        "Configurations: (a) `kvgate-fallbacks`: kvgate (kv_aware, admission at what the workers run) with "
        "`pools.primary.fallbacks: [{pool: small, when: [overloaded, unavailable]}]` and "
        f"`slow_start_s: {s['slow_start_s']:g}`; (b) `kvgate-no-fallbacks`: the same without fallbacks; "
        f"(c) `sglang-cache_aware`: sglang-router {peers.get(SGLANG_ROUTER.name) or '(not installed)'} cache_aware "
        f"in front of the primary pool only; (d) `litellm-fallbacks`: LiteLLM {peers.get(LITELLM.name) or '(not installed)'}"
        ", a deployment per worker, `router_settings: {fallbacks: [{big-model: [small-model]}]}`, its defaults "
        "otherwise. Each on a fresh fleet.",
    ]
    lines += [f"- not measured: {name}: {why}" for name, why in result["not_measured"].items()]
    lines += ["", "| configuration | phase | offered / s | capacity left / s | goodput / s | errors | client retries "
              "(share of offered) | moved to small (kvgate, by reason) | answered by small | TTFT p50 / p99 ms | "
              "primary pool's TTFT p99 ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in found.items():
        for f in a["phases"]:
            by_small = sum(n for pool, n in f["served_by"].items() if pool in (SMALL, "small-model"))
            lines.append(f"| {name} | {f['phase']} | {f['offered_rps']:.2f} | {left[f['phase']]:.2f} | "
                         f"{f['goodput_rps']:.2f} | {f['errors']} | {f['retries']} ({_pct(f['retry_share'])}) | "
                         f"{_moves(f)} | {by_small} | {_ms(f['ttft_p50_ms'])} / {_ms(f['ttft_p99_ms'])} | "
                         f"{_ms(f['primary_ttft_p99_ms'])} |")
    lines += _recovery_lines(found) + _returning_lines(found, s["slow_start_s"])
    lines += ["", "Targets (issue #50) for (a); (b), (c) and (d) are reported beside it above:", "",
              "| target | measured | result |", "|---|---|---|"]
    lines += [f"| {r.target} | {r.figure} | {r.word} |" for r in rows]
    return "\n".join(lines)


def _recovery_lines(found: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = ["", "Recovery: seconds from each fault (for the return: from when the restarted workers answered) to the "
             "first 5 s window, sliding by 1 s within the phase, whose share of calls answered within the SLO is back "
             "to >= 90% of the healthy phase's; - = not back before the phase ended.", ""]
    events = [e["event"] for e in next(iter(found.values()), {}).get("recovery", [])]
    lines += ["| configuration | " + " | ".join(events) + " |", "|---" * (len(events) + 1) + "|"]
    for name, a in found.items():
        lines.append(f"| {name} | " + " | ".join(number(e["recovery_s"], 0) for e in a["recovery"]) + " |")
    return lines


def _returning_lines(found: Mapping[str, Mapping[str, Any]], slow_start_s: float) -> list[str]:
    lines = ["", f"Returning workers: the share of the primary pool's new calls each took over the first third "
             f"({slow_start_s / 3:g} s) and the whole of slow_start_s ({slow_start_s:g} s) from when it was back in "
             "rotation (kvgate: first listed warming in /ready; otherwise when it answered again), by x-kvgate-worker, "
             "beside its share in the healthy phase; for routers that name no worker, each primary worker's share of "
             "the requests the primary workers finished meanwhile (their /metrics; steady: an equal share).", "",
             "| configuration | worker | back in rotation at s | first third | whole window | steady |",
             "|---|---|---|---|---|---|"]
    for name, a in found.items():
        ret = a["returning"]
        for worker, w in ret.get("workers", {}).items():
            if w["first_third_requests"]:
                lines.append(f"| {name} | {worker} | {w['since_s']:.1f} | {_pct(w['first_third_share'])} | "
                             f"{_pct(w['window_share'])} | {_pct(w['steady_share'])} |")
            else:
                shares = ret.get("finished_shares", {})
                first, whole = shares.get("first_third") or {}, shares.get("window") or {}
                lines.append(f"| {name} | {worker} | {w['since_s']:.1f} | {_pct(first.get(worker))} (finished) | "
                             f"{_pct(whole.get(worker))} (finished) | {_pct(shares.get('steady'))} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
