"""session_affinity: same key -> same worker, bounded load, stable under membership change."""

from __future__ import annotations

from router.policies.session_affinity import SessionAffinity, SessionAffinityParams
from tests.router._views import request, view

WORKERS = [view(f"w{i}") for i in range(8)]


def test_same_session_goes_to_the_same_worker() -> None:
    policy = SessionAffinity()
    chosen = {policy.choose(request(session_id="s-42"), WORKERS).worker_id for _ in range(10)}
    assert len(chosen) == 1


def test_sessions_spread_over_workers() -> None:
    policy = SessionAffinity()
    chosen = {policy.choose(request(session_id=f"s-{i}"), WORKERS).worker_id for i in range(200)}
    assert len(chosen) == 8


def test_removing_a_worker_moves_only_its_sessions() -> None:
    policy = SessionAffinity()
    before = {i: policy.choose(request(session_id=f"s-{i}"), WORKERS).worker_id for i in range(300)}
    after = {i: policy.choose(request(session_id=f"s-{i}"), WORKERS[1:]).worker_id for i in range(300)}
    moved = {i for i in before if before[i] != after[i]}
    assert moved == {i for i in before if before[i] == "w0"}


def test_owner_over_the_load_bound_is_skipped() -> None:
    policy = SessionAffinity(SessionAffinityParams(epsilon=0.25))
    owner = policy.choose(request(session_id="s-1"), WORKERS).worker_id
    loaded = [view(w.worker_id, requests=10 if w.worker_id == owner else 1) for w in WORKERS]
    decision = policy.choose(request(session_id="s-1"), loaded)
    assert decision.worker_id != owner
    assert decision.worker_ids[-1] == owner
    assert decision.explanation[0].note == "ring owner over load bound"


def test_configured_header_is_the_key() -> None:
    policy = SessionAffinity(SessionAffinityParams(key_header="x-user"))
    a = policy.choose(request(headers={"x-user": "alice"}), WORKERS).worker_id
    assert all(policy.choose(request(headers={"x-user": "alice"}), WORKERS).worker_id == a for _ in range(5))


def test_no_key_falls_back_to_least_load() -> None:
    workers = [view("a", requests=2), view("b", requests=0)]
    decision = SessionAffinity().choose(request(), workers)
    assert decision.worker_ids == ("b", "a")
    assert decision.explanation[0].note == "no session key"
