"""What a kvgate gateway's router says of itself at the end of a fleet run (its /metrics): cached tokens it
predicted vs those the workers reported, the prediction hit ratio (confirmed / predicted: the share of
predicted cached tokens the workers did report), and the confirmed blocks it indexed per worker."""

from __future__ import annotations

from typing import Any

import httpx

from loadtest.overload_metrics import parse_samples

PREDICTED = "kvgate_router_predicted_cached_tokens_total"
REPORTED = "kvgate_router_reported_cached_tokens_total"
CONFIRMED = "kvgate_router_confirmed_cached_tokens_total"
INDEX_BLOCKS = "kvgate_kv_index_blocks"


def parse_router_stats(metrics_text: str) -> dict[str, Any]:
    """Counters summed over pools; the hit ratio None until a cached token was predicted."""
    predicted, confirmed = _total(metrics_text, PREDICTED), _total(metrics_text, CONFIRMED)
    return {"prediction_hit_ratio": confirmed / predicted if predicted and confirmed is not None else None,
            "predicted_cached_tokens": predicted,
            "reported_cached_tokens": _total(metrics_text, REPORTED),
            "index_blocks": {labels.get("worker", ""): round(value)
                             for labels, value in parse_samples(metrics_text, INDEX_BLOCKS)}}


def router_stats(metrics_url: str) -> dict[str, Any] | None:
    """parse_router_stats of the page at metrics_url; None when it does not answer."""
    try:
        response = httpx.get(metrics_url, timeout=5.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_router_stats(response.text)


def _total(text: str, name: str) -> int | None:
    samples = parse_samples(text, name)
    return round(sum(value for _, value in samples)) if samples else None
