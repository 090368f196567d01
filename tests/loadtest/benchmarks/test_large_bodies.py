"""The large-bodies benchmark's pure parts: the request bodies it sends, how an answer is classed,
the figures of a run, the verdict and the docs section (no processes)."""

from __future__ import annotations

import json

import pytest

from loadtest.benchmarks.large_bodies import (EXPECTED, INLINE, LARGE_KINDS, MAX_BODY_BYTES, OFFLOADED,
                                              TARGET_P99_RATIO, TARGET_P99_SLACK_MS, VOCAB_SIZE, completion_data,
                                              large_bodies, large_figures, markdown, outcome, summarise,
                                              token_ids_json, ttft_figures, verdict)
from loadtest.harness.gateway import MODEL

DURATION_S = 10.0


def _phase(ttft_ms, errors=0, records=None):
    phase = {"ttft_ms": ttft_ms, "errors": errors, "send_late_p99_ms": 1.0, "gateway_cpu_s": 5.5}
    if records is not None:
        phase["large"] = {"records": records, "body_bytes": {k: 1000 for k in LARGE_KINDS}, "start_late_s": 0.0}
    return phase


def _records(n_each=5, bad=0):
    records = [[kind, EXPECTED[kind], 1.0 + i, 20.0] for i in range(n_each) for kind in LARGE_KINDS]
    return records + [["ids_4mib", "413 request_too_large", 2.0, 5.0]] * bad


def _round(quiet_p99, loaded_p99, *, bad=0, small_errors=0):
    """100 samples per phase: p50 1 ms and p99 (= the largest, floor(0.99 * 100)) as given."""
    gateway = {"quiet": _phase([1.0] * 99 + [quiet_p99]),
               "loaded": _phase([1.0] * 99 + [loaded_p99], small_errors, _records(bad=bad))}
    return gateway


def _raw_rounds(offloaded, inline):
    return [{"order": [OFFLOADED, INLINE], "duration_s": DURATION_S, OFFLOADED: o, INLINE: i}
            for o, i in zip(offloaded, inline)]


def test_token_ids_fill_the_byte_budget_with_ids_in_the_vocabulary():
    text = token_ids_json(10_000, seed=1)

    ids = json.loads(text)
    assert 10_000 - 6 <= len(text) <= 10_000
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert token_ids_json(10_000, seed=1) == text


@pytest.mark.parametrize("prompt_json", ["[1,22,333,4444,55555]", '"lorem ipsum dolor sit amet"'], ids=["ids", "text"])
def test_a_completion_body_is_trimmed_to_its_budget_and_stays_valid_json(prompt_json):
    full = completion_data(prompt_json)
    budget = len(full) - 5

    trimmed = completion_data(prompt_json, budget)

    assert len(trimmed) <= budget
    body = json.loads(trimmed)
    assert body["model"] == MODEL and body["max_tokens"] == 1
    assert type(body["prompt"]) is type(json.loads(prompt_json))


def test_the_large_bodies_are_just_under_the_body_limit_and_over_the_context_length():
    bodies = {kind: json.loads(data) for kind, data in large_bodies(seed=0).items()}
    sizes = {kind: len(data) for kind, data in large_bodies(seed=0).items()}

    assert MAX_BODY_BYTES - 8192 < sizes["ids_4mib"] <= MAX_BODY_BYTES
    assert MAX_BODY_BYTES - 8192 < sizes["text_4mib"] <= MAX_BODY_BYTES
    assert len(bodies["ids_4mib"]["prompt"]) > 650_000
    assert len(bodies["text_4mib"]["prompt"]) > 4_000_000
    assert len(bodies["ids_8k"]["prompt"]) == 8000 and sizes["ids_8k"] < 64 * 1024


@pytest.mark.parametrize(("status", "body", "stream", "expected"), [
    (200, b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\ndata: [DONE]\n\n', True, "200"),
    (200, b'{"choices":[{"index":0,"text":"tok "}]}', False, "200"),
    (200, b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n', True, "200 bad answer"),
    (400, b'{"error":{"message":"too long","type":"invalid_request_error","code":"context_length_exceeded"}}', False,
     "400 context_length_exceeded"),
    (502, b"Bad Gateway", False, "502 None"),
], ids=["stream", "plain", "stream-without-done", "openai-error", "not-json"])
def test_an_answer_is_classed_by_status_and_error_code(status, body, stream, expected):
    assert outcome(status, body, stream) == expected


def test_ttft_p99_of_100_samples_is_the_largest_and_no_samples_give_none():
    figures = ttft_figures([float(i) for i in range(1, 101)])

    assert figures == {"n": 100, "p50_ms": 51.0, "p99_ms": 100.0, "max_ms": 100.0}
    assert ttft_figures([])["p99_ms"] is None


def test_large_requests_count_per_second_and_outcomes_other_than_expected():
    figures = large_figures(_records(n_each=5, bad=2), DURATION_S)

    assert figures["per_s"] == pytest.approx(22 / DURATION_S)
    assert figures["unexpected"] == 2
    assert figures["kinds"]["ids_4mib"]["outcomes"] == {EXPECTED["ids_4mib"]: 5, "413 request_too_large": 2}
    assert figures["kinds"]["chat_6k_tokens"] == {"sent": 5, "outcomes": {"200": 5}, "latency_p50_ms": 20.0}


def test_each_gateway_reports_its_median_round():
    rounds = _raw_rounds(offloaded=[_round(10.0, 12.0), _round(20.0, 40.0), _round(30.0, 33.0)],
                         inline=[_round(10.0, 500.0), _round(12.0, 300.0), _round(11.0, 400.0)])

    figures = summarise(rounds)["gateways"]

    assert figures[OFFLOADED]["quiet_p99_ms"] == 20.0 and figures[OFFLOADED]["loaded_p99_ms"] == 33.0
    assert figures[OFFLOADED]["p99_ratio"] == pytest.approx(33.0 / 20.0)
    assert figures[INLINE]["p99_diff_ms"] == pytest.approx(400.0 - 11.0)
    assert figures[INLINE]["large_per_s"] == pytest.approx(20 / DURATION_S)
    assert figures[OFFLOADED]["large_outcomes"]["ids_8k"] == {"200": 15}
    assert figures[OFFLOADED]["gateway_cpu_share_loaded"] == pytest.approx(5.5 / 11.0)


LIMIT_MS = TARGET_P99_RATIO * 10.0 + TARGET_P99_SLACK_MS


@pytest.mark.parametrize(("loaded_p99", "bad", "small_errors", "ttft_ok", "nothing_unexpected"), [
    (LIMIT_MS, 0, 0, True, True),
    (LIMIT_MS + 0.1, 0, 0, False, True),
    (10.0, 1, 0, True, False),
    (10.0, 0, 1, True, False),
], ids=["at-the-limit", "over-the-limit", "unexpected-large-status", "failed-small-stream"])
def test_the_verdict_is_judged_on_the_offloaded_gateway(loaded_p99, bad, small_errors, ttft_ok, nothing_unexpected):
    offloaded = _round(10.0, loaded_p99, bad=bad, small_errors=small_errors)
    inline = _round(10.0, 900.0, bad=3, small_errors=3)  # the baseline has no target

    judged = summarise(_raw_rounds([offloaded], [inline]))["verdict"]

    assert judged["loaded_p99_limit_ms"] == pytest.approx(LIMIT_MS)
    assert (judged["ttft_p99"], judged["nothing_unexpected"]) == (ttft_ok, nothing_unexpected)
    assert judged["pass"] == (ttft_ok and nothing_unexpected)


def test_no_quiet_samples_fail_the_verdict():
    assert verdict({"quiet_p99_ms": None, "loaded_p99_ms": 5.0, "unexpected": 0, "small_errors": 0})["pass"] is False


def test_the_section_shows_both_gateways_the_targets_and_the_command():
    rounds = _raw_rounds([_round(10.0, 12.0)], [_round(10.0, 500.0, bad=1)])
    result = {"command": ".venv/bin/python -m loadtest.benchmarks.large_bodies --quick", "machine": "test machine",
              "date": "2026-01-01T00:00:00", "load_average": {"start": [1.0, 1.0, 1.0], "end": [2.0, 1.5, 1.0]},
              "settings": {"rounds": 1, "duration_s": DURATION_S, "body_bytes": {k: 4_190_000 for k in LARGE_KINDS},
                           "cpus": {"gateway": [0], "load_generator": [1]}},
              "figures": summarise(rounds)}

    text = markdown(result)

    assert text.startswith("## Large bodies beside small streams")
    assert "`.venv/bin/python -m loadtest.benchmarks.large_bodies --quick`" in text
    assert "| small-stream TTFT p99 quiet / loaded, ms | 10.0 / 12.0 | 10.0 / 500.0 |" in text
    assert f"| {_ms_limit()} | 12.0 ms (limit {LIMIT_MS:.1f} ms) | pass |" in text
    assert "| 0 / 0 | pass |" in text
    assert "1 x 413 request_too_large" in text
    assert "4,190,000" in text


def _ms_limit() -> str:
    return f"TTFT p99 loaded <= {TARGET_P99_RATIO:g} x quiet p99 + {TARGET_P99_SLACK_MS:g} ms"
