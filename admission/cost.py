"""What a request costs: its usage at its pool's prices (USD per million tokens).

Cached prompt tokens have their own price (a prefix-cache hit costs the fleet much less prefill);
every request's tokens count, answered or not, so cost per answered request shows what failures
and retries cost too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def request_cost_usd(usage: Mapping[str, Any], *, prompt_per_1m: float, cached_per_1m: float,
                     completion_per_1m: float) -> float:
    """usage is an OpenAI usage object (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens)."""
    prompt = usage.get("prompt_tokens") or 0
    cached = min(prompt, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    completion = usage.get("completion_tokens") or 0
    return ((prompt - cached) * prompt_per_1m + cached * cached_per_1m + completion * completion_per_1m) / 1e6
