"""What a fleet run reads of the gateway router's own predictions at its end (loadtest/router_metrics.py)."""

from __future__ import annotations

from loadtest.router_metrics import parse_router_stats

METRICS = """# TYPE kvgate_router_predicted_cached_tokens_total counter
kvgate_router_predicted_cached_tokens_total{pool="default"} 224000.0
kvgate_router_predicted_cached_tokens_total{pool="other"} 1000.0
# TYPE kvgate_router_reported_cached_tokens_total counter
kvgate_router_reported_cached_tokens_total{pool="default"} 196000.0
# TYPE kvgate_router_confirmed_cached_tokens_total counter
kvgate_router_confirmed_cached_tokens_total{pool="default"} 180000.0
kvgate_router_confirmed_cached_tokens_total{pool="other"} 15000.0
# TYPE kvgate_kv_index_blocks gauge
kvgate_kv_index_blocks{worker="w0"} 189.0
kvgate_kv_index_blocks{worker="w1"} 188.0
"""


def test_predicted_and_reported_cached_tokens_their_ratio_and_the_index_per_worker():
    assert parse_router_stats(METRICS) == {"prediction_hit_ratio": 195000 / 225000, "predicted_cached_tokens": 225000,
                                           "reported_cached_tokens": 196000, "index_blocks": {"w0": 189, "w1": 188},
                                           "mean_ms": {"ttft": None, "queue_wait": None, "decision": None}}


def test_a_router_that_predicted_nothing_has_no_ratio():
    stats = parse_router_stats('kvgate_router_confirmed_cached_tokens_total{pool="default"} 0.0\n'
                               'kvgate_router_predicted_cached_tokens_total{pool="default"} 0.0\n')
    assert (stats["prediction_hit_ratio"], stats["predicted_cached_tokens"], stats["reported_cached_tokens"]) == (
        None, 0, None)


def test_the_gateways_own_timings_are_means_over_every_series():
    stats = parse_router_stats('kvgate_time_to_first_token_seconds_sum{pool="a"} 3.0\n'
                               'kvgate_time_to_first_token_seconds_count{pool="a"} 10.0\n'
                               'kvgate_time_to_first_token_seconds_sum{pool="b"} 1.0\n'
                               'kvgate_time_to_first_token_seconds_count{pool="b"} 10.0\n'
                               'kvgate_queue_wait_seconds_count{priority="normal"} 0.0\n')
    assert stats["mean_ms"] == {"ttft": 200.0, "queue_wait": None, "decision": None}
