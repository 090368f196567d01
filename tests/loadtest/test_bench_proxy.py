"""The proxy benchmark's pure parts: the upstream's answers and config, wrk's script and output, the
figures of a run, the verdict and the docs section (no processes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loadtest.bench_proxy import (CONNECTIONS, DIRECT, FLOOR, KVGATE, LITELLM, MODES, NUM_CHUNKS, SGLANG, _nginx_string,
                                  answer_body, answer_text, interference, markdown, nginx_conf, parse_wrk,
                                  request_body, summarise, verdict, wrk_argv, wrk_script)
from loadtest.sse import StreamReader

WRK_OUTPUT = """Running 10s test @ http://127.0.0.1:8080/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.20ms  300.00us   9.00ms   90.00%
  40000 requests in 10.00s, 12.00MB read
Requests/sec:   4000.00
BENCH {"requests": 40000, "duration_us": 10000000, "bytes": 12000000, "errors_connect": 0, "errors_read": 0, \
"errors_write": 0, "errors_status": 100, "errors_timeout": 2, "p50_us": 1100.0, "p90_us": 1500.0, "p99_us": 2500.0, \
"max_us": 9000.0, "mean_us": 1200.0}
"""


def _stream_reader(text: str) -> StreamReader:
    reader = StreamReader()
    for line in text.splitlines():
        reader.feed_line(line)
    return reader


def test_the_upstream_answers_whole_json_and_whole_sse():
    plain = json.loads(answer_body("chat", stream=False))
    reader = _stream_reader(answer_body("completion", stream=True))

    assert plain["choices"][0]["message"]["content"] == "tok " * NUM_CHUNKS
    assert plain["usage"]["completion_tokens"] == NUM_CHUNKS
    assert reader.done and reader.error is None and reader.text == "tok " * NUM_CHUNKS
    assert reader.usage is not None and reader.usage["completion_tokens"] == NUM_CHUNKS


def test_nginx_picks_the_sse_answer_only_for_a_streaming_body():
    conf = nginx_conf(18080, Path("/tmp/bench"))
    pattern = re.search(r"map \$request_body \$answer \{ '~(.+?)' sse; default json; \}", conf).group(1)

    assert re.search(pattern, request_body(stream=True))
    assert re.search(pattern, '{"model": "m", "stream" : true}')
    assert not re.search(pattern, request_body(stream=False))


def test_nginx_serves_each_completion_path_in_both_forms_on_its_own_port():
    conf = nginx_conf(18080, Path("/tmp/bench"))

    assert "listen 127.0.0.1:18080" in conf and "worker_processes 1;" in conf and "daemon off;" in conf
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert f"location = /_sse{path} {{ internal; default_type text/event-stream;" in conf
        assert f"location = /_json{path} {{ internal; default_type application/json;" in conf
    assert "\\n\\ndata: [DONE]\\n\\n'" in conf  # newlines as nginx escapes, inside one quoted string


@pytest.mark.parametrize("text", ["it's", "a\\b", "$uri"], ids=["quote", "backslash", "variable"])
def test_an_nginx_answer_with_a_character_nginx_would_interpret_is_refused(text):
    with pytest.raises(ValueError):
        _nginx_string(text)


def test_the_wrk_script_posts_the_request_body_and_prints_one_parseable_line():
    script = wrk_script(stream=True)

    body_literal = re.search(r"^wrk\.body = (.+)$", script, re.MULTILINE).group(1)
    assert json.loads(json.loads(body_literal))["stream"] is True
    assert 'wrk.method = "POST"' in script and "latency:percentile(99)" in script
    assert "io.write(string.format('BENCH {" in script


def test_wrk_output_is_read_from_its_bench_line_counting_only_2xx_answers():
    figures = parse_wrk(WRK_OUTPUT)

    assert figures["requests_per_s"] == pytest.approx(3990.0)
    assert figures["errors"] == 102
    assert (figures["p50_ms"], figures["p99_ms"], figures["max_ms"]) == (1.1, 2.5, 9.0)


def test_wrk_output_without_a_bench_line_is_an_error():
    with pytest.raises(ValueError, match="no BENCH line"):
        parse_wrk("Running 10s test @ http://127.0.0.1:1\n")


def test_wrk_runs_pinned_to_the_load_cpus_with_one_thread():
    argv = wrk_argv(18080, Path("s.lua"), 32, 10, {1})

    assert argv[:3] == ["taskset", "-c", "1"]
    assert argv[argv.index("-c", 3) + 1] == "32" and argv[argv.index("-t") + 1] == "1"
    assert argv[argv.index("-d") + 1] == "10s"  # whole seconds: wrk refuses "0.5s"
    assert argv[-1] == "http://127.0.0.1:18080/v1/chat/completions"
    assert wrk_argv(18080, Path("s.lua"), 1, 3, None)[0] == "wrk"


@pytest.mark.parametrize(("body", "stream", "expected"), [
    (answer_body("chat", False), False, "tok " * NUM_CHUNKS),
    (answer_body("chat", True), True, "tok " * NUM_CHUNKS),
    (answer_body("chat", True).replace("data: [DONE]\n\n", ""), True, None),
], ids=["json", "sse", "sse-without-done"])
def test_a_proxied_answer_counts_only_when_whole(body, stream, expected):
    assert answer_text(body, stream) == expected


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
    return {"command": ".venv/bin/python -m loadtest.bench_proxy", "machine": "a CPU, 2 cores", "date": "2026-12-01",
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
    assert "Command: `.venv/bin/python -m loadtest.bench_proxy`" in text
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
    assert '"python floor", `loadtest/proxy_floor.py`' in text
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
