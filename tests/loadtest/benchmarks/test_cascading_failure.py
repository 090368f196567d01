"""The cascading-failure benchmark: its phases and fault schedule, the arithmetic of goodput, recovery and
returning workers' shares on synthetic calls, the targets' verdicts and the section; and a short run of the
harness itself on a tiny sim fleet behind kvgate."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.benchdoc import section_commands
from loadtest.benchmarks import cascading_failure as bench
from loadtest.cascade.analysis import analyse
from loadtest.cascade.figures import (capacity_left_rps, count_shares, counter_deltas, phase_figures, recovery_s,
                                      worker_shares)
from loadtest.cascade.phases import PHASES, PhasePlan
from loadtest.cascade.records import CallRecord
from loadtest.cascade.workload import DEFAULT_TENANTS, RequestShape, build_arrivals

SLO_MS = 1000.0


def call(index: int, at_s: float, *, ttft_ms: float | None = 100.0, error: str | None = None, attempts: int = 1,
         worker: str | None = "p2", pool: str | None = "primary") -> CallRecord:
    return CallRecord(index, "std-a", at_s, at_s, at_s + 0.5, attempts, error, 200 if error is None else 503,
                      ttft_ms if error is None else None, worker if error is None else None,
                      pool if error is None else None, "big-model" if pool == "primary" else "small-model")


def timeline(good_until_s: float, bad_until_s: float, end_s: float, per_s: int = 10) -> list[CallRecord]:
    """per_s calls a second to end_s, all good but those arriving in [good_until_s, bad_until_s) (too slow)."""
    calls = []
    for i in range(int(end_s * per_s)):
        t = i / per_s
        calls.append(call(i, t, ttft_ms=5000.0 if good_until_s <= t < bad_until_s else 100.0))
    return calls


# -- phases -------------------------------------------------------------------------------------------------

def test_phases_follow_each_other_in_order_and_cover_the_run():
    plan = PhasePlan(40.0)
    windows = plan.windows()
    assert [w.name for w in windows] == list(PHASES) == ["healthy", "degraded", "two-down", "recovery"]
    assert [(w.start_s, w.end_s) for w in windows] == [(0, 40), (40, 80), (80, 120), (120, 160)]
    assert plan.total_s == 160 and windows[1].holds(40.0) and not windows[1].holds(80.0)


def test_the_schedule_degrades_then_kills_then_restarts_both_after_the_slow_one_was_down():
    steps = PhasePlan(30.0, down_s=5.0).schedule()
    assert [(s.at_s, s.action, s.workers) for s in steps] == [
        (30.0, "degrade", ("p0",)), (60.0, "kill", ("p1",)), (90.0, "kill", ("p0",)), (95.0, "restart", ("p0", "p1"))]


@pytest.mark.parametrize("kwargs", [{"phase_s": 0}, {"phase_s": 10, "slow_factor": 0.5},
                                    {"phase_s": 10, "down_s": 10}, {"phase_s": 10, "killed": "p0"}],
                         ids=["no-phase", "faster-not-slower", "down-past-the-phase", "same-worker"])
def test_a_plan_that_cannot_run_is_refused(kwargs):
    with pytest.raises(ValueError):
        PhasePlan(**kwargs)


def test_the_workload_is_the_same_for_the_same_seed_and_splits_by_tenant_share():
    first = build_arrivals(DEFAULT_TENANTS, 20.0, 60.0, RequestShape(), seed=3)
    assert first == build_arrivals(DEFAULT_TENANTS, 20.0, 60.0, RequestShape(), seed=3)
    assert first != build_arrivals(DEFAULT_TENANTS, 20.0, 60.0, RequestShape(), seed=4)
    assert 1000 < len(first) < 1400 and [a.index for a in first] == list(range(len(first)))
    crit = sum(a.tenant == "crit" for a in first) / len(first)
    assert 0.15 < crit < 0.25  # its 20% share
    assert len({a.messages[0]["content"] for a in first}) == 3 * RequestShape().prefixes_per_tenant


# -- figures ------------------------------------------------------------------------------------------------

def test_a_phases_goodput_counts_answers_within_the_slo_and_its_retries_as_a_share_of_the_offered():
    window = PhasePlan(10.0).window("degraded")  # [10, 20)
    calls = [call(0, 9.9), call(1, 10.0), call(2, 12.0, ttft_ms=1500.0), call(3, 15.0, error="http_503", attempts=3),
             call(4, 19.0, pool="small", attempts=2), call(5, 20.0)]
    f = phase_figures(calls, window, SLO_MS)
    assert (f["offered"], f["good"], f["errors"], f["retries"]) == (4, 2, 1, 3)
    assert f["goodput_rps"] == pytest.approx(0.2) and f["retry_share"] == pytest.approx(0.75)
    assert f["errors_by_class"] == {"http_503": 1} and f["served_by"] == {"primary": 2, "small": 1}
    assert f["primary_ttft_p99_ms"] == pytest.approx(1500.0, rel=0.02)


@pytest.mark.parametrize("bad_until_s, expected_s", [(10.0, 0.0), (17.0, 7.0), (40.0, None)],
                         ids=["never-fell", "back-after-7s", "never-back"])
def test_recovery_is_the_start_of_the_first_window_back_at_90_percent_of_the_healthy_share(bad_until_s, expected_s):
    calls = timeline(good_until_s=10.0, bad_until_s=bad_until_s, end_s=40.0)
    assert recovery_s(calls, event_s=10.0, until_s=40.0, reference=1.0, slo_ttft_ms=SLO_MS) == expected_s


def test_fallback_counters_grow_by_reason_between_two_scrapes():
    before = [({"from_pool": "primary", "to_pool": "small", "reason": "overloaded"}, 5.0)]
    after = [({"from_pool": "primary", "to_pool": "small", "reason": "overloaded"}, 12.0),
             ({"from_pool": "primary", "to_pool": "small", "reason": "unavailable"}, 3.0)]
    assert counter_deltas(before, after, ("reason",)) == {"overloaded": 7.0, "unavailable": 3.0}
    assert counter_deltas(after, after, ("reason",)) == {}


def test_a_returning_workers_share_counts_only_what_the_primary_pool_answered_in_the_window():
    calls = [call(0, 1.0, worker="p0"), call(1, 2.0, worker="p2"), call(2, 3.0, worker="p2"),
             call(3, 4.0, worker="s0", pool="small"), call(4, 4.5, error="http_503"), call(5, 9.0, worker="p0")]
    shares, n = worker_shares(calls, 0.0, 5.0)
    assert n == 3 and shares == pytest.approx({"p0": 1 / 3, "p2": 2 / 3})


def test_finished_counts_of_a_restarted_worker_read_from_zero():
    shares = count_shares({"p0": 50.0, "p1": 0.0, "p2": 100.0}, {"p0": 2.0, "p1": 0.0, "p2": 118.0})
    assert shares == pytest.approx({"p0": 0.1, "p1": 0.0, "p2": 0.9})
    assert count_shares({"p0": None}, {"p0": 1.0}) is None


def test_capacity_left_slows_the_degraded_worker_and_drops_the_killed_one():
    plan, workers = PhasePlan(10.0, slow_factor=5.0), {"p0": 5.0, "p1": 5.0, "p2": 5.0}
    left = {phase: capacity_left_rps(phase, plan, workers, small_rps=8.0) for phase in PHASES}
    assert left == pytest.approx({"healthy": 23.0, "degraded": 19.0, "two-down": 14.0, "recovery": 23.0})


# -- verdicts and the section ---------------------------------------------------------------------------------

def synthetic_result(two_down_good_s: float) -> dict:
    """A result of (a) and (b) on 10 s phases at 10 calls/s: (b) loses the two-down phase, (a) keeps
    goodput everywhere but where two_down_good_s says, and its returning workers ramp up."""
    plan = PhasePlan(10.0, down_s=1.0)
    faults = [{"at_s": s.at_s, "action": s.action, "workers": list(s.workers), "started_s": s.at_s,
               "done_s": s.at_s + 0.5} for s in plan.schedule()]

    def run(calls: list[CallRecord]) -> dict:
        return {"records": [c.to_json() for c in calls], "faults": faults, "scrapes": [], "warming_s": {},
                "worker_counts": []}
    a = [dataclasses.replace(c, worker=("p0", "p1", "p2", "p2", "p2", "p2", "p2", "p2", "p2", "p2")[c.index % 10]
                             if c.scheduled_s >= 32.0 else ("p0", "p1", "p2")[c.index % 3])
         for c in timeline(good_until_s=20.0, bad_until_s=20.0 + two_down_good_s, end_s=40.0)]
    b = timeline(good_until_s=20.0, bad_until_s=30.0, end_s=40.0)
    settings = {"phase_s": 10.0, "slow_factor": 5.0, "down_s": 1.0, "load": 0.9, "slo_ttft_ms": SLO_MS,
                "slow_start_s": 6.0, "probe_s": 8.0, "seed": 0, "quick": True, "primary_timing": "name=x8,a=1",
                "small_timing": "name=x4,a=1", "max_num_seqs": 2, "request": vars_of(RequestShape()),
                "tenants": [["std-a", "standard", 1.0]]}
    return {"command": "kvgate bench cascading-failure --quick", "machine": "test box", "date": "2026-01-01",
            "pinned": True, "settings": settings, "offered_rps": 10.0, "num_calls": 400,
            "capacity": {"p0": 4.0, "p1": 4.0, "p2": 4.0, "s0": 8.0, "s1": 8.0}, "peers": {},
            "not_measured": {"sglang-cache_aware": "sglang-router is not installed (install: ...)"},
            "runs": {"kvgate-fallbacks": run(a), "kvgate-no-fallbacks": run(b)}}


def vars_of(shape: RequestShape) -> dict:
    return dataclasses.asdict(shape)


def test_the_targets_pass_when_fallbacks_keep_goodput_and_fail_the_phase_they_lose():
    kept = synthetic_result(two_down_good_s=0.0)
    verdicts = {v.target: v for v in bench.judge(kept, bench.analyses(kept))}
    assert all(v.passed for t, v in verdicts.items() if "goodput" in t or "retries" in t), verdicts
    ratio = next(v for t, v in verdicts.items() if ">= 1.5x (b)" in t)
    assert ratio.passed and ratio.figure.startswith("10.00 / 0.00")

    lost = synthetic_result(two_down_good_s=10.0)
    verdicts = {v.target: v for v in bench.judge(lost, bench.analyses(lost))}
    assert [v.word for t, v in verdicts.items() if "goodput in two-down" in t] == ["FAIL"]
    assert verdicts["(a) goodput in healthy >= 90% of min(offered, capacity left)"].word == "pass"


def test_a_returning_worker_that_takes_its_full_share_at_once_fails_slow_start():
    result = synthetic_result(two_down_good_s=0.0)
    found = bench.analyses(result)
    worker = found["kvgate-fallbacks"]["returning"]["workers"]["p0"]  # back at 31.5: a third of its share at once
    assert worker["steady_share"] == pytest.approx(1 / 3, abs=0.01)
    verdicts = [v for v in bench.judge(result, found) if "returning p0" in v.target]
    assert [v.word for v in verdicts] == ["FAIL"]


def test_the_section_starts_with_the_command_that_writes_it_and_lists_every_phase_and_target():
    result = synthetic_result(two_down_good_s=0.0)
    found = bench.analyses(result)
    markdown = bench.section_markdown(result, found, bench.judge(result, found))
    doc = f"<!-- bench:{bench.SECTION}:start -->\n{markdown}\n<!-- bench:{bench.SECTION}:end -->"
    assert section_commands(doc) == {"cascading-failure": "kvgate bench cascading-failure --quick"}
    for phase in PHASES:
        assert f"| kvgate-fallbacks | {phase} |" in markdown and f"| kvgate-no-fallbacks | {phase} |" in markdown
    assert "not measured: sglang-cache_aware: sglang-router is not installed" in markdown
    assert "| (a) client retries <= 10% of offered in every phase | worst healthy: 0.0% | pass |" in markdown


def test_analysis_of_a_run_gives_every_phase_and_each_faults_recovery():
    result = synthetic_result(two_down_good_s=3.0)
    found = analyse(result["runs"]["kvgate-fallbacks"], PhasePlan(10.0, down_s=1.0), SLO_MS, 6.0, 3)
    assert [f["phase"] for f in found["phases"]] == list(PHASES)
    assert [(e["event"], e["recovery_s"]) for e in found["recovery"]] == [
        ("p0 degraded", 0.0), ("p1 killed", 3.0), ("p0/p1 back", 0.0)]


# -- the harness on a tiny fleet --------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_harness_runs_every_phase_through_kvgate_and_moves_work_to_the_small_pool(tmp_path):
    from loadtest.cascade.fleet import FleetShape
    from loadtest.cascade.run import ConfigSpec, RunSettings, run_config

    plan = PhasePlan(4.0, down_s=1.0)
    keys = {t.name: f"key-{t.name}-0123456789" for t in DEFAULT_TENANTS}
    settings = RunSettings(FleetShape(primary_workers=2, small_workers=1), plan, DEFAULT_TENANTS, keys,
                           slow_start_s=3.0, call_timeout_s=10.0)
    arrivals = build_arrivals(DEFAULT_TENANTS, 6.0, plan.total_s, RequestShape(), seed=1)
    run = run_config(ConfigSpec("kvgate-fallbacks", "kvgate", True), settings, arrivals, tmp_path)
    records = [CallRecord.from_json(r) for r in run["records"]]
    assert len(records) == len(arrivals) and all(r.attempts >= 1 for r in records)
    assert [f["action"] for f in run["faults"]] == ["degrade", "kill", "kill", "restart"]
    assert [s["label"] for s in run["scrapes"]] == [*PHASES, "end"] and all(s["ok"] for s in run["scrapes"])
    found = analyse(run, plan, 2000.0, 3.0, 2)
    assert all(f["good"] > 0 for f in found["phases"]), found["phases"]
    assert any(f["served_by"].get("small") for f in found["phases"])  # p0 slow and p1 dead: work moved
    assert set(found["returning"]["workers"]) == {"p0", "p1"}
