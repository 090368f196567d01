"""The overload benchmark's pure parts: what each scenario offers, the figures of a run, the deadline
check, the judged rows and the docs section; the probe transport and the recording proxy over
in-process transports; and one --quick smoke run on real processes."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest

from kvgate.config import KvgateConfig
from kvgate.config.loader import build
from kvgate.keys import hash_key
from loadtest import recording_proxy
from loadtest.overload.fleet import ADMISSION_OFF, TenantSpec, gateway_config
from loadtest.overload.metrics import GaugeSampler, gauge_values, queue_wait_by_priority, summarize_gauges
from loadtest.overload.probe import ProbeTransport, error_code, gateway_duration_ms
from loadtest.overload.report import OFF, ON, fair_ratio, judge, refusals_by_code, section_markdown
from loadtest.overload.scenarios import (Offer, RequestShape, Scenario, build_specs, capacity_rps, closed_loop_specs,
                                         deadline_figures, default_scenarios, in_window, marker_name, rss_growth,
                                         tenant_figures)
from loadtest.slo import Slo
from loadtest.types import RequestRecord

SHAPE = RequestShape(prompt_words=20, max_tokens=4)


def _rec(i, *, tenant="std-a", scheduled_s=1.0, status=200, ttft_ms=100.0, e2e_ms=300.0, error=None):
    error = error if error is not None else (None if status == 200 else f"http_{status}")
    return RequestRecord(index=i, scheduled_s=scheduled_s, start_s=scheduled_s, end_s=scheduled_s + e2e_ms / 1000,
                         status=status, error=error, ttft_ms=ttft_ms if status == 200 else None, e2e_ms=e2e_ms,
                         output_tokens=4 if status == 200 else None, tenant=tenant)


def test_each_tenant_is_offered_its_multiple_of_capacity_merged_in_time_order():
    scenario = Scenario("mix", (Offer("crit", 0.4), Offer("std-b", 5.0)))
    specs = build_specs(scenario, capacity_rps=10.0, duration_s=60.0, shape=SHAPE, tag="mix-on")

    counts = Counter(s.tenant for s in specs)
    assert counts["crit"] == pytest.approx(0.4 * 10 * 60, rel=0.15)
    assert counts["std-b"] == pytest.approx(5 * 10 * 60, rel=0.05)
    offsets = [s.arrival_offset_s for s in specs]
    assert offsets == sorted(offsets) and offsets[-1] < 60.0
    assert [s.index for s in specs] == list(range(len(specs)))
    assert all(s.max_tokens == 4 and s.kind == "chat" for s in specs)
    markers = [recording_proxy.find_marker(s.messages[0]["content"].encode()) for s in specs]
    assert markers == [marker_name("mix-on", s.index) for s in specs]
    assert build_specs(scenario, 10.0, 60.0, SHAPE, "mix-on") == specs  # seeded


def test_closed_loop_requests_have_no_arrival_times_and_their_own_markers():
    specs = closed_loop_specs(3, "std-a", SHAPE, "capacity-admission")
    assert [s.arrival_offset_s for s in specs] == [None, None, None]
    assert recording_proxy.find_marker(specs[2].messages[0]["content"].encode()) == "capacity-admission-2"


def test_default_scenarios_cover_the_levels_the_critical_fair_and_light_tenants_and_deadlines():
    names = [s.name for s in default_scenarios()]
    assert names == ["load-2x", "load-5x", "load-10x", "critical-beside-flood", "fair-alone", "fair-beside-flood",
                     "light-beside-flood", "deadline-flood"]
    fair, light = default_scenarios()[5:7]
    assert fair.rate_rps("std-a", 10.0) == pytest.approx(4.0) and fair.rate_rps("std-b", 10.0) == pytest.approx(50.0)
    assert light.rate_rps("std-a", 10.0) == pytest.approx(3.5) and light.rate_rps("std-b", 10.0) == pytest.approx(50.0)
    assert light.duration_x == 3.0  # long enough to tell a loss of 1% apart
    assert default_scenarios()[-1].deadline_ms == 1000.0


def test_capacity_counts_answers_that_ended_inside_the_window():
    records = [_rec(0, scheduled_s=0.5, e2e_ms=400), _rec(1, scheduled_s=1.0), _rec(2, scheduled_s=3.0),
               _rec(3, scheduled_s=3.5, status=503), _rec(4, scheduled_s=4.9, e2e_ms=200)]
    assert capacity_rps(records, warmup_s=1.0, end_s=5.0) == pytest.approx(2 / 4.0)


def test_tenant_figures_count_goodput_loss_refusals_and_codes_over_the_window():
    records = [_rec(0, scheduled_s=0.5),  # warm-up: not counted
               _rec(1), _rec(2, ttft_ms=2500.0, e2e_ms=3000.0),
               _rec(3, status=503, e2e_ms=2.0), _rec(4, status=429, e2e_ms=4.0),
               _rec(5, status=None, error="timeout", e2e_ms=9000.0), _rec(6, tenant="std-b")]
    window = in_window(records, warmup_s=1.0, end_s=3.0, tenant="std-a")
    figures = tenant_figures(window, {3: "queue_full", 4: "requests_per_s"}, Slo(ttft_ms=2000), window_s=2.0,
                             server_ms={3: 0.25, 4: None})

    assert figures["offered"] == 5 and figures["good"] == 1
    assert figures["goodput_rps"] == pytest.approx(0.5) and figures["loss"] == pytest.approx(0.8)
    assert figures["answered"] == 2 and figures["refused"] == 2
    assert figures["refusal_ms"]["p50"] == 4.0 and figures["refusal_ms"]["max"] == 4.0
    assert figures["refusal_server_ms"]["max"] == 0.25  # only those the gateway timed
    assert figures["by_status"] == {"200": 2, "429": 1, "503": 1, "timeout": 1}
    assert figures["by_code"] == {"queue_full": 1, "requests_per_s": 1}
    assert figures["errors"] == {"timeout": 1}


def test_an_arrival_after_send_plus_deadline_is_late_and_retries_count_too():
    sent = {"r-0": 10.0, "r-1": 10.0, "r-2": 10.0}
    arrivals = {"r-0": [10.2], "r-1": [10.5, 11.3]}  # r-1 retried after its 1 s deadline; r-2 never sent on
    records = [_rec(0, ttft_ms=500.0), _rec(1, ttft_ms=1500.0)]
    figures = deadline_figures(sent, arrivals, 1000.0, records)
    assert (figures["sent"], figures["reached_worker"], figures["arrivals"]) == (3, 2, 3)
    assert figures["late_arrivals"] == 1 and figures["max_late_ms"] == pytest.approx(300.0)
    assert figures["first_token_after_deadline"] == 1


def test_rss_growth_is_last_minus_first_with_the_peak():
    growth = rss_growth([("start", 100_000), ("after a", 130_000), ("after b", 104_000)])
    assert (growth["growth_kib"], growth["peak_kib"]) == (4_000, 130_000)


def test_gateway_config_maps_hashed_keys_to_tenants_and_sets_admission_and_loads():
    base = {"gateway": {"host": "127.0.0.1", "port": 9000},
            "auth": {"keys": [], "dev_key_env": "KVGATE_API_KEY", "dev_tenant": "dev"},
            "pools": {"default": {"model": "m", "tokenizer": None, "policy": {"type": "round_robin", "parameters": {}},
                                  "workers": [{"name": "w0", "url": "http://127.0.0.1:9001/w0"}]}}}
    tenants = {"std-a": TenantSpec("std-a"), "crit": TenantSpec("crit", "critical", 2.0)}
    config = gateway_config(base, tenants, {"std-a": "key-a", "crit": "key-c"}, ADMISSION_OFF)

    assert config["auth"]["keys"] == [{"tenant": "std-a", "sha256": hash_key("key-a")},
                                      {"tenant": "crit", "sha256": hash_key("key-c")}]
    assert config["tenants"]["crit"] == {"priority": "critical", "weight": 2.0}
    assert base["auth"]["keys"] == []  # the base is left as it was
    loaded = build(KvgateConfig, config)
    assert loaded.pools["default"].admission.min_concurrency == 100000
    assert loaded.tenants["crit"].priority == "critical"


def test_error_code_reads_openai_style_bodies():
    assert error_code(b'{"error": {"message": "x", "type": "service_unavailable", "code": "queue_full"}}') \
        == "queue_full"
    assert error_code(b"not json") is None and error_code(b'{"error": "flat"}') is None


def test_probe_transport_adds_headers_notes_send_times_and_refusal_codes():
    seen = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-deadline-ms"))
        if b"refuse" in request.content:
            return httpx.Response(503, json={"error": {"message": "m", "type": "t", "code": "queue_timeout"}},
                                  headers={"server-timing": "db;dur=9, gateway;dur=0.375;desc=x"})
        return httpx.Response(200, text="data: [DONE]\n\n")

    probe = ProbeTransport([httpx.MockTransport(upstream)] * 2, {"x-request-deadline-ms": "1000"},
                           clock=iter([1.0, 2.0]).__next__)

    async def scenario():
        async with httpx.AsyncClient(transport=probe, base_url="http://gw") as client:
            ok = await client.post("/v1/chat/completions", content=b"bench-marker t-0 hello")
            refused = await client.post("/v1/chat/completions", content=b"bench-marker t-1 refuse")
            return ok.status_code, refused.status_code, refused.json()["error"]["code"]

    assert asyncio.run(scenario()) == (200, 503, "queue_timeout")
    assert seen == ["1000", "1000"]
    assert probe.sent_s == {"t-0": 1.0, "t-1": 2.0} and probe.codes == {"t-1": "queue_timeout"}
    assert probe.server_ms == {"t-1": 0.375}


@pytest.mark.parametrize(("header", "expected"), [(None, None), ("gateway;dur=1.5", 1.5), ("other;dur=2", None),
                                                  ("gateway", None), ("gateway;dur=x", None)],
                         ids=["absent", "gateway", "another-metric", "no-duration", "bad-duration"])
def test_the_gateways_own_time_is_read_from_server_timing(header, expected):
    assert gateway_duration_ms(header) == expected


def test_recording_proxy_forwards_by_worker_name_and_lists_marked_arrivals():
    worker = httpx.MockTransport(lambda request: httpx.Response(
        200, stream=httpx.ByteStream(f"{request.url.host}{request.url.path}".encode())))
    app = recording_proxy.build_app({"w0": "http://a:1", "w1": "http://b:2/"}, clock=iter([5.0, 6.0]).__next__,
                                    transport=worker)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            health = await client.get("/w0/health")
            first = await client.post("/w1/v1/chat/completions", content=b'{"m": "bench-marker run-7 text"}')
            second = await client.post("/w0/v1/chat/completions", content=b'{"m": "bench-marker run-7 text"}')
            unknown = await client.get("/w9/health")
            listing = await client.get("/_arrivals")
            return health.text, first.text, second.text, unknown.status_code, listing.json()

    health, first, second, unknown, listing = asyncio.run(scenario())
    assert (health, first, second, unknown) == ("a/health", "b/v1/chat/completions", "a/v1/chat/completions", 404)
    assert listing == {"arrivals": [["run-7", "w1", 5.0], ["run-7", "w0", 6.0]]}


def _figures(goodput_rps, *, loss=0.0, refusal_p99=None, server_p99=None, offered=100):
    pct = {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5, "max": 4.0}
    refusal = {**pct, "p50": None if refusal_p99 is None else 1.0, "p99": refusal_p99}
    server = {**pct, "p50": None if server_p99 is None else 0.2, "p99": server_p99}
    return {"offered": offered, "offered_rps": offered / 10, "good": round(offered * (1 - loss)),
            "goodput_rps": goodput_rps, "loss": loss, "answered": offered, "ttft_ms": pct, "refused": 0,
            "refusal_ms": refusal, "refusal_server_ms": server, "by_status": {"200": offered}, "by_code": {}, "errors": {},
            "send_late_ms": pct, "output_tokens": [16]}


def _result():
    def run(scenario, variant, tenants, deadline=None):
        return {"scenario": scenario, "variant": variant, "tenants": tenants, "deadline_ms": 1000.0,
                "deadline": deadline, "gateway_cpu_share": 0.2}

    late = {"sent": 50, "arrivals": 10, "late_arrivals": 0, "max_late_ms": None, "answered": 10,
            "first_token_after_deadline": 2}
    runs = [run("load-2x", ON, {"std-a": _figures(9.5, refusal_p99=30.0, server_p99=7.5)}),
            run("load-2x", OFF, {"std-a": _figures(2.0)}),
            run("critical-beside-flood", ON, {"crit": _figures(4.0, loss=0.02), "std-b": _figures(6.0)}),
            run("fair-alone", ON, {"std-a": _figures(4.0)}), run("fair-alone", OFF, {"std-a": _figures(4.0)}),
            run("fair-beside-flood", ON, {"std-a": _figures(3.8)}), run("fair-beside-flood", OFF, {"std-a": _figures(0.4)}),
            run("deadline-flood", ON, {"std-a": _figures(9.0)}, late)]
    settings = {"levels": [2.0], "num_workers": 2, "sim_timing_name": "x4", "admission_off": ADMISSION_OFF,
                "pin": True, "prompt_words": 600, "max_tokens": 16, "slo_ttft_ms": 2000.0, "capacity_concurrency": 32,
                "capacity_duration_s": 20.0, "duration_s": 20.0, "warmup_s": 3.0}
    growth = {"growth_kib": 2048, "first_kib": 102400, "last_kib": 104448, "peak_kib": 110000}
    return {"c_rps": 10.0, "settings": settings, "runs": runs, "rss": {ON: growth},
            "capacity": {ON: {"rps": 10.0, "ttft_ms": _figures(1)["ttft_ms"], "refused": 3}},
            "command": ".venv/bin/python -m loadtest.benchmarks.admission_overload", "machine": "test box", "date": "today",
            "load_average": {"start": [0.1, 0.1, 0.1], "end": [0.2, 0.2, 0.2]}, "out_path": "results/x.json"}


def test_judged_rows_compare_with_targets():
    rows = {r.figure: r for r in judge(_result())}
    assert rows["goodput / C at 2x C (one standard tenant)"].passed is True
    assert rows["goodput / C at 2x C (one standard tenant)"].no_admission == "0.20"
    server = next(r for f, r in rows.items() if f.startswith("2x C: refusal latency in the gateway"))
    assert server.passed is False and server.admission == "0.20 / 7.50"
    assert next(r for f, r in rows.items() if f.startswith("2x C: refusal latency at the client")).passed is None
    critical = next(r for f, r in rows.items() if f.startswith("critical tenant at 0.4x C"))
    assert critical.passed is False and critical.admission == "2.0% (2 of 100)" and critical.no_admission == "-"
    fair = next(r for f, r in rows.items() if f.startswith("standard tenant at 0.4x C"))
    assert (fair.passed, fair.admission, fair.no_admission) == (True, "0.95", "0.10")
    deadline = next(r for f, r in rows.items() if f.startswith("5x C, every request"))
    assert deadline.passed is True and deadline.admission.startswith("0 of 10 arrivals")
    assert next(r for f, r in rows.items() if f.startswith("gateway RSS")).passed is True
    assert fair_ratio(_result(), OFF) == pytest.approx(0.1)


def test_section_names_the_command_the_capacity_and_every_verdict():
    result = _result()
    rows = judge(result)
    text = section_markdown(result, rows)
    assert "Command: `.venv/bin/python -m loadtest.benchmarks.admission_overload`" in text
    assert "Capacity C = 10.00 req/s" in text
    assert text.count("| PASS |") == sum(r.passed is True for r in rows)
    assert text.count("| FAIL |") == sum(r.passed is False for r in rows) == 2
    assert "`results/x.json`" in text


@pytest.mark.slow
def test_quick_run_measures_capacity_and_checks_deadlines_on_real_processes(tmp_path):
    from loadtest.benchmarks.admission_overload import main

    out = tmp_path / "overload.json"
    assert main(["--quick", "--no-doc", "--scenarios", "deadline-flood", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["c_rps"] > 0 and result["capacity"][ON]["answered"] > 0
    assert {(r["scenario"], r["variant"]) for r in result["runs"]} == {("deadline-flood", ON), ("deadline-flood", OFF)}
    on = next(r for r in result["runs"] if r["variant"] == ON)
    assert on["tenants"]["std-a"]["offered"] > 0 and on["tenants"]["std-a"]["output_tokens"] in ([], [16])
    assert on["deadline"]["sent"] == on["sent"] and on["deadline"]["reached_worker"] > 0
    late = [row for row in result["judged"] if row["figure"].startswith("5x C, every request")]
    assert len(late) == 1 and late[0]["result"] in ("PASS", "FAIL")


def _raw(tenant, status, code, server_ms=None, scheduled_s=5.0):
    return {"tenant": tenant, "status": status, "code": code, "e2e_ms": 3.0 if status != 200 else 900.0,
            "server_ms": server_ms, "scheduled_s": scheduled_s}


def _light_result(light_loss, late_codes):
    """A light-beside-flood run: the flood refused 200 times at arrival (0.2 ms each in the gateway), plus
    refusals after queueing (late_codes, 1.5 s each); one refusal in the warm-up, not counted."""
    result = _result()
    light = {**_figures(3.5, loss=light_loss, offered=200), "by_code": {"overloaded": round(light_loss * 200)}}
    result["runs"] += [{"scenario": "light-beside-flood", "variant": v, "offers": [["std-a", 0.35], ["std-b", 5.0]],
                        "tenants": {"std-a": light, "std-b": _figures(6.0)}, "gateway_cpu_share": 0.1}
                       for v in (ON, OFF)]
    records = [_raw("std-b", 503, "overloaded", 0.2) for _ in range(200)] + [_raw("std-a", 200, None)]
    records += [_raw("std-b", 503, code, 1500.0) for code in late_codes]
    records += [_raw("std-b", 503, "queue_timeout", 1500.0, scheduled_s=1.0)]
    result["records"] = {"light-beside-flood/admission": records, "light-beside-flood/no-admission": []}
    return result


@pytest.mark.parametrize(("light_loss", "late_codes", "verdicts"), [
    (0.005, ["deadline_exceeded"], (True, True, True)),
    (0.02, [], (False, True, True)),
    (0.0, ["queue_timeout", "shed", "queue_timeout"], (True, False, False)),
], ids=["passes", "light-tenant-loses-2pct", "refused-after-queueing"])
def test_the_light_tenants_loss_and_the_share_and_speed_of_refusals_at_arrival_are_judged(light_loss, late_codes,
                                                                                          verdicts):
    rows = judge(_light_result(light_loss, late_codes))
    light = next(r for r in rows if r.figure.startswith("standard tenant at 0.35x C"))
    share, speed = (next(r for r in rows if r.figure.startswith(f"that run, both tenants, after its warm-up: {text}"))
                    for text in ("refusals decided at arrival", "refusal latency in the gateway"))
    assert (light.passed, share.passed, speed.passed) == verdicts
    overall = next(r for r in rows if r.figure.startswith("refusals decided at arrival"))
    assert overall.passed == share.passed and overall.admission == share.admission
    if not late_codes:
        assert share.admission == "100.0% of 200; 200, 3.0 / 3.0" and speed.admission == "0.20 / 0.20"


def test_refusal_latency_is_grouped_by_code_over_one_gateways_runs():
    def raw(status, code, e2e_ms, server_ms=None):
        return {"status": status, "code": code, "e2e_ms": e2e_ms, "server_ms": server_ms}

    result = {"records": {"load-2x/admission": [raw(503, "queue_timeout", 110.0, 100.0), raw(200, None, 900.0),
                                                raw(503, "deadline_unmeetable", 3.0, 0.5)],
                          "load-5x/admission": [raw(503, "queue_timeout", 130.0, 120.0)],
                          "load-5x/no-admission": [raw(503, "queue_full", 1.0)]}}
    assert refusals_by_code(result, ON) == {"deadline_unmeetable": (1, 3.0, 3.0, 3.0, 0.5),
                                            "queue_timeout": (2, 130.0, 130.0, 130.0, 120.0)}


METRICS_BEFORE = """# HELP kvgate_concurrency_limit A pool's adaptive concurrency limit.
kvgate_concurrency_limit{pool="default"} 24.5
kvgate_admitted_in_flight{pool="default"} 20.0
kvgate_queue_depth{pool="default",priority="critical"} 1.0
kvgate_queue_depth{pool="default",priority="standard"} 6.0
kvgate_queue_wait_seconds_count{pool="default",priority="critical"} 10.0
kvgate_queue_wait_seconds_sum{pool="default",priority="critical"} 0.5
kvgate_queue_wait_seconds_count{pool="default",priority="standard"} 100.0
kvgate_queue_wait_seconds_sum{pool="default",priority="standard"} 10.0
"""
METRICS_AFTER = METRICS_BEFORE.replace('critical"} 10.0', 'critical"} 14.0').replace('critical"} 0.5', 'critical"} 0.7')


def test_admission_gauges_and_queue_waits_are_read_from_the_gateways_metrics():
    assert gauge_values(METRICS_BEFORE) == {"limit": 24.5, "in_flight": 20.0, "queued": 7.0}
    waits = queue_wait_by_priority(METRICS_BEFORE, METRICS_AFTER)
    assert waits["critical"]["count"] == 4.0 and waits["critical"]["mean_ms"] == pytest.approx(50.0)
    assert waits["standard"] == {"count": 0.0, "mean_ms": None}
    assert summarize_gauges([{"limit": 10.0}, {"limit": 20.0}])["limit"] == {"min": 10.0, "mean": 15.0, "max": 20.0}


def test_gauge_sampler_scrapes_until_stopped():
    sampler = GaugeSampler("http://gw/metrics", interval_s=0.01, fetch=lambda url: METRICS_BEFORE).start()
    deadline = time.monotonic() + 5.0
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = sampler.stop()
    assert len(samples) >= 3 and samples[0]["limit"] == 24.5
