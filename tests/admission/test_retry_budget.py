"""The retry budget with a fake clock: ratio of requests plus a floor, in a sliding window."""

import pytest

from admission.retry_budget import RetryBudget, RetryBudgetConfig


def spend_all(budget: RetryBudget) -> int:
    spent = 0
    while budget.try_spend():
        spent += 1
    return spent


def test_retries_are_capped_at_ratio_of_requests_plus_floor(clock):
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, min_retries_per_s=0.5, window_s=10), clock)
    for _ in range(1000):
        budget.record_request()
    assert spend_all(budget) == 100 + 5
    assert budget.refused == 1


def test_floor_allows_a_few_retries_with_no_traffic(clock):
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, min_retries_per_s=1.0, window_s=10), clock)
    assert spend_all(budget) == 10


def test_budget_refills_as_the_window_slides(clock):
    budget = RetryBudget(RetryBudgetConfig(ratio=0.5, min_retries_per_s=0.0, window_s=10), clock)
    for _ in range(20):
        budget.record_request()
    assert spend_all(budget) == 10
    clock.advance(11)
    assert not budget.try_spend()  # old requests left the window too
    for _ in range(4):
        budget.record_request()
    assert spend_all(budget) == 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ratio": 0}, "retry_budget.ratio must be in (0, 1]"),
    ({"min_retries_per_s": -1}, "retry_budget.min_retries_per_s must be >= 0"),
    ({"window_s": 0}, "retry_budget.window_s must be >= 1"),
], ids=["zero-ratio", "negative-floor", "zero-window"])
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        RetryBudgetConfig(**kwargs)
