"""prefix_approx: longest predicted prefix wins unless that worker is over the load bound."""

from __future__ import annotations

import pytest

from router.policies.prefix_approx import PrefixApprox
from tests.router._views import request, view


@pytest.mark.parametrize(
    ("table", "expected_first"),
    [
        ([view("a", predicted=2), view("b", predicted=9), view("c")], "b"),
        ([view("a", confirmed=50), view("b", predicted=1)], "b"),
        ([view("a", requests=2), view("b", requests=1)], "b"),
        ([view("a", predicted=9, requests=12), view("b", requests=1), view("c", requests=1)], "b"),
    ],
    ids=["longest-predicted", "ignores-confirmed-layer", "no-history-least-load", "hot-holder-skipped"],
)
def test_prefix_approx_choice(table: list, expected_first: str) -> None:
    assert PrefixApprox().choose(request(), table).worker_id == expected_first
