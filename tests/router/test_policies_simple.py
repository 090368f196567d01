"""round_robin, random, least_load and power_of_two on hand-built tables."""

from __future__ import annotations

import random

import pytest

from router.policies.least_load import LeastLoad
from router.policies.power_of_two import PowerOfTwo
from router.policies.random_choice import RandomChoice
from router.policies.round_robin import RoundRobin
from tests.router._views import request, view


def test_round_robin_rotates_the_first_choice() -> None:
    policy = RoundRobin()
    workers = [view("a"), view("b"), view("c")]
    firsts = [policy.choose(request(), workers).worker_id for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    assert policy.choose(request(), workers).worker_ids == ("b", "c", "a")


def test_random_ranks_every_worker_once_and_is_seeded() -> None:
    workers = [view(f"w{i}") for i in range(5)]
    first = RandomChoice(rng=random.Random(7)).choose(request(), workers).worker_ids
    again = RandomChoice(rng=random.Random(7)).choose(request(), workers).worker_ids
    assert first == again
    assert sorted(first) == [f"w{i}" for i in range(5)]


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ([view("a", requests=3), view("b", requests=1), view("c", requests=2)], ("b", "c", "a")),
        ([view("a", requests=1, queued=500), view("b", requests=1, queued=100)], ("b", "a")),
        ([view("a", requests=1, kv=0.9), view("b", requests=1, kv=0.2)], ("b", "a")),
        ([view("a", requests=0, waiting=4), view("b", requests=2)], ("b", "a")),
    ],
    ids=["fewest-requests", "then-queued-prefill", "then-kv-usage", "scraped-queue-counts"],
)
def test_least_load_ranks_by_load(table: list, expected: tuple[str, ...]) -> None:
    assert LeastLoad().choose(request(), table).worker_ids == expected


def test_power_of_two_picks_the_less_loaded_of_its_sample() -> None:
    workers = [view("a", requests=9), view("b", requests=1), view("c", requests=5)]
    rng = random.Random(0)
    sample = random.Random(0).sample(range(3), 2)
    expected = min((workers[i] for i in sample), key=lambda w: w.load.num_requests).worker_id
    decision = PowerOfTwo(rng=rng).choose(request(), workers)
    assert decision.worker_id == expected
    assert sorted(decision.worker_ids) == ["a", "b", "c"]


def test_power_of_two_never_picks_the_most_loaded_of_three_by_chance() -> None:
    workers = [view("a", requests=9), view("b", requests=1), view("c", requests=5)]
    policy = PowerOfTwo(rng=random.Random(1))
    assert {policy.choose(request(), workers).worker_id for _ in range(50)} <= {"b", "c"}


def test_power_of_two_with_one_worker_returns_it() -> None:
    assert PowerOfTwo(rng=random.Random(1)).choose(request(), [view("a")]).worker_ids == ("a",)
