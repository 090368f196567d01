"""The one percentile rule (loadtest/stats.py) behind every report and benchmark."""

from __future__ import annotations

import pytest

from loadtest.stats import percentile


@pytest.mark.parametrize(("samples", "q", "expected"), [
    ([3.0, 1.0, 2.0], 0.5, 2.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 3.0),  # the upper middle sample, not 2.5
    (list(range(1, 101)), 0.99, 100),  # index floor(0.99 * 100) = 99
    (list(range(1, 101)), 0.9, 91),
    ([7.0], 0.99, 7.0),
    ([1.0, 2.0], 1.0, 2.0),  # capped at the last sample
    ([1.0, 2.0], 0.0, 1.0),
], ids=["odd-median", "even-median", "p99-of-100", "p90-of-100", "one-sample", "q=1", "q=0"])
def test_percentile_is_an_observed_sample_at_floor_q_n(samples, q, expected):
    assert percentile(samples, q) == expected


@pytest.mark.parametrize(("samples", "q"), [([], 0.5), ([1.0], 1.5), ([1.0], -0.1)], ids=["empty", "q>1", "q<0"])
def test_no_samples_or_q_outside_0_1_is_an_error(samples, q):
    with pytest.raises(ValueError):
        percentile(samples, q)
