"""The real-engines benchmark's pure parts: mirrored rounds, the means, the targets and the section
(no vLLM needed: the runs are given)."""

from __future__ import annotations

from loadtest.benchmarks.real_engines import KVGATE, SGLANG, Workload, render, round_orders, summarize, targets


def run(router: str, rnd: int, rps: float, ttft: float, ratio: float | None = None, predicted: int = 0) -> dict:
    stats = {"prediction_hit_ratio": ratio, "predicted_cached_tokens": predicted} if ratio is not None else None
    return {"round": rnd, "router": router, "seed": rnd, "completed": 192, "failed": 0,
            "request_throughput": rps, "mean_ttft_ms": ttft, "median_ttft_ms": ttft / 2, "p99_ttft_ms": ttft * 4,
            "mean_tpot_ms": 20.0, "mean_e2el_ms": ttft + 300, "prefix_hit_rate": 0.8, "router_stats": stats}


def test_rounds_mirror_the_routers_order():
    assert round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_ahead_means_ahead_on_the_mean_of_the_rounds_and_the_prediction_ratio_is_weighted_by_prediction():
    runs = [run(SGLANG, 0, 3.0, 300), run(KVGATE, 0, 3.3, 260, 1.0, 1000),
            run(KVGATE, 1, 3.1, 300, 0.9, 3000), run(SGLANG, 1, 3.0, 300)]
    summary = summarize(runs)
    assert summary[KVGATE]["request_throughput"] == 3.2 and summary[KVGATE]["mean_ttft_ms"] == 280
    assert summary[KVGATE]["prediction_hit_ratio"] == (1.0 * 1000 + 0.9 * 3000) / 4000
    assert summary[SGLANG]["prediction_hit_ratio"] is None
    verdicts = {what.split(",")[0]: (value, met) for what, value, _, met in targets(summary)}
    assert verdicts["req/s"] == ("1.07x", True)
    assert verdicts["mean TTFT"] == ("0.93x", True)
    assert verdicts[f"{KVGATE}: prediction hit ratio (confirmed / predicted cached tokens)"] == ("0.925", False)


def test_no_targets_without_both_routers():
    assert targets(summarize([run(KVGATE, 0, 3.0, 300, 1.0, 10)])) == []


def test_the_section_names_its_command_workload_and_verdicts():
    runs = [run(SGLANG, 0, 3.0, 300), {**run(KVGATE, 0, 2.0, 400, 0.99, 100), "router_cpu_ms_per_request": 12.34,
                                        "router_cores": 0.05, "workers_cores": 1.9}]
    meta = {"command": "python -m loadtest.benchmarks.real_engines", "machine": "cpu, 2 cores", "date": "today",
            "vllm_version": "0.32.0", "sglang_version": "0.3.2", "num_workers": 2, "num_blocks": 192, "rounds": 1,
            "workload": {k: getattr(Workload(), k) for k in Workload.__dataclass_fields__}}
    text = render(runs, meta)
    assert "Command: `python -m loadtest.benchmarks.real_engines`" in text
    assert "16 prefixes x 512 tokens + 64, 16 output tokens, 192 prompts, concurrency 4" in text
    assert "| 0.67x | >= 1.05x | FAIL |" in text and "| 0.990 | >= 0.97 | pass |" in text
    assert "| 1 | kvgate kv_aware | 0 | 2.00 | 400 / 200 / 1600 |" in text
    assert "| 0.990 | 12.3 (0.05) | 1.90 | 0 |" in text  # the router's CPU per request (cores), the workers'
    assert "| 80.0% | - | - | - | 0 |" in text  # sglang-router: no prediction ratio; a run saved before CPU was measured
    assert "each prefix computed once: 81.5%" in text  # (192 - 16) x 512 / (192 x 576)


def test_the_results_folder_is_named_from_the_repository_even_through_a_link():
    from pathlib import Path

    from loadtest.benchmarks.real_engines import ROOT, _shown

    assert _shown(ROOT / "results" / "real-engines") == "results/real-engines"
    assert _shown(Path("/elsewhere/out")) == "/elsewhere/out"


def test_engine_side_splits_each_workers_histograms_over_the_run():
    from loadtest.benchmarks.real_engines import ENGINE_TIMES, engine_side, engine_side_table, fleet_hit_rate

    def counters(n: float, seconds: float, hits: float, queries: float) -> dict[str, float]:
        return {"hits": hits, "queries": queries, **{f"{key}_count": n for key in ENGINE_TIMES},
                **{f"{key}_sum": seconds for key in ENGINE_TIMES}}

    before = [counters(10, 1.0, 100, 200), counters(0, 0.0, 0, 0)]
    after = [counters(40, 4.0, 700, 1000), counters(20, 3.0, 100, 400)]
    workers = engine_side(before, after)
    assert [w["requests"] for w in workers] == [30, 20]
    assert workers[0]["hit_rate"] == 0.75 and workers[1]["hit_rate"] == 0.25
    assert workers[0]["ttft_ms"] == 100.0 and workers[1]["tpot_ms"] == 150.0
    assert fleet_hit_rate(before, after) == 700 / 1200
    own = {"prediction_hit_ratio": 1.0, "mean_ms": {"ttft": 290.4, "queue_wait": None, "decision": 1.25}}
    lines = engine_side_table([{**run(KVGATE, 0, 3.0, 300), "engine_side": workers, "router_stats": own},
                               {**run(SGLANG, 0, 3.0, 300), "engine_side": workers}])
    # client TTFT 300 ms against the engines' (30 x 100 + 20 x 150) / 50 = 120 ms; TPOT 20 against 120
    assert lines[-2] == ("| 1 | kvgate kv_aware | 30 / 20 | 75.0% / 25.0% | 100 (100 + 100) / 150 (150 + 150) | "
                         "100.0 / 150.0 | 180 | -100.0 | 290 (1.2) |")
    assert lines[-1].endswith("| 180 | -100.0 | - |")  # a peer router: no figures of its own
    assert engine_side_table([run(SGLANG, 0, 3.0, 300)]) == []  # runs saved before the workers' side was read
