"""`kvgate bench ARGS...` / `python -m loadtest ARGS...`: the run, fleet and report subcommands, `list` (the
benchmarks: loadtest/benchmarks/__init__.py), and `NAME [ARGS...]`, which hands ARGS to benchmark NAME."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence, TYPE_CHECKING

from loadtest import benchmarks
from loadtest.driver import DriverConfig
from loadtest.engines import ENGINES, worker_block_size
from loadtest.external_router import parse_external_command
from loadtest.faults import parse_fault
from loadtest.oracle import DEFAULT_ORACLE_BLOCK_SIZE, oracle_hit_rate
from loadtest.peers import sglang
from loadtest.report import comparison_table, load_result, write_benchmarks_section, write_report, write_result
from loadtest.runner import RunPlan, execute
from loadtest.slo import Slo
from loadtest.workloads import WORKLOADS, build_workload

if TYPE_CHECKING:
    from loadtest.fleet import FleetConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate bench", description="kvgate load tests and benchmarks.",
                                     epilog="`kvgate bench SUBCOMMAND --help` lists a subcommand's options; "
                                     "`kvgate bench list` the benchmarks (" + ", ".join(benchmarks.BY_NAME)
                                     + "), and `kvgate bench NAME --help` one benchmark's.")
    sub = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    run = _add_subcommand(sub, "run", "one workload against an OpenAI-compatible URL; exits 1 when no "
                          "request succeeded")
    run.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    run.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    run.add_argument("--model", required=True, help="the `model` field to send")
    run.add_argument("--name", default="run", help="name of this run in reports (default: run)")
    fleet = _add_subcommand(sub, "fleet", "start workers (sim, the bundled torch worker or vLLM), compare routing "
                            "policies (and external routers) over them")
    fleet.add_argument("--engine", choices=ENGINES, default="sim",
                       help="sim: `kvgate worker --executor sim` (default); kvgate: `kvgate worker` (torch); vllm: "
                            "vLLM's CPU build (installed into results/vllm-venv when missing); real engines are "
                            "pinned one per CPU")
    fleet.add_argument("--workers", type=int, default=4, help="number of workers (default: 4)")
    fleet.add_argument("--num-blocks", type=int, metavar="N",
                       help="KV blocks per worker (vLLM: --num-gpu-blocks-override); the gateway's index is capped "
                            "to it (default: the engine's own)")
    fleet.add_argument("--policies", default="round_robin,kv_aware", help="comma-separated policy types ('' for none)")
    fleet.add_argument("--external", action="append", default=[], metavar="NAME=URL",
                       help="also run through another router at URL (repeatable); it must front this run's "
                            "workers (see --base-port), which restart between runs")
    fleet.add_argument("--external-command", action="append", default=[], metavar="NAME=COMMAND",
                       help="also run through a router this run starts over its workers (repeatable): COMMAND "
                            "with {worker_urls} (one word per worker URL), {port} and {metrics_port} filled in, "
                            f"e.g. '{sglang.external_command('cache_aware').command}'")
    fleet.add_argument("--api-key", help="API key for --external routers")
    fleet.add_argument("--model", help="model name to send (default: what the workers serve)")
    fleet.add_argument("--fault", action="append", default=[], metavar="SPEC",
                       help="e.g. kill:w1@10, slow:w1@5-15:delay_ms=500, error:w2@5-15:fraction=0.5, redis@10")
    fleet.add_argument("--worker-model", default="default",
                       help="each worker's model: default (SmolLM2-135M-Instruct) or an HF model folder")
    fleet.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                       help="extra worker argument (repeatable; vLLM's own with --engine vllm), e.g. "
                            "--worker-arg=--sim-timing=...")
    fleet.add_argument("--gateway-replicas", default="1", metavar="N[,N...]",
                       help="run each policy with N gateway replicas behind a round-robin nginx, for each N "
                       "(default: 1)")
    fleet.add_argument("--replicas-share", default="redis", metavar="redis|nothing|both",
                       help="with --gateway-replicas N > 1: the replicas share routing decisions, breakers and "
                       "limits through a redis-server the run starts (redis, the default), run each on its own "
                       "state (nothing), or both, one run each (the second named ...-unshared)")
    fleet.add_argument("--base-port", type=int, help="fixed ports from here (see loadtest/fleet.py)")
    fleet.add_argument("--gateway-command", default=None, help="gateway command (default: python -m kvgate gateway)")
    fleet.add_argument("--bench-doc", metavar="NAME", help="also write section NAME of --doc from the results")
    fleet.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    for p in (run, fleet):
        _add_workload_args(p)
        _add_load_args(p)
        p.add_argument("--out", type=Path, required=True, help="directory for result JSON, report.md and PNGs")
    report = _add_subcommand(sub, "report", "regenerate report.md + plots (and a docs section) from result files")
    report.add_argument("results", nargs="+", type=Path, help="result JSON files")
    report.add_argument("--out", type=Path, required=True)
    report.add_argument("--title", default="kvgate load test")
    report.add_argument("--bench-doc", metavar="NAME", help="write section NAME of --doc from these results")
    report.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    _add_subcommand(sub, "list", "the benchmarks: each one's docs/benchmarks.md sections, what it needs, how long "
                    "it takes")
    return parser


def _add_subcommand(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line summary is both its line in `kvgate bench --help` and its description."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="workload parameter, e.g. num_users=32 (repeatable)")
    p.add_argument("--trace", help="Mooncake JSONL file (trace_replay; same as --param path=FILE)")
    p.add_argument("--oracle-block-size", type=int,
                   help="tokens per block for the oracle (default: a fleet's workers' KV block size, else 16)")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    loop = p.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, help="open loop: mean arrivals per second")
    loop.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--arrival-cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    p.add_argument("--duration-s", type=float, default=60.0, help="stop issuing after this (default: 60)")
    p.add_argument("--max-requests", type=int, help="stop after this many requests")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    """Entry point for `kvgate bench`: args.args holds the arguments after `bench`."""
    return main(list(args.args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in benchmarks.BY_NAME:
        return benchmarks.run(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.subcommand == "list":
        print(benchmarks.listing())
        return 0
    try:
        handler = {"run": _run_one, "fleet": _run_fleet, "report": _report}[args.subcommand]
        return handler(args, _command(argv))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvgate bench: {exc}", file=sys.stderr)
        return 2


def _command(argv: Sequence[str]) -> str:
    shown, hide = [], False
    for arg in argv:
        shown.append("***" if hide else ("--api-key=***" if arg.startswith("--api-key=") else arg))
        hide = arg == "--api-key"
    return "kvgate bench " + shlex.join(shown)


def _plan_parts(args: argparse.Namespace, base_url: str, model: str) -> tuple[list, RunPlan]:
    params = dict(kv.split("=", 1) for kv in args.param)
    if args.trace:
        params["path"] = args.trace
    workload_config, specs = build_workload(args.workload, args.seed, params)
    oracle_block_size = args.oracle_block_size
    if oracle_block_size is None:
        oracle_block_size = _workers_block_size(args) or DEFAULT_ORACLE_BLOCK_SIZE
    oracle = oracle_hit_rate(specs[:args.max_requests] if args.max_requests else specs, oracle_block_size)
    driver = DriverConfig(base_url=base_url, model=model, api_key=args.api_key, rate_rps=args.rate,
                          concurrency=args.concurrency, arrival=args.arrival, arrival_cv=args.arrival_cv,
                          seed=args.seed, duration_s=args.duration_s, max_requests=args.max_requests,
                          request_timeout_s=args.request_timeout_s, drain_timeout_s=args.drain_timeout_s,
                          progress=not args.no_progress)
    config = {"workload": args.workload, "workload_config": asdict(workload_config), "seed": args.seed,
              "num_specs": len(specs)}
    plan = RunPlan(name=getattr(args, "name", "run"), driver=driver,
                   slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms), config=config,
                   oracle={"hit_rate": oracle.hit_rate, "block_size_tokens": oracle_block_size,
                           "prompt_tokens": oracle.prompt_tokens, "shared_tokens": oracle.shared_tokens,
                           "partition": _partition(args)})
    return specs, plan


def _workers_block_size(args: argparse.Namespace) -> int | None:
    """Tokens per KV block of a fleet run's workers (None for `bench run`, whose workers are not ours). The
    oracle counts blocks of this size by default: an engine shares only full blocks of its own, so an
    oracle on smaller ones is a bound no router reaches (multi_tenant_long_prefix, 600-token prefixes:
    0.830 on 16-token blocks, 0.808 on vLLM's 32)."""
    if getattr(args, "engine", None) is None:
        return None
    return worker_block_size(args.engine, tuple(args.worker_arg))


def _partition(args: argparse.Namespace) -> dict[str, int] | None:
    """A fleet run's workers and the KV capacity of each in tokens, where --num-blocks gives it."""
    if getattr(args, "num_blocks", None) is None:
        return None
    return {"num_workers": args.workers, "capacity_tokens": args.num_blocks * _workers_block_size(args)}


def _run_one(args: argparse.Namespace, command: str) -> int:
    specs, plan = _plan_parts(args, args.url, args.model)
    result = execute(specs, dataclasses.replace(plan, command=command))
    _finish([result], args.out, None, None, command)
    return _status(result)


def _status(result: dict[str, Any]) -> int:
    """0 when at least one request succeeded; else 1, with a line that says what went wrong."""
    summary = result["summary"]
    if summary["num_ok"] > 0:
        return 0
    errors = ", ".join(f"{name}: {count}" for name, count in summary["errors"].items()) or "none sent"
    print(f"kvgate bench: no request succeeded ({summary['num_requests']} requests; errors: {errors})",
          file=sys.stderr)
    return 1


def _run_fleet(args: argparse.Namespace, command: str) -> int:
    from loadtest.fleet import run_fleet

    specs, plan = _plan_parts(args, "", args.model or "")
    config = fleet_config(args)
    plan = dataclasses.replace(plan, command=command)
    results = run_fleet(config, specs, plan, on_result=lambda r: write_result(args.out / f"{r['name']}.json", r))
    _finish(results, args.out, args.bench_doc, args.doc, command)
    return 0


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    """The FleetConfig that `kvgate bench fleet ARGS` asks for."""
    from loadtest.fleet import FleetConfig

    externals = tuple(_external_url(spec) for spec in args.external)
    extra = {"gateway_command": tuple(shlex.split(args.gateway_command))} if args.gateway_command else {}
    return FleetConfig(work_dir=args.out / "fleet", num_workers=args.workers, engine=args.engine,
                       num_blocks=args.num_blocks, policies=tuple(p for p in args.policies.split(",") if p),
                       externals=externals,
                       external_commands=tuple(parse_external_command(c) for c in args.external_command),
                       faults=tuple(parse_fault(f) for f in args.fault), worker_model=args.worker_model,
                       worker_args=tuple(args.worker_arg), base_port=args.base_port,
                       gateway_replicas=_counts(args.gateway_replicas),
                       replicas_share=args.replicas_share, **extra)


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--gateway-replicas takes counts such as 1,2,4, not {text!r}") from None


def _external_url(spec: str) -> tuple[str, str]:
    name, sep, url = spec.partition("=")
    if not (name and sep and url):
        raise ValueError("--external takes NAME=URL")
    return name, url


def _report(args: argparse.Namespace, command: str) -> int:
    results = [load_result(path) for path in args.results]
    _finish(results, args.out, args.bench_doc, args.doc, results[0].get("command") or command, args.title)
    return 0


def _finish(results: list[dict[str, Any]], out: Path, bench_doc: str | None, doc: Path | None, command: str,
            title: str = "kvgate load test") -> None:
    for result in results:
        write_result(out / f"{result['name']}.json", result)
    report = write_report(results, out, title)
    if bench_doc and doc is not None:
        write_benchmarks_section(doc, bench_doc, results, command)
    print(comparison_table(results))
    print(f"\nreport: {report}")

