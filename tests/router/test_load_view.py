"""LoadView counts requests at dispatch, first token and finish, and learns rates."""

from __future__ import annotations

import pytest

from router.load_view import LoadPriors, LoadView, WorkerLoad


@pytest.fixture
def loads(clock) -> LoadView:
    priors = LoadPriors(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0, ewma_alpha=0.5, min_rate_sample_tokens=100)
    return LoadView(priors, clock=clock)


def test_dispatch_counts_immediately(loads: LoadView) -> None:
    loads.on_dispatch("w0", prefill_tokens=500)
    load = loads.get("w0")
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (1, 500, 0)


def test_first_token_moves_prefill_to_decode_and_samples_the_rate(loads: LoadView, clock) -> None:
    r1 = loads.on_dispatch("w0", prefill_tokens=500)
    clock.advance(0.25)  # 2000 tokens/s measured
    loads.on_first_token(r1)
    load = loads.get("w0")
    assert (load.prefill_tokens_queued, load.decode_seqs_running) == (0, 1)
    assert load.prefill_tokens_per_s == pytest.approx(2000.0)  # the first sample replaces the prior


@pytest.mark.parametrize(
    ("first_prefill", "second_prefill", "expected_rate"),
    [(300, 200, 1500.0), (0, 50, 1000.0)],
    ids=["queued-work-ahead-counts", "too-little-work-is-not-sampled"],
)
def test_prefill_rate_sample_counts_the_work_queued_ahead(
    loads: LoadView, clock, first_prefill: int, second_prefill: int, expected_rate: float
) -> None:
    r1 = loads.on_dispatch("w0", prefill_tokens=first_prefill)
    r2 = loads.on_dispatch("w0", prefill_tokens=second_prefill)
    loads.on_finish(r1)  # a failure: no sample from r1
    clock.advance(0.333333333)  # r2 waited for r1's 300 tokens, then its own 200: 1500 tokens/s
    loads.on_first_token(r2)
    assert loads.get("w0").prefill_tokens_per_s == pytest.approx(expected_rate, rel=1e-6)


def test_finish_releases_and_samples_decode_rate(loads: LoadView, clock) -> None:
    r1 = loads.on_dispatch("w0", prefill_tokens=100)
    loads.on_first_token(r1)
    clock.advance(1.0)
    loads.on_finish(r1, output_tokens=31)  # 30 tokens/s
    load = loads.get("w0")
    assert (load.in_flight_requests, load.decode_seqs_running, load.prefill_tokens_queued) == (0, 0, 0)
    assert load.decode_tokens_per_s == pytest.approx(30.0)


def test_failure_before_first_token_releases_the_queued_prefill(loads: LoadView) -> None:
    r1 = loads.on_dispatch("w0", prefill_tokens=100)
    loads.on_finish(r1)
    load = loads.get("w0")
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (0, 0, 0)
    assert load.prefill_tokens_per_s == 1000.0


def test_scraped_queue_counts_when_larger_than_ours(loads: LoadView) -> None:
    loads.on_dispatch("w0", prefill_tokens=1)
    loads.set_scraped("w0", waiting_requests=3, running_requests=2, kv_usage_frac=0.4)
    assert loads.get("w0").num_requests == 5
    assert loads.get("w0").kv_usage_frac == 0.4


def test_kv_usage_outside_zero_one_is_rejected(loads: LoadView) -> None:
    with pytest.raises(ValueError, match=r"kv_usage_frac must be in \[0, 1\]"):
        loads.set_scraped("w0", kv_usage_frac=1.5)


def test_removing_a_worker_forgets_it_and_its_requests_end_without_bringing_it_back(loads: LoadView) -> None:
    r1 = loads.on_dispatch("w0", prefill_tokens=1)
    loads.remove_worker("w0")
    loads.on_first_token(r1)
    loads.on_finish(r1)
    assert "w0" not in loads.loads
    assert loads.get("w0").in_flight_requests == 0  # a worker added again starts clean


def test_an_attempt_ends_once(loads: LoadView) -> None:
    r1 = loads.on_dispatch("w0", prefill_tokens=100)
    loads.on_finish(r1)
    loads.on_finish(r1)
    assert loads.on_first_token(r1) is None
    load = loads.get("w0")
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (0, 0, 0)


def test_num_requests_follows_every_change_of_the_counts() -> None:
    """num_requests is stored (read per candidate per decision): each change refreshes it."""
    loads = LoadView()
    assert loads.get("w0").num_requests == 0
    a = loads.on_dispatch("w0", 10)
    loads.on_dispatch("w0", 10)
    assert loads.get("w0").num_requests == 2
    loads.set_scraped("w0", waiting_requests=3, running_requests=1)
    assert loads.get("w0").num_requests == 4
    loads.set_scraped("w0", waiting_requests=None, running_requests=None)
    loads.on_finish(a)
    assert loads.get("w0").num_requests == 1
    assert WorkerLoad(in_flight_requests=2, scraped_waiting_requests=5).num_requests == 5


def test_our_own_requests_move_the_scraped_snapshot_on_until_the_next_scrape(loads: LoadView) -> None:
    """Scraped while r1 waited: its first token and finish update the snapshot, so a worker whose
    only request just finished does not look busy for up to a scrape interval."""
    r1 = loads.on_dispatch("w0", prefill_tokens=10)
    loads.set_scraped("w0", waiting_requests=2, running_requests=0)  # r1 and another gateway's request
    loads.on_first_token(r1)
    load = loads.get("w0")
    assert (load.scraped_waiting_requests, load.scraped_running_requests, load.num_requests) == (1, 1, 2)
    loads.on_finish(r1, output_tokens=4)
    assert (load.scraped_waiting_requests, load.scraped_running_requests, load.num_requests) == (1, 0, 1)
    r2 = loads.on_dispatch("w0", prefill_tokens=10)
    loads.on_finish(r2)  # failed before its first token
    assert (load.scraped_waiting_requests, load.num_requests) == (0, 0)


def test_the_scraped_kv_usage_moves_with_the_running_requests_until_the_next_scrape(loads: LoadView) -> None:
    """Scraped with 4 of our requests running and the cache 90% in use: as they finish, the usage
    falls by an equal share each (a full cache at the scrape would otherwise repel every request
    for a whole scrape interval); a first token adds a share; the next scrape replaces it."""
    flights = [loads.on_dispatch("w0", prefill_tokens=10) for _ in range(5)]
    for flight in flights[:4]:
        loads.on_first_token(flight)
    loads.set_scraped("w0", waiting_requests=1, running_requests=4, kv_usage_frac=0.9)
    load = loads.get("w0")
    loads.on_finish(flights[0], output_tokens=2)
    loads.on_finish(flights[1], output_tokens=2)
    assert load.kv_usage_frac == pytest.approx(0.45)
    loads.on_first_token(flights[4])
    assert load.kv_usage_frac == pytest.approx(0.675)
    for flight in flights[2:]:
        loads.on_finish(flight, output_tokens=2)
    assert (load.scraped_running_requests, load.kv_usage_frac) == (0, 0.0)
    loads.set_scraped("w0", running_requests=0, kv_usage_frac=0.3)  # another gateway's request holds blocks
    loads.on_first_token(loads.on_dispatch("w0", prefill_tokens=10))
    assert load.kv_usage_frac == 0.3  # no share to scale from at 0 running


def test_the_first_rate_samples_are_averaged_then_weighted_by_ewma_alpha(clock) -> None:
    """A prior far off (a CPU worker is ~30x slower than the GPU-class default) must not linger:
    the first samples are a running mean, after which each new one weighs ewma_alpha."""
    loads = LoadView(LoadPriors(prefill_tokens_per_s=8000.0, ewma_alpha=0.2, min_rate_sample_tokens=100), clock=clock)
    rates = []
    for i, seconds in enumerate((1.0, 0.5, 1.0, 1.0, 1.0, 1.0)):  # 250, 500, then 250 tokens/s
        flight = loads.on_dispatch("w0", prefill_tokens=250)
        clock.advance(seconds)
        loads.on_first_token(flight)
        loads.on_finish(flight)
        rates.append(loads.get("w0").prefill_tokens_per_s)
    assert rates[:5] == pytest.approx([250.0, 375.0, 1000 / 3, 312.5, 300.0])  # running mean (the 5th: 1/5 = alpha)
    assert rates[5] == pytest.approx(0.8 * 300.0 + 0.2 * 250.0)


def test_peer_replicas_requests_count_in_the_load_until_they_report_again_or_go_silent(loads: LoadView,
                                                                                         clock) -> None:
    own = loads.on_dispatch("w1", prefill_tokens=100)
    loads.set_peer_load("r2", {"w1": (2, 300, 1), "unknown": (9, 9, 9)})
    load = loads.get("w1")
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (3, 400, 1)
    assert load.num_requests == 3
    assert loads.own_load()["w1"] == (1, 100, 0)  # what this view tells its peers: its own requests only
    loads.set_peer_load("r2", {"w1": (1, 0, 1)})  # a newer report replaces the last
    assert (load.in_flight_requests, load.prefill_tokens_queued) == (2, 100)
    loads.on_first_token(own)
    assert loads.own_load()["w1"] == (1, 0, 1) and load.decode_seqs_running == 2
    clock.advance(2.0)
    loads.set_peer_load("r3", {"w1": (1, 50, 0)})
    loads.expire_peers(max_age_s=1.5)  # r2 went silent 2 s ago; r3 just reported
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (2, 50, 1)
    loads.set_peer_load("r3", {})  # nothing in flight there any more
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (1, 0, 1)
    assert (load.peer_in_flight_requests, load.peer_prefill_tokens_queued, load.peer_decode_seqs_running) == (0, 0, 0)


def test_a_worker_removed_and_added_again_starts_without_the_peers_old_reports(loads: LoadView) -> None:
    loads.set_peer_load("r2", {"w1": (2, 300, 1)})
    loads.remove_worker("w1")
    loads.add_worker("w1")
    loads.set_peer_load("r2", {"w1": (1, 10, 0)})
    assert (loads.get("w1").in_flight_requests, loads.get("w1").prefill_tokens_queued) == (1, 10)
