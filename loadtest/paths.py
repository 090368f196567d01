"""Where the load-test suite reads and writes: the checkout it runs from, its results/ folder (result
JSON, logs, the peers' installs) and docs/benchmarks.md. One place, so a module can move without its
paths moving with it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "results"
DOC_PATH = ROOT / "docs" / "benchmarks.md"
