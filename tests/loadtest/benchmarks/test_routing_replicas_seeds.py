"""bench_replicas: the sections' own commands, rerun per seed; the verdict on the mean over seeds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loadtest.benchmarks.routing_replicas_seeds import markdown, run_argv, section_argv, seed_figures, verdict

DOC = """# Benchmarks
<!-- bench:routing-replicas-multi-turn:start -->
### routing-replicas-multi-turn

Command: `kvgate bench fleet --workers 8 --policies kv_aware --gateway-replicas 1,2,4 --replicas-share both --workload multi_turn_chat --param num_users=48 '--worker-arg=--sim-timing=name=x4 (not calibrated),step_overhead_s=0.026' --rate 10 --out results/routing-replicas-multi-turn --bench-doc routing-replicas-multi-turn`

| run | hit rate |
<!-- bench:routing-replicas-multi-turn:end -->
"""


def test_a_sections_command_is_rerun_with_only_replicas_seed_and_output_changed(tmp_path: Path) -> None:
    base = section_argv(DOC, "routing-replicas-multi-turn")
    assert base == ["bench", "fleet", "--workers", "8", "--policies", "kv_aware", "--workload", "multi_turn_chat",
                    "--param", "num_users=48",
                    "--worker-arg=--sim-timing=name=x4 (not calibrated),step_overhead_s=0.026", "--rate", "10"]
    argv = run_argv(base, 4, 12, tmp_path)
    assert argv[:3] == [sys.executable, "-m", "kvgate"]
    assert argv[-8:] == ["--gateway-replicas", "1,4", "--replicas-share", "redis", "--seed", "12", "--out", str(tmp_path)]


def test_a_section_without_a_fleet_command_is_refused() -> None:
    with pytest.raises(ValueError, match="routing-replicas-multi-tenant"):
        section_argv(DOC, "routing-replicas-multi-tenant")


def _result(path: Path, hit_rate: float, oracle: float) -> None:
    path.write_text(json.dumps({"summary": {"prefix_hit_rate": hit_rate}, "oracle": {"hit_rate": oracle}}))


def test_seed_figures_compare_hit_rate_over_oracle_in_points(tmp_path: Path) -> None:
    _result(tmp_path / "kv_aware.json", 0.80, 0.80)
    _result(tmp_path / "kv_aware-x4.json", 0.78, 0.80)
    figures = seed_figures(tmp_path, "kv_aware", 4)
    assert figures["one"] == pytest.approx(1.0)
    assert figures["many"] == pytest.approx(0.975)
    assert figures["points"] == pytest.approx(-2.5)


@pytest.mark.parametrize(("points", "passes", "within"), [
    ([-2.8, -1.2, -0.2], True, 2),  # mean -1.4
    ([-3.0, -2.5, -1.0], False, 1),  # mean -2.2
    ([1.6, 0.4, 3.0], True, 3),  # ahead
])
def test_the_verdict_is_on_the_mean_over_seeds(points: list[float], passes: bool, within: int) -> None:
    v = verdict([{"one": 0.97, "many": 0.97 + p / 100, "points": p} for p in points])
    assert v["pass"] is passes
    assert v["within"] == within
    assert v["seeds"] == 3


def test_the_section_shows_each_seed_the_mean_and_the_verdict() -> None:
    rows = [{"seed": 11, "one": 0.970, "many": 0.958, "points": -1.2},
            {"seed": 12, "one": 0.974, "many": 0.972, "points": -0.2}]
    text = markdown({"command": "python -m loadtest.benchmarks.routing_replicas_seeds", "machine": "a CPU", "date": "2026-12-02",
                     "replicas": 4, "sections": {"routing-replicas-multi-turn": rows}})
    assert "| 11 | 0.970 | 0.958 | -1.2 |" in text
    assert "| mean | 0.972 | 0.965 | -0.7 |" in text
    assert "-0.7 points (2 of 2 seeds within it on their own) | within 2 points (or ahead) | pass |" in text
