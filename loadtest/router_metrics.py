"""What a kvgate gateway's router says of itself at the end of a fleet run (its /metrics): cached tokens it
predicted vs those the workers reported, the prediction hit ratio (confirmed / predicted: the share of
predicted cached tokens the workers did report), the confirmed blocks it indexed per worker, and the means
of its own time to first token, admission queue wait and routing decision."""

from __future__ import annotations

from typing import Any

import httpx

from loadtest.prometheus_text import parse_samples

PREDICTED = "kvgate_router_predicted_cached_tokens_total"
REPORTED = "kvgate_router_reported_cached_tokens_total"
CONFIRMED = "kvgate_router_confirmed_cached_tokens_total"
INDEX_BLOCKS = "kvgate_kv_index_blocks"
# the gateway's own histograms, read as means in ms: from arrival to the first token sent, the wait in
# admission's queue, the routing decision (tokenizing included)
MEANS = {"ttft": "kvgate_time_to_first_token_seconds", "queue_wait": "kvgate_queue_wait_seconds",
         "decision": "kvgate_routing_decision_seconds"}


def parse_router_stats(metrics_text: str) -> dict[str, Any]:
    """Counters summed over pools; the hit ratio None until a cached token was predicted."""
    predicted, confirmed = _total(metrics_text, PREDICTED), _total(metrics_text, CONFIRMED)
    return {"prediction_hit_ratio": confirmed / predicted if predicted and confirmed is not None else None,
            "predicted_cached_tokens": predicted,
            "reported_cached_tokens": _total(metrics_text, REPORTED),
            "index_blocks": {labels.get("worker", ""): round(value)
                             for labels, value in parse_samples(metrics_text, INDEX_BLOCKS)},
            "mean_ms": {key: _mean_ms(metrics_text, family) for key, family in MEANS.items()}}


def router_stats(metrics_url: str) -> dict[str, Any] | None:
    """parse_router_stats of the page at metrics_url; None when it does not answer."""
    try:
        response = httpx.get(metrics_url, timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_router_stats(response.text)


def _mean_ms(text: str, family: str) -> float | None:
    """A histogram's mean in ms over all its series; None before its first observation."""
    count = sum(value for _, value in parse_samples(text, f"{family}_count"))
    return 1000 * sum(value for _, value in parse_samples(text, f"{family}_sum")) / count if count else None


def _total(text: str, name: str) -> int | None:
    samples = parse_samples(text, name)
    return round(sum(value for _, value in samples)) if samples else None
