"""wrk as the proxy benchmarks run it (loadtest/harness/wrk.py): its script, its command line, its output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loadtest.harness.wrk import parse_wrk, wrk_argv, wrk_script

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
