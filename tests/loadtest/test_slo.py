"""Goodput and summary accounting on hand-built records."""

from __future__ import annotations

import pytest

from loadtest.slo import Slo, summarize, worker_load
from loadtest.types import RequestRecord


def _rec(i, ttft_ms=100.0, e2e_ms=1000.0, out=10, error=None, worker="w0", cached=50, prompt=100, **headers):
    return RequestRecord(index=i, scheduled_s=i, start_s=i, end_s=i + e2e_ms / 1000, status=200 if not error else 503,
                         error=error, ttft_ms=ttft_ms, itl_ms=(10.0,) * (out - 1), e2e_ms=e2e_ms, prompt_tokens=prompt,
                         output_tokens=out, cached_tokens=cached, headers={"x-kvgate-worker": worker, **headers})


@pytest.mark.parametrize("slo, good", [
    (Slo(), 4),
    (Slo(ttft_ms=150), 3),
    (Slo(ttft_ms=150, tpot_ms=100), 2),
    (Slo(e2e_ms=500), 0),
], ids=["no-slo", "ttft", "ttft-and-tpot", "e2e-too-tight"])
def test_goodput_counts_successes_that_meet_every_slo(slo, good):
    records = [_rec(0), _rec(1), _rec(2, ttft_ms=400), _rec(3, e2e_ms=2000), _rec(4, error="http_503")]
    summary = summarize(records, duration_s=2.0, slo=slo)
    assert summary["goodput_rps"] == pytest.approx(good / 2.0)
    assert summary["throughput_rps"] == pytest.approx(4 / 2.0)


def test_tpot_is_decode_time_per_token_after_the_first():
    assert _rec(0, ttft_ms=100, e2e_ms=1000, out=10).tpot_ms == pytest.approx(100.0)
    assert _rec(0, out=1).tpot_ms is None


def test_summary_reports_errors_hit_rate_tokens_and_failovers():
    records = [_rec(0, cached=80), _rec(1, cached=20, **{"x-kvgate-failovers": "2"}), _rec(2, error="http_503"),
               _rec(3, error="ConnectError")]
    summary = summarize(records, duration_s=1.0)
    assert summary["errors"] == {"http_503": 1, "ConnectError": 1}
    assert summary["prefix_hit_rate"] == pytest.approx(100 / 200)
    assert summary["output_tokens_per_s"] == pytest.approx(20.0)
    assert summary["failovers"] == 2
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)


def test_worker_load_lists_idle_workers_and_max_over_mean():
    records = [_rec(0, worker="w0"), _rec(1, worker="w0"), _rec(2, worker="w0"), _rec(3, worker="w1")]
    load = worker_load(records, workers=("w0", "w1", "w2"))
    assert load["counts"] == {"w0": 3, "w1": 1, "w2": 0}
    assert load["max_over_mean"] == pytest.approx(3 / (4 / 3))


def test_no_worker_header_means_no_worker_load():
    assert worker_load([RequestRecord(index=0, scheduled_s=0, start_s=0, end_s=1, status=200)]) is None
