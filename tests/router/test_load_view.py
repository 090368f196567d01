"""LoadView counts requests at dispatch, first token and finish, and learns rates."""

from __future__ import annotations

import pytest

from router.load_view import LoadPriors, LoadView


@pytest.fixture
def loads(clock) -> LoadView:
    return LoadView(LoadPriors(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0, ewma_alpha=0.5), clock=clock)


def test_dispatch_counts_immediately(loads: LoadView) -> None:
    loads.on_dispatch("w0", "r1", prefill_tokens=500)
    load = loads.get("w0")
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (1, 500, 0)


def test_first_token_moves_prefill_to_decode_and_samples_the_rate(loads: LoadView, clock) -> None:
    loads.on_dispatch("w0", "r1", prefill_tokens=500)
    clock.advance(0.25)  # 2000 tokens/s measured
    loads.on_first_token("r1")
    load = loads.get("w0")
    assert (load.prefill_tokens_queued, load.decode_seqs_running) == (0, 1)
    assert load.prefill_tokens_per_s == pytest.approx(1500.0)


def test_finish_releases_and_samples_decode_rate(loads: LoadView, clock) -> None:
    loads.on_dispatch("w0", "r1", prefill_tokens=100)
    loads.on_first_token("r1")
    clock.advance(1.0)
    loads.on_finish("r1", output_tokens=31)  # 30 tokens/s
    load = loads.get("w0")
    assert (load.in_flight_requests, load.decode_seqs_running, load.prefill_tokens_queued) == (0, 0, 0)
    assert load.decode_tokens_per_s == pytest.approx(20.0)


def test_failure_before_first_token_releases_the_queued_prefill(loads: LoadView) -> None:
    loads.on_dispatch("w0", "r1", prefill_tokens=100)
    loads.on_finish("r1")
    load = loads.get("w0")
    assert (load.in_flight_requests, load.prefill_tokens_queued, load.decode_seqs_running) == (0, 0, 0)
    assert load.prefill_tokens_per_s == 1000.0


def test_scraped_queue_counts_when_larger_than_ours(loads: LoadView) -> None:
    loads.on_dispatch("w0", "r1", prefill_tokens=1)
    loads.set_scraped("w0", waiting_requests=3, running_requests=2, kv_usage_frac=0.4)
    assert loads.get("w0").num_requests == 5
    assert loads.get("w0").kv_usage_frac == 0.4


def test_kv_usage_outside_zero_one_is_rejected(loads: LoadView) -> None:
    with pytest.raises(ValueError, match=r"kv_usage_frac must be in \[0, 1\]"):
        loads.set_scraped("w0", kv_usage_frac=1.5)


def test_removing_a_worker_forgets_its_requests(loads: LoadView) -> None:
    loads.on_dispatch("w0", "r1", prefill_tokens=1)
    loads.remove_worker("w0")
    assert loads.worker_of("r1") is None
