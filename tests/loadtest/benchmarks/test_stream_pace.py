"""The stream-pace benchmark's pure parts: a token's CPU from the two cells, and the docs section (no processes)."""

from __future__ import annotations

import pytest

from loadtest.benchmarks.stream_pace import markdown, per_token_us


def test_a_tokens_cpu_is_the_difference_of_the_cells_over_the_tokens_between_them():
    assert per_token_us(2.0, 6.8) == pytest.approx(100.0)  # 4.8 ms over 48 tokens


def proxy(short_ms: float, long_ms: float) -> dict:
    return {"cpu_ms_per_request": {"16": short_ms, "64": long_ms},
            "rounds_cpu_ms_per_request": {"16": [short_ms, short_ms], "64": [long_ms, long_ms]},
            "wall_ms_per_token": 6.9, "cpu_us_per_token": per_token_us(short_ms, long_ms)}


def test_the_section_gives_each_proxys_cpu_a_token_and_its_ratio_to_sglang_routers():
    result = {"command": "cmd", "machine": "m", "date": "d", "rounds": 2,
              "proxies": {"kvgate, this checkout": proxy(3.6, 10.8), "python floor": proxy(2.0, 7.76),
                          "sglang-router cache_aware": proxy(1.5, 5.1)}}
    text = markdown(result)
    assert "| kvgate, this checkout | 3.60 (3.60 / 3.60) | 10.80 (10.80 / 10.80) | 150 | 2.00x |" in text
    assert "| sglang-router cache_aware | 1.50 (1.50 / 1.50) | 5.10 (5.10 / 5.10) | 75 | 1.00x |" in text
    assert "above the floor: 30 us" in text and "~7 ms apart" in text


def test_without_sglang_router_the_section_says_how_to_install_it():
    text = markdown({"command": "cmd", "machine": "m", "date": "d", "rounds": 2,
                     "proxies": {"kvgate, this checkout": proxy(3.6, 10.8)}})
    assert "| kvgate, this checkout | 3.60 (3.60 / 3.60) | 10.80 (10.80 / 10.80) | 150 | - |" in text
    assert "sglang-router was not measured (not installed" in text
