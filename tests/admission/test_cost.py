"""A request's cost: uncached prompt, cached prompt and completion tokens, each at its own price."""

import pytest

from admission.cost import request_cost_usd

PRICES = {"prompt_per_1m": 2.0, "cached_per_1m": 0.5, "completion_per_1m": 8.0}


@pytest.mark.parametrize(("usage", "expected_usd"), [
    ({"prompt_tokens": 1_000_000, "completion_tokens": 0}, 2.0),
    ({"prompt_tokens": 0, "completion_tokens": 1_000_000}, 8.0),
    ({"prompt_tokens": 1000, "completion_tokens": 500, "prompt_tokens_details": {"cached_tokens": 400}},
     (600 * 2.0 + 400 * 0.5 + 500 * 8.0) / 1e6),
    ({"prompt_tokens": 1000, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 1000}},
     (1000 * 0.5 + 10 * 8.0) / 1e6),
    ({"prompt_tokens": 100, "completion_tokens": 10, "prompt_tokens_details": None}, (100 * 2.0 + 10 * 8.0) / 1e6),
    ({"prompt_tokens": 100, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": None}},
     (100 * 2.0 + 10 * 8.0) / 1e6),
    ({"prompt_tokens": 100, "completion_tokens": None}, 100 * 2.0 / 1e6),
    ({}, 0.0),
], ids=["prompt-only", "completion-only", "part-cached", "all-cached", "details-null", "cached-null",
        "completion-null", "empty-usage"])
def test_each_kind_of_token_is_charged_at_its_own_price(usage, expected_usd):
    assert request_cost_usd(usage, **PRICES) == pytest.approx(expected_usd)


def test_cached_tokens_beyond_the_prompt_are_not_charged_twice():
    usage = {"prompt_tokens": 100, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 150}}
    assert request_cost_usd(usage, **PRICES) == pytest.approx(100 * 0.5 / 1e6)


def test_a_prefix_cache_hit_makes_the_same_request_cheaper():
    cold = {"prompt_tokens": 4000, "completion_tokens": 200}
    warm = {**cold, "prompt_tokens_details": {"cached_tokens": 3800}}
    assert request_cost_usd(warm, **PRICES) < request_cost_usd(cold, **PRICES)
