"""What the benchmarks that measure this checkout's gateway beside another commit's share: that commit's
tree (git archive, its C extensions built in place), the trees by the names their sections use, a tree's
gateway started on the gateway's CPU, and the command-line options (--baseline, --rounds, --no-doc,
--doc-only)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from loadtest.benchdoc import bench_command
from loadtest.harness.gateway import API_KEY, cpu_placement
from loadtest.paths import ROOT
from loadtest.procs import ChildProcess, free_port


def baseline_tree(rev: str, into: Path) -> Path:
    """REV's files (git archive) in into, with its C extensions built in place."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=into, capture_output=True, check=True)
    return into


def compared_trees(baseline: str | None, tmp_dir: Path) -> dict[str, Path]:
    """{"baseline (REV)": REV's tree under tmp_dir, "this checkout": ROOT}; this checkout alone without a baseline."""
    trees = {"this checkout": ROOT}
    if baseline:
        trees = {f"baseline ({baseline})": baseline_tree(baseline, Path(tempfile.mkdtemp(dir=tmp_dir))), **trees}
    return trees


def start_gateway(tree: Path, config_for_port: Callable[[int], dict[str, Any]], tmp_dir: Path,
                  tag: str) -> tuple[ChildProcess, int]:
    """tree's gateway (its own code: the command runs in the tree) with config_for_port(its port), on the
    gateway's CPU (bench_gateway.cpu_placement); (process, port) once it is ready."""
    port = free_port()
    config = tmp_dir / f"gateway-{tag}.yaml"
    config.write_text(yaml.safe_dump(config_for_port(port)))
    gateway = ChildProcess(f"gateway {tag}", ["env", "-C", str(tree), sys.executable, "-m", "kvgate", "gateway",
                                              "--config", str(config)], tmp_dir / f"gateway-{tag}.log",
                           f"http://127.0.0.1:{port}/ready", env={"KVGATE_API_KEY": API_KEY, "PYTHONPATH": str(tree)},
                           cpus=cpu_placement()[0])
    gateway.wait_healthy(120)
    return gateway, port


def add_arguments(parser: argparse.ArgumentParser, results_path: Path) -> None:
    parser.add_argument("--baseline", help="also measure this commit's gateway, in the same run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every cell per tree; figures are medians (default 2)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--doc-only", action="store_true",
                        help=f"rewrite the section from {results_path.relative_to(ROOT)}")


def command(name: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run of benchmark NAME, as its section shows it."""
    return bench_command(name, [*(["--baseline", args.baseline] if args.baseline else []),
                                *(["--rounds", str(args.rounds)] if args.rounds != 2 else [])])
