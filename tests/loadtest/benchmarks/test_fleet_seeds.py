"""bench_fleet_seeds: each seed's figures from its runs' results, the verdicts on the means over seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.benchmarks.fleet_seeds import ENGINES, FLEET, markdown, paired_gap, seed_figures, verdicts


def _result(path: Path, hit_rate: float, errors: int = 0, prediction: float | None = None) -> None:
    result = {"summary": {"prefix_hit_rate": hit_rate, "num_errors": errors, "num_requests": 160,
                          "ttft_ms": {"p50": 40.0, "p90": 90.0}, "throughput_rps": 2.5},
              "oracle": {"hit_rate": 0.8, "static_partition_hit_rate": 0.6}}
    if prediction is not None:
        result["router"] = {"prediction_hit_ratio": prediction}
    path.write_text(json.dumps(result))


def test_seed_figures_set_each_router_and_the_static_partition_against_the_oracle(tmp_path: Path) -> None:
    _result(tmp_path / "kv_aware.json", 0.72, prediction=0.99)
    _result(tmp_path / "sglang.json", 0.68, errors=3)
    figures = seed_figures(tmp_path)
    assert figures["kv_aware"] == pytest.approx(0.9)
    assert figures["sglang"] == pytest.approx(0.85)
    assert figures["static"] == pytest.approx(0.75)
    assert figures["prediction"] == 0.99
    assert figures["errors"] == {"kv_aware": 0, "sglang": 3}
    assert figures["speed"]["sglang"] == {"ttft_p50_ms": 40.0, "ttft_p90_ms": 90.0, "req_per_s": 2.5}


def _row(seed: int, kv_aware: float, sglang: float, static: float, prediction: float | None = 0.99) -> dict:
    return {"seed": seed, "kv_aware": kv_aware, "sglang": sglang, "static": static, "prediction": prediction,
            "errors": {"kv_aware": 0, "sglang": 0}}


def test_the_verdicts_are_on_the_means_over_seeds() -> None:
    rows = [_row(1, 0.80, 0.84, 0.70), _row(2, 0.90, 0.84, 0.72), _row(3, 0.88, 0.84, 0.74)]  # kv_aware mean 0.86
    assert [ok for *_, ok in verdicts(rows)] == [True, True, True]
    behind = [_row(1, 0.80, 0.86, 0.70), _row(2, 0.84, 0.86, 0.96)]  # kv_aware 0.82, static 0.83
    assert [ok for *_, ok in verdicts(behind)] == [False, False, True]


def test_a_missing_or_low_prediction_ratio_fails_its_target() -> None:
    assert verdicts([_row(1, 0.9, 0.8, 0.7, prediction=None)])[2][3] is False
    assert verdicts([_row(1, 0.9, 0.8, 0.7), _row(2, 0.9, 0.8, 0.7, prediction=0.95)])[2][1] == "0.950"


def test_the_section_names_the_fleet_command_and_a_row_per_seed() -> None:
    result = {"command": "python -m loadtest.benchmarks.fleet_seeds", "fleet_command": "kvgate " + " ".join(FLEET),
              "machine": "m", "date": "d", "seeds": [_row(1, 0.9, 0.8, 0.7), _row(2, 0.8, 0.8, 0.7)]}
    text = markdown(result)
    assert "--num-blocks 96" in text and "| 1 | 0.900 | 0.800 | 0.700 | 0.990 | 0 / 0 |" in text
    assert "| mean | 0.850 | 0.800 | 0.700 | | |" in text and "FAIL" not in text


def test_the_sim_fleet_runs_the_same_workload_on_sim_workers_with_the_vllm_fleets_blocks() -> None:
    sim, vllm = ENGINES["sim"], ENGINES["vllm"]
    assert sim.fleet[:4] == ["bench", "fleet", "--engine", "sim"] and "--worker-arg=--block-size=32" in sim.fleet
    assert [a for a in sim.fleet if a not in ("sim", "--worker-arg=--block-size=32")] == [
        a for a in vllm.fleet if a != "vllm"]
    result = {"command": "c", "fleet_command": "kvgate " + " ".join(sim.fleet), "machine": "m", "date": "d",
              "engine": "sim", "seeds": [_row(1, 0.9, 0.8, 0.7)]}
    text = markdown(result)
    assert text.startswith("## Routers on a sim fleet short of cache") and "results/sim-fleet-seeds/seed-<S>/" in text
    assert sim.section != vllm.section and sim.out != vllm.out


def test_the_section_gives_each_routers_mean_ttft_and_throughput_when_the_run_recorded_them() -> None:
    speed = {"kv_aware": {"ttft_p50_ms": 30.0, "ttft_p90_ms": 80.0, "req_per_s": 40.0},
             "sglang": {"ttft_p50_ms": 50.0, "ttft_p90_ms": 100.0, "req_per_s": 42.0}}
    rows = [{**_row(1, 0.9, 0.8, 0.7), "speed": speed},
            {**_row(2, 0.9, 0.8, 0.7), "speed": {**speed, "sglang": {**speed["sglang"], "req_per_s": 44.0}}}]
    result = {"command": "c", "fleet_command": "f", "machine": "m", "date": "d", "seeds": rows}
    assert "| sglang-router cache_aware | 50 | 100 | 43.00 |" in markdown(result)
    assert "| kvgate kv_aware | 30 | 80 | 40.00 |" in markdown(result)
    assert "TTFT p50" not in markdown({**result, "seeds": [_row(1, 0.9, 0.8, 0.7)]})


def test_the_section_gives_the_seed_by_seed_gap_between_the_routers_with_its_spread() -> None:
    rows = [_row(1, 0.80, 0.84, 0.7), _row(2, 0.90, 0.84, 0.7), _row(3, 0.82, 0.84, 0.7)]  # gaps -0.04, +0.06, -0.02
    assert "less sglang-router cache_aware: +0.000 +- 0.061 (" in paired_gap(rows)  # stdev 0.0529 / sqrt(3) x 2
    assert "+0.000 +- 0.061" in markdown({"command": "c", "fleet_command": "f", "machine": "m", "date": "d",
                                          "seeds": rows})
    assert paired_gap(rows[:1]) == ""
