"""Slow start (router/slow_start.py): a worker that comes into rotation cold takes a share of what the policy
would give it that ramps up over its pool's window; never held back when it holds the prompt, nor when every
candidate warms."""

from __future__ import annotations

import random

import pytest

from router.slow_start import MIN_SHARE, SlowStart

WINDOW_S = 30.0


def warming(clock, window_s: float = WINDOW_S) -> SlowStart:
    slow = SlowStart({"main": window_s}, clock=clock, rng=random.Random(7))
    slow.begin("cold", "main")
    return slow


def never_holds(worker: str) -> int:
    return 0


def test_the_share_ramps_from_a_tenth_to_whole_over_the_window_then_the_worker_is_warm(clock):
    slow = warming(clock)
    assert slow.share("cold") == MIN_SHARE and slow.share("warm") is None
    clock.advance(WINDOW_S / 2)
    assert slow.share("cold") == pytest.approx(0.25)
    clock.advance(WINDOW_S / 2)
    assert slow.share("cold") is None and slow.shares() == {}


def test_a_worker_ranked_first_every_time_gets_under_half_its_steady_share_over_the_first_third(clock):
    slow, taken = warming(clock), 0
    steps = 3000
    for _ in range(steps):  # the first third of the window, requests evenly spread
        ranked, _held_back = slow.rank(("cold", "w1", "w2"), never_holds)
        taken += ranked[0] == "cold"
        clock.advance(WINDOW_S / 3 / steps)
    assert taken / steps < 0.5 * (1 / 3)


def test_held_back_requests_go_to_the_best_ranked_warm_worker_in_order(clock):
    slow = warming(clock)
    outcomes = {slow.rank(("cold", "w1", "w2"), never_holds) for _ in range(200)}
    assert outcomes == {(("cold", "w1", "w2"), None), (("w1", "cold", "w2"), "cold")}


def test_a_warming_worker_that_holds_more_of_the_prompt_than_any_other_is_never_held_back(clock):
    slow = warming(clock)
    assert all(slow.rank(("cold", "w1"), {"cold": 3, "w1": 1}.get) == (("cold", "w1"), None) for _ in range(200))


def test_a_prefix_every_worker_holds_does_not_exempt_a_warming_worker(clock):
    slow = warming(clock)  # e.g. a chat template's first block, cached everywhere
    outcomes = {slow.rank(("cold", "w1"), {"cold": 1, "w1": 1}.get)[1] for _ in range(200)}
    assert outcomes == {None, "cold"}


def test_when_every_candidate_warms_the_policys_choice_stands(clock):
    slow = warming(clock)
    slow.begin("also-cold", "main")
    assert all(slow.rank(("cold", "also-cold"), never_holds) == (("cold", "also-cold"), None) for _ in range(200))


@pytest.mark.parametrize("window_s", [0.0], ids=["off"])
def test_a_pool_without_a_window_has_no_slow_start(clock, window_s):
    slow = warming(clock, window_s)
    assert slow.share("cold") is None and slow.rank(("cold", "w1"), never_holds) == (("cold", "w1"), None)
