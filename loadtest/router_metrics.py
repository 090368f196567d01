"""What a kvgate gateway's router says of itself at the end of a fleet run (its /metrics): cached tokens it
predicted vs those the workers reported, their ratio, and the confirmed blocks it indexed per worker."""

from __future__ import annotations

import math
from typing import Any

import httpx

from loadtest.overload_metrics import parse_samples

PREDICTED = "kvgate_router_predicted_cached_tokens_total"
REPORTED = "kvgate_router_reported_cached_tokens_total"
HIT_RATIO = "kvgate_router_prediction_hit_ratio"
INDEX_BLOCKS = "kvgate_kv_index_blocks"


def parse_router_stats(metrics_text: str) -> dict[str, Any]:
    """Counters summed over pools; the hit ratio None where absent or NaN (nothing predicted yet)."""
    ratios = [value for _, value in parse_samples(metrics_text, HIT_RATIO) if not math.isnan(value)]
    return {"prediction_hit_ratio": ratios[0] if ratios else None,
            "predicted_cached_tokens": _total(metrics_text, PREDICTED),
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
