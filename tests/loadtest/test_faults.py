"""Fault specs, recovery time, Prometheus counters, and the fault proxy in front of an upstream."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtest.fault_proxy import FaultState, build_app
from loadtest.faults import FaultSpec, parse_counters, parse_fault, recovery_time_s
from loadtest.types import RequestRecord


@pytest.mark.parametrize("text, expected", [
    ("kill:w1@10", FaultSpec("kill", 10.0, target="w1")),
    ("slow:w0@5-15:delay_ms=500", FaultSpec("slow", 5.0, target="w0", end_s=15.0, delay_ms=500.0)),
    ("error:w2@1.5-3:fraction=0.25", FaultSpec("error", 1.5, target="w2", end_s=3.0, error_fraction=0.25)),
    ("redis@7", FaultSpec("redis", 7.0)),
], ids=["kill", "slow", "error", "redis"])
def test_fault_specs_parse(text, expected):
    assert parse_fault(text) == expected


@pytest.mark.parametrize("text", ["kill@10", "slow:w1@5-15", "error:w1@5-2", "error:w1@1:colour=red", "nap:w1@1"],
                         ids=["kill-needs-target", "slow-needs-delay", "end-before-start", "unknown-option", "kind"])
def test_bad_fault_specs_are_refused(text):
    with pytest.raises(ValueError):
        parse_fault(text)


def _outcomes(pattern: str, step_s: float = 0.1) -> list[RequestRecord]:
    return [RequestRecord(index=i, scheduled_s=i * step_s, start_s=i * step_s, end_s=i * step_s + 0.05,
                          status=200 if c == "." else 503, error=None if c == "." else "http_503")
            for i, c in enumerate(pattern)]


def test_recovery_time_is_when_a_full_window_of_requests_succeeds_again():
    records = _outcomes("....xx.x" + "." * 30)
    assert recovery_time_s(records, fault_over_s=0.4, window=20) == pytest.approx(0.4)


def test_no_recovery_when_errors_never_stop():
    assert recovery_time_s(_outcomes("x." * 30), fault_over_s=0.0, window=10) is None


def test_counters_are_summed_over_labels_and_absent_ones_are_none():
    text = ('# TYPE kvgate_upstream_retries_total counter\n'
            'kvgate_upstream_retries_total{pool="a"} 3\nkvgate_upstream_retries_total{pool="b"} 2.0\n')
    counters = parse_counters(text, ("kvgate_upstream_retries_total", "kvgate_retry_budget_refusals_total"))
    assert counters == {"kvgate_upstream_retries_total": 5.0, "kvgate_retry_budget_refusals_total": None}


def test_fault_proxy_forwards_until_told_to_fail_then_answers_503():
    worker = httpx.MockTransport(lambda request: httpx.Response(
        200, stream=httpx.ByteStream(f"hello from {request.url.path}".encode())))
    app = build_app("http://worker", FaultState(), transport=worker)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            healthy = await client.get("/v1/models")
            control = await client.post("/_fault", json={"error_fraction": 1})
            failing = await client.post("/v1/completions", json={})
            return healthy, control, failing

    healthy, control, failing = asyncio.run(scenario())
    assert (healthy.status_code, healthy.text) == (200, "hello from /v1/models")
    assert control.json() == {"delay_ms": 0.0, "error_fraction": 1.0}
    assert failing.status_code == 503 and failing.json()["error"]["message"] == "injected fault"
