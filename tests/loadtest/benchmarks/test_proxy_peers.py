"""The proxy benchmark's pure parts: the figures of a run (loadtest/harness/proxies.py), the verdict and the
docs section (no processes)."""

from __future__ import annotations

import re

import pytest

from loadtest.benchmarks.proxy_peers import markdown, verdict
from loadtest.harness.proxies import CONNECTIONS, DIRECT, FLOOR, KVGATE, LITELLM, MODES, SGLANG, interference, summarise


# -- figures, verdict, report -------------------------------------------------------------------

LATENCY_MS = {DIRECT: (0.10, 0.30), KVGATE: (0.38, 1.00), SGLANG: (0.25, 0.60)}  # p50, p99 in round 1
RPS = {DIRECT: 30000.0, KVGATE: 9000.0, SGLANG: 16000.0}


def _runs(rps=RPS, latency_ms=LATENCY_MS, errors=0, proxies=(DIRECT, KVGATE, SGLANG)):
    """Two rounds; round 2 is 10% slower and its latencies 0.1 ms higher for every proxy alike."""
    runs = []
    for round_ in (1, 2):
        for mode in MODES:
            for connections in CONNECTIONS:
                for proxy in proxies:
                    p50, p99 = (x + 0.1 * (round_ - 1) for x in latency_ms[proxy])
                    runs.append({"round": round_, "proxy": proxy, "mode": mode, "connections": connections,
                                 "duration_s": 10.0, "requests": int(rps[proxy] * 10), "errors": errors,
                                 "requests_per_s": rps[proxy] * (1.0 if round_ == 1 else 0.9),
                                 "p50_ms": p50, "p99_ms": p99,
                                 "proxy_cpu_s": None if proxy == DIRECT else 9.5, "foreign_cores": 0.01 * round_})
    return runs


def test_figures_are_medians_over_rounds_and_added_latency_is_against_direct_in_the_same_round():
    figures = summarise(_runs())

    kvgate = figures["non-streaming"]["32"][KVGATE]
    assert kvgate["requests_per_s"] == pytest.approx(8550.0)
    assert kvgate["requests_per_s_rounds"] == [9000.0, 8100.0]
    assert kvgate["p50_ms"] == pytest.approx(0.43)
    assert kvgate["added_p50_ms"] == pytest.approx(0.28) and kvgate["added_p99_ms"] == pytest.approx(0.70)
    assert kvgate["cpu_busy"] == pytest.approx(0.95)
    assert kvgate["cpu_ms_per_request"] == pytest.approx(9.5 * 1e3 / 90000)
    direct = figures["streaming"]["1"][DIRECT]
    assert direct["added_p50_ms"] == pytest.approx(0.0) and direct["cpu_busy"] is None


@pytest.mark.parametrize(("rps", "latency_ms", "passes"), [
    (RPS, LATENCY_MS, (True, True)),
    ({**RPS, KVGATE: 7000.0}, LATENCY_MS, (False, True)),
    (RPS, {**LATENCY_MS, KVGATE: (0.45, 1.0)}, (True, False)),
], ids=["both-pass", "too-few-requests-per-second", "too-much-added-latency"])
def test_non_streaming_kvgate_needs_half_sglang_routers_requests_and_at_most_twice_its_added_latency(
        rps, latency_ms, passes):
    result = verdict(summarise(_runs(rps, latency_ms)))["non-streaming"]

    assert (result["rps_pass"], result["added_p50_pass"], result["errors_pass"]) == (*passes, True)


def test_streaming_must_keep_kvgate_ahead_of_sglang_router():
    result = verdict(summarise(_runs()))["streaming"]  # kvgate: fewer req/s, more added latency

    assert result["rps_pass"] is False and result["added_p50_pass"] is False
    assert result["rps_ratio"] == pytest.approx(9000 / 16000)
    assert result["added_p50_ratio"] == pytest.approx(0.28 / 0.15)


def test_any_failed_request_fails_the_verdict():
    assert verdict(summarise(_runs(errors=3)))["non-streaming"]["errors_pass"] is False


def _result(figures, runs=()):
    return {"command": ".venv/bin/python -m loadtest.benchmarks.proxy_peers", "machine": "a CPU, 2 cores", "date": "2026-12-01",
            "versions": {"nginx": "nginx version: nginx/1.22.1", "wrk": "wrk 4.1.0", "sglang-router": "0.3.2",
                         "litellm": "1.108.7"},
            "settings": {"rounds": 2, "duration_s": 10.0, "warmup_s": 1.0, "cpus": {"proxy": [0], "upstream_and_load": [1]}},
            "load_average": {"start": [0.3, 0.2, 0.1], "end": [1.1, 0.5, 0.2]},
            "interference": {"median_cores": 0.01, "max_cores": 0.04},
            "figures": figures, "verdict": verdict(figures), "raw": runs}


def test_the_docs_section_shows_every_cell_and_every_target():
    runs = _runs()

    text = markdown(_result(summarise(runs), runs))

    assert "(none above 0.1)" in text
    assert "Command: `.venv/bin/python -m loadtest.benchmarks.proxy_peers`" in text
    assert "| non-streaming | 32 | kvgate | 8,550 (9,000 / 8,100) | 0.430 |" in text
    assert len(re.findall(r"^\| (non-streaming|streaming) \| \d+ \| ", text, re.MULTILINE)) == 12
    assert text.count("| pass |") == 4 and text.count("| FAIL |") == 2  # streaming: behind on both


def test_litellm_when_measured_is_reported_in_every_cell_but_not_judged():
    rps, latency_ms = {**RPS, LITELLM: 150.0}, {**LATENCY_MS, LITELLM: (8.0, 20.0)}
    figures = summarise(_runs(rps, latency_ms, proxies=(DIRECT, KVGATE, SGLANG, LITELLM)))

    text = markdown(_result(figures))

    assert list(figures["streaming"]["32"]) == [DIRECT, KVGATE, SGLANG, LITELLM]
    assert figures["non-streaming"]["1"][LITELLM]["added_p50_ms"] == pytest.approx(7.9)
    assert "LiteLLM 1.108.7" in text and "LiteLLM" not in markdown(_result(summarise(_runs())))
    assert len(re.findall(r"^\| (non-streaming|streaming) \| \d+ \| litellm \|", text, re.MULTILINE)) == 4
    assert verdict(figures) == verdict(summarise(_runs()))


def test_the_floor_when_measured_splits_kvgates_cpu_per_request_into_the_stack_and_its_own_work():
    rps, latency_ms = {**RPS, FLOOR: 32000.0}, {**LATENCY_MS, FLOOR: (0.12, 0.4)}
    runs = [dict(r, proxy_cpu_s=2.4) if r["proxy"] == FLOOR else r
            for r in _runs(rps, latency_ms, proxies=(DIRECT, KVGATE, FLOOR, SGLANG))]
    figures = summarise(runs)

    text = markdown(_result(figures))

    # kvgate: 9.5 s of CPU over 90,000 requests; the floor: 2.4 s over 320,000; req/s: medians 30,400 vs 15,200
    assert ("- non-streaming: kvgate 0.106 ms of CPU a request, the floor 0.007 ms (2.00x sglang-router's req/s): "
            "0.098 ms (93%) is kvgate's own work.") in text
    assert '"python floor", `loadtest/peers/proxy_floor.py`' in text
    assert verdict(figures) == verdict(summarise(_runs()))  # reported, not judged
    plain = markdown(_result(summarise(_runs())))
    assert "python floor" not in plain and "kvgate's own work" not in plain


def test_other_work_on_the_machine_is_reported_as_its_median_and_worst_run():
    assert interference(_runs()) == {"median_cores": pytest.approx(0.015), "max_cores": pytest.approx(0.02)}


def test_a_peer_whose_streams_wait_with_an_idle_cpu_is_called_out():
    runs = [dict(r, proxy_cpu_s=1.0) if (r["proxy"], r["mode"]) == (SGLANG, "streaming") else r for r in _runs()]

    assert "Streaming through sglang-router waits rather than works" in markdown(_result(summarise(runs)))
    assert "waits rather than works" not in markdown(_result(summarise(_runs())))  # 95% busy: it works


def test_runs_that_shared_the_machine_with_other_work_are_named():
    runs = [dict(r, foreign_cores=0.4) if (r["proxy"], r["connections"], r["round"]) == (KVGATE, 1, 2) else r
            for r in _runs()]

    text = markdown(_result(summarise(runs), runs))

    assert "(above 0.1: kvgate non-streaming c=1 round 2, kvgate streaming c=1 round 2)" in text
