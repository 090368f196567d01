"""The AIMD concurrency limit with a fake clock: where it starts; its samples judged a window of
decrease_interval_s at a time (growing by one under good latency, cut by backoff_ratio when the median
is slow - deeper, by target / median, when max_cut is set lower - or a request is dropped); its bounds."""

import pytest

from admission.concurrency_limit import AimdLimit, LimitConfig

TARGET_S = 0.5
WINDOW_S = 0.5  # decrease_interval_s
FAST_S, SLOW_S = 0.1, 2 * TARGET_S


def limit_of(**kwargs) -> AimdLimit:
    return AimdLimit(LimitConfig(**{"max_limit": 40, "queue_delay_target_s": TARGET_S,
                                    "decrease_interval_s": WINDOW_S, **kwargs}))


def window(limit: AimdLimit, clock, delays: list[float | None], in_flight: int | None = None,
           dropped: bool = False) -> None:
    """One window: all its samples but the last at its start, the last decrease_interval_s later,
    closing it (in_flight defaults to the whole limit; dropped marks the first sample)."""
    for i, delay_s in enumerate(delays):
        if i == len(delays) - 1:
            clock.advance(WINDOW_S)
        busy = int(limit.limit) if in_flight is None else in_flight
        limit.on_sample(clock(), delay_s, in_flight=busy, dropped=dropped and i == 0)


def good(limit: AimdLimit, clock, windows: int = 1) -> None:
    """windows good windows in a row, of two busy fast samples each."""
    for _ in range(windows):
        window(limit, clock, [FAST_S, FAST_S])


@pytest.mark.parametrize(("kwargs", "initial"), [
    ({"max_limit": 40}, 10),
    ({"max_limit": 64}, 16),
    ({"max_limit": 3}, 1),
    ({"max_limit": 8, "min_limit": 4}, 4),
    ({"max_limit": 40, "initial_limit": 25}, 25),
], ids=["quarter-of-40", "quarter-of-64", "at-least-one", "at-least-min", "configured"])
def test_the_limit_starts_at_a_quarter_of_its_ceiling(kwargs, initial):
    assert AimdLimit(LimitConfig(**kwargs)).limit == initial


def test_a_good_window_adds_one_while_at_least_half_the_limit_is_in_use(clock):
    limit = limit_of()
    limit.on_sample(clock(), FAST_S, in_flight=5)
    clock.advance(WINDOW_S / 2)
    limit.on_sample(clock(), FAST_S, in_flight=4)  # under half the limit in use: not busy
    assert limit.limit == 10  # nothing moves before the window closes
    clock.advance(WINDOW_S / 2)
    limit.on_sample(clock(), TARGET_S, in_flight=10)  # exactly at the target is still good
    assert limit.limit == 11  # two busy samples, one window: one more
    clock.advance(WINDOW_S)
    limit.on_sample(clock(), FAST_S, in_flight=6)  # one busy sample alone is enough
    assert limit.limit == 12


def test_with_no_decrease_interval_each_busy_good_sample_is_a_window_and_adds_one(clock):
    limit = limit_of(decrease_interval_s=0)
    for in_flight in [10, 11, 5, 12]:  # 5 is under half of 12: not busy
        limit.on_sample(clock(), FAST_S, in_flight=in_flight)
    assert limit.limit == 13


def test_the_window_closes_on_the_first_sample_at_or_after_decrease_interval_s(clock):
    limit = limit_of()
    limit.on_sample(clock(), SLOW_S, in_flight=10)
    clock.advance(WINDOW_S - 1 / 64)
    limit.on_sample(clock(), SLOW_S, in_flight=10)
    assert limit.limit == 10
    clock.advance(1 / 64)
    limit.on_sample(clock(), SLOW_S, in_flight=10)
    assert limit.limit == pytest.approx(9.0)  # the default cut: backoff_ratio
    clock.advance(WINDOW_S - 1 / 64)  # the next window began with the sample that closed the last one
    limit.on_sample(clock(), SLOW_S, in_flight=9)
    assert limit.limit == pytest.approx(9.0)


def test_good_samples_with_little_in_use_do_not_grow_the_limit(clock):
    limit = limit_of()
    for _ in range(20):
        window(limit, clock, [FAST_S] * 3, in_flight=4)
    assert limit.limit == 10


def test_a_request_without_a_first_token_that_was_not_dropped_moves_nothing(clock):
    limit = limit_of()
    window(limit, clock, [None, None], in_flight=10)
    assert limit.limit == 10


def test_a_single_slow_sample_among_fast_ones_in_a_window_does_not_cut(clock):
    limit = limit_of()
    window(limit, clock, [FAST_S, 20.0, FAST_S], in_flight=10)
    assert limit.limit == 11  # the median is fast: a good window, one more


@pytest.mark.parametrize(("max_cut", "delay_s", "after"), [
    (0.7, 0.55, 9.0),    # just over the target: cut by backoff_ratio at least
    (0.7, 0.625, 8.0),   # target / median = 0.8
    (0.7, 1.0, 7.0),     # target / median = 0.5, no deeper than max_cut
    (0.7, 10.0, 7.0),
    (0.5, 0.55, 9.0),
    (0.5, 0.625, 8.0),
    (0.5, 1.0, 5.0),     # target / median = 0.5
    (0.5, 10.0, 5.0),    # never more than half at once
], ids=["slightly-slow-cuts-by-backoff-ratio", "slower-cuts-deeper", "twice-the-target-cuts-to-max-cut",
        "far-over-target-cuts-to-max-cut", "max-cut-half-slightly-slow", "max-cut-half-slower",
        "max-cut-half-twice-the-target-halves", "max-cut-half-far-over-target-still-halves"])
def test_a_window_whose_median_is_slow_cuts_by_target_over_median_clamped_to_max_cut(clock, max_cut, delay_s, after):
    limit = limit_of(max_cut=max_cut)
    window(limit, clock, [FAST_S, delay_s, delay_s], in_flight=10)
    assert limit.limit == pytest.approx(after)


@pytest.mark.parametrize("delay_s", [0.55, 0.625, 1.0, 10.0],
                         ids=["slightly-slow", "slower", "twice-the-target", "far-over-target"])
def test_by_default_every_slow_window_cuts_by_backoff_ratio_however_slow(clock, delay_s):
    config = LimitConfig(max_limit=40)
    assert config.max_cut is None and config.backoff_ratio == 0.9  # None: no deeper than backoff_ratio
    limit = limit_of()
    window(limit, clock, [FAST_S, delay_s, delay_s], in_flight=10)
    assert limit.limit == pytest.approx(9.0)
    window(limit, clock, [delay_s], in_flight=9)
    assert limit.limit == pytest.approx(8.1)


def test_a_dropped_request_cuts_by_backoff_ratio(clock):
    limit = limit_of(backoff_ratio=0.8, max_cut=0.8)  # max_cut may not exceed backoff_ratio
    window(limit, clock, [None, FAST_S], in_flight=10, dropped=True)
    assert limit.limit == pytest.approx(8.0)
    window(limit, clock, [None, FAST_S], in_flight=8, dropped=True)
    assert limit.limit == pytest.approx(6.4)


def test_a_drop_does_not_soften_the_cut_of_a_slow_window(clock):
    limit = limit_of(max_cut=0.5)
    window(limit, clock, [SLOW_S, SLOW_S], in_flight=10, dropped=True)
    assert limit.limit == pytest.approx(5.0)


def test_the_slow_samples_of_one_congested_moment_cut_once_per_window(clock):
    limit = limit_of(max_cut=0.5)
    limit.on_sample(clock(), 1.0, in_flight=10)
    clock.advance(0.2)
    limit.on_sample(clock(), 1.0, in_flight=10)
    limit.on_sample(clock(), None, in_flight=10, dropped=True)
    assert limit.limit == 10  # the window is still open
    clock.advance(0.3)
    limit.on_sample(clock(), 1.0, in_flight=10)
    assert limit.limit == pytest.approx(5.0)
    clock.advance(0.5)
    limit.on_sample(clock(), 1.0, in_flight=5)
    assert limit.limit == pytest.approx(2.5)


def test_the_limit_adapts_down_when_latency_rises_and_back_up_when_it_falls(clock):
    limit = limit_of(initial_limit=20, max_cut=0.5)
    good(limit, clock, 5)  # one more per good window
    assert limit.limit == 25
    for _ in range(3):  # congestion: three windows whose median is twice the target
        window(limit, clock, [SLOW_S, SLOW_S, FAST_S])
    assert limit.limit == pytest.approx(25 / 8)
    good(limit, clock, 10)
    assert limit.limit == pytest.approx(25 / 8 + 10)


def test_the_limit_never_goes_below_min_limit(clock):
    limit = limit_of(min_limit=3)
    for _ in range(20):
        limit.on_sample(clock(), 5.0, in_flight=10)
        limit.on_sample(clock(), None, in_flight=10, dropped=True)
        clock.advance(1.0)
    assert limit.limit == 3


def test_the_limit_never_goes_above_max_limit(clock):
    limit = limit_of(max_limit=12)
    good(limit, clock, 50)
    assert limit.limit == 12


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_limit": 0}, "1 <= min_limit <= max_limit"),
    ({"max_limit": 4, "min_limit": 5}, "1 <= min_limit <= max_limit"),
    ({"max_limit": 4, "initial_limit": 5}, "initial_limit must be in"),
    ({"max_limit": 4, "min_limit": 2, "initial_limit": 1}, "initial_limit must be in"),
    ({"max_limit": 4, "queue_delay_target_s": 0}, "queue_delay_target_s must be > 0"),
    ({"max_limit": 4, "decrease_interval_s": -1}, "decrease_interval_s >= 0"),
    ({"max_limit": 4, "backoff_ratio": 0.4, "max_cut": 0.4}, "0.5 <= max_cut <= backoff_ratio < 1"),
    ({"max_limit": 4, "backoff_ratio": 1.0}, "0.5 <= max_cut <= backoff_ratio < 1"),
    ({"max_limit": 4, "max_cut": 0.4}, "0.5 <= max_cut <= backoff_ratio < 1"),
    ({"max_limit": 4, "max_cut": 0.95, "backoff_ratio": 0.9}, "0.5 <= max_cut <= backoff_ratio < 1"),
], ids=["zero-max", "min-over-max", "initial-over-max", "initial-under-min", "zero-target",
        "negative-interval", "backoff-under-half", "backoff-of-one", "max-cut-under-half", "max-cut-over-backoff"])
def test_bad_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LimitConfig(**kwargs)


def test_requests_admitted_before_the_last_cut_do_not_cut_again(clock):
    """They report on the limit before the cut: one congested moment is one cut, as TCP reduces its
    window once per round trip. Those admitted since the cut count again."""
    limit = limit_of()
    window(limit, clock, [2.0, 2.0], in_flight=10)
    assert limit.limit == pytest.approx(9.0)
    cut_s = clock()
    for _ in range(3):  # slow answers of requests admitted before the cut
        clock.advance(WINDOW_S)
        limit.on_sample(clock(), 2.0, in_flight=9, admitted_s=cut_s - 1.0)
    assert limit.limit == pytest.approx(9.0)
    clock.advance(WINDOW_S)
    limit.on_sample(clock(), 2.0, in_flight=9, admitted_s=cut_s + 0.1)
    clock.advance(WINDOW_S)
    limit.on_sample(clock(), 2.0, in_flight=9, admitted_s=cut_s + 0.2)
    assert limit.limit == pytest.approx(8.1)
