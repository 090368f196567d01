"""Rotation: breakers, health checks and slow-worker ejection take workers out and bring them back."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest

from gateway.breakers import CLOSED, HALF_OPEN, OPEN, WorkerBreaker
from gateway.outliers import OutlierDetector
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.routing_config import routing_rules
from kvgate.config import KvgateConfig, OutlierConfig, build
from router.kv_events import BlockStored
from router.kv_index import KvIndex
from router.router import Router
from router.types import WorkerSpec
from tests.gateway.conftest import MODEL, gateway_config, start_gateway, worker_entry
from tests.processes import Process, fake_worker_process, running


def test_breaker_opens_after_consecutive_failures_then_one_trial_closes_it():
    changes = []
    breaker = WorkerBreaker("w", fail_max=3, reset_timeout_s=0.2, on_change=lambda *c: changes.append(c[1:]))
    for _ in range(2):
        breaker.record_failure()
    breaker.record_success()  # resets the count: failures must be consecutive
    for _ in range(3):
        breaker.record_failure()
    assert breaker.state == OPEN and not breaker.available()
    time.sleep(0.25)
    assert breaker.available()
    breaker.begin_attempt()
    assert not breaker.available()  # one trial at a time
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.available()
    assert (CLOSED, OPEN) in changes and changes[-1] == (HALF_OPEN, CLOSED)


def test_failed_trial_reopens_the_breaker():
    breaker = WorkerBreaker("w", fail_max=1, reset_timeout_s=0.1)
    breaker.record_failure()
    time.sleep(0.15)
    breaker.begin_attempt()
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.available()


def test_slow_worker_is_ejected_against_its_peers_and_readmitted_later(clock):
    detector = OutlierDetector(OutlierConfig(min_samples=5, ratio=3.0, base_latency_s=0.1, ejection_s=30.0), clock)
    for worker in ("a", "b", "c"):
        detector.add_worker(worker)
    for _ in range(5):
        detector.observe("a", 0.05, expected_s=0.04)  # a cache hit: slowness (0.05 + 0.1) / (0.04 + 0.1)
        detector.observe("b", 2.4, expected_s=2.0)  # long prompts, on time: slowness 1.2
    ejected = [detector.observe("c", 3.0, expected_s=0.5) for _ in range(5)]  # (3.0 + 0.1) / (0.5 + 0.1) = 5.2
    assert ejected == [False] * 4 + [True]
    assert detector.is_ejected("c") and not detector.is_ejected("a")
    clock.advance(31)
    assert not detector.is_ejected("c")


@pytest.mark.parametrize(("peers", "worker"), [
    ((0.1, 0.1), (3.0, 2.5)),
    ((0.1, 0.1), (0.3, 0.0)),
    ((0.02, 0.0), (2.0, 2.0)),
], ids=["long-prompts-on-time", "tiny-prompts-a-few-steps", "cold-prompts-beside-peers-serving-cache-hits"])
def test_a_worker_busy_with_its_work_is_not_ejected(clock, peers, worker):
    """Raw time to first token far above its peers', but as the router expected for the work: the
    last case is a fast engine whose peers answer cache hits in 20 ms while it computes prompts."""
    detector = OutlierDetector(OutlierConfig(min_samples=3, ratio=3.0, base_latency_s=0.25), clock)
    first_token_s, expected_s = peers
    for _ in range(3):
        detector.observe("a", first_token_s, expected_s)
        detector.observe("b", first_token_s * 1.2, expected_s)
    assert not any(detector.observe("c", *worker) for _ in range(10))


def test_one_very_slow_request_does_not_eject_a_worker_but_a_run_of_them_does(clock):
    """A single long prompt can take 10x the router's linear expectation on a healthy worker
    (attention grows with the prompt's square): one observation counts for at most 2 x ratio."""
    detector = OutlierDetector(OutlierConfig(min_samples=3, ratio=3.0, base_latency_s=0.25), clock)
    for _ in range(3):
        for worker in ("a", "b", "c"):
            detector.observe(worker, 0.3, expected_s=0.3)
    assert not detector.observe("c", 63.0, expected_s=5.0)  # slowness 12, counted as 6
    for _ in range(10):  # back to normal
        detector.observe("c", 0.3, expected_s=0.3)
    assert [detector.observe("c", 63.0, expected_s=5.0) for _ in range(3)] == [False, False, True]


def test_at_most_the_configured_fraction_of_a_pool_is_ejected(clock):
    detector = OutlierDetector(OutlierConfig(min_samples=1, ratio=2.0, base_latency_s=0.01,
                                             max_ejected_fraction=0.34), clock)
    for worker in ("a", "b", "c"):
        detector.add_worker(worker)
    detector.observe("a", 0.01, expected_s=0.01)
    assert detector.observe("b", 1.0, expected_s=0.01)
    assert not detector.observe("c", 1.0, expected_s=0.01)  # a second ejection would take 2 of 3 workers out


def test_whether_another_worker_could_take_over_is_asked_only_of_a_worker_slow_enough_to_eject(clock):
    detector = OutlierDetector(OutlierConfig(min_samples=1, ratio=2.0, base_latency_s=0.01), clock)
    asked = []

    def may_eject() -> bool:
        asked.append(True)
        return False  # e.g. the pool's last worker in rotation

    detector.observe("a", 0.01, expected_s=0.01)
    assert not detector.observe("c", 0.01, expected_s=0.01, may_eject=may_eject) and not asked  # on time
    assert not detector.observe("b", 1.0, expected_s=0.01, may_eject=may_eject) and asked == [True]  # slow: kept
    assert detector.observe("b", 1.0, expected_s=0.01)  # slow, and another worker could take over


@pytest.mark.parametrize(("leave", "entries_kept"), [("ejected", True), ("breaker-open", False)],
                         ids=["ejected-keeps-its-entries", "failed-drops-them"])
def test_leaving_rotation_drops_index_entries_only_when_the_worker_failed(leave, entries_kept):
    """An ejected worker is alive and its KV events keep its entries true: when it rejoins, the
    prefixes it holds draw their requests back. A failed one's cache is unknown."""
    config = build(KvgateConfig, gateway_config(
        [worker_entry(name, f"http://127.0.0.1:{port}") for name, port in (("a", 1), ("b", 2), ("c", 3))], None,
        outliers={"min_samples": 1, "ratio": 2.0}, breaker={"fail_max": 1}))
    index = KvIndex()
    router = Router({"default": [WorkerSpec(name, MODEL, 16) for name in "abc"]}, routing_rules(config), index=index)
    fleet = Fleet(config, router, GatewayMetrics(), http=None)  # no health checks run here
    index.apply("c", [BlockStored([1, 2], None, list(range(32)), 16, None, "GPU")])
    fleet.record_attempt("a", ok=True, first_byte_s=1.0, expected_first_byte_s=1.0)
    fleet.record_attempt("b", ok=True, first_byte_s=1.0, expected_first_byte_s=1.0)
    if leave == "ejected":
        fleet.record_attempt("c", ok=True, first_byte_s=5.0, expected_first_byte_s=1.0)
    else:
        fleet.record_attempt("c", ok=False)
    assert not fleet.available("c") and not fleet.workers["c"].in_rotation
    assert router.stats().index.blocks_per_worker["c"] == (2 if entries_kept else 0)


def two_pool_fleet(**outliers) -> Fleet:
    """Pool "default": workers a, b, c; pool "solo": worker s (another model). No health checks run."""
    config = gateway_config([worker_entry(name, f"http://127.0.0.1:{port}") for name, port in (("a", 1), ("b", 2),
                                                                                              ("c", 3))], None,
                            outliers={"min_samples": 1, "ratio": 2.0, **outliers})
    config["pools"]["solo"] = {"model": "other-model", "workers": [worker_entry("s", "http://127.0.0.1:4")]}
    built = build(KvgateConfig, config)
    router = Router({"default": [WorkerSpec(n, MODEL, 16) for n in "abc"], "solo": [WorkerSpec("s", "other-model", 16)]},
                    routing_rules(built), index=KvIndex())
    return Fleet(built, router, GatewayMetrics(), http=None)


def test_a_pools_last_worker_in_rotation_is_never_ejected():
    fleet = two_pool_fleet(max_ejected_fraction=1.0)
    for name in "abc":
        fleet.record_attempt(name, ok=True, first_byte_s=0.1, expected_first_byte_s=0.1)
    for _ in range(3):  # b's breaker opens (fail_max 3); c fails its health checks
        fleet.record_attempt("b", ok=False)
    fleet.workers["c"].healthy = False
    assert not fleet.available("b") and not fleet.available("c")
    for _ in range(5):
        fleet.record_attempt("a", ok=True, first_byte_s=9.0, expected_first_byte_s=0.1)
    assert fleet.available("a")  # slow against its peers' samples, but the only one left to serve the pool
    fleet.workers["c"].healthy = True
    fleet.record_attempt("a", ok=True, first_byte_s=9.0, expected_first_byte_s=0.1)
    assert not fleet.available("a")  # c takes its requests now


def test_slowness_is_judged_against_the_workers_own_pool():
    """Pool "solo" is slow for its work (another model, another engine): that does not make pool
    "default"'s workers look fast, nor its own worker an outlier."""
    fleet = two_pool_fleet()
    for _ in range(3):
        fleet.record_attempt("s", ok=True, first_byte_s=1.0, expected_first_byte_s=0.1)  # slowness ~10
        for name in "ab":
            fleet.record_attempt(name, ok=True, first_byte_s=0.1, expected_first_byte_s=0.1)
    fleet.record_attempt("c", ok=True, first_byte_s=0.1, expected_first_byte_s=0.1)
    assert all(fleet.available(name) for name in "abcs")
    for _ in range(3):
        fleet.record_attempt("c", ok=True, first_byte_s=1.0, expected_first_byte_s=0.1)  # c slow against a, b
    assert not fleet.available("c")


def test_the_log_says_joined_for_a_first_entry_and_rejoined_only_after_leaving(caplog):
    """A worker still loading when the gateway starts joins rotation; one that left it rejoins."""
    fleet = two_pool_fleet()
    worker = fleet.workers["a"]
    worker.healthy = False
    fleet._refresh_rotation(worker)  # the first health check has not passed yet
    worker.answered, worker.healthy = True, True
    with caplog.at_level("INFO", logger="kvgate.gateway"):
        fleet._refresh_rotation(worker)
        worker.healthy = False
        fleet._refresh_rotation(worker)
        worker.healthy = True
        fleet._refresh_rotation(worker)
    assert [r.getMessage() for r in caplog.records] == [
        "worker a joined rotation", "worker a left rotation (healthy=False breaker=closed ejected=False)",
        "worker a rejoined rotation"]


@pytest.mark.slow
def test_a_dead_worker_leaves_rotation_and_rejoins_when_it_comes_back(tmp_path):
    with ExitStack() as stack:
        first = fake_worker_process("status503")
        stack.enter_context(running(first))
        other = stack.enter_context(running(fake_worker_process("status503")))
        config = gateway_config([worker_entry("a", first.url), worker_entry("b", other.url)], None)
        gateway = start_gateway(stack, config, tmp_path)
        first.stop()
        assert _wait_for(lambda: 'kvgate_worker_healthy{worker="a"} 0.0' in httpx.get(f"{gateway.url}/metrics").text)
        other.stop()
        assert _wait_for(lambda: httpx.get(f"{gateway.url}/ready").status_code == 503)
        assert httpx.get(f"{gateway.url}/ready").json()["missing"] == ["pool default: no healthy worker"]
        port = int(first.url.rsplit(":", 1)[1])
        revived = Process([*first.proc.args[:2], str(port), "status503"], first.url)
        stack.enter_context(running(revived))
        assert _wait_for(lambda: httpx.get(f"{gateway.url}/ready").status_code == 200)


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_per_pool_and_per_worker_counters_exist_at_zero_from_the_start(tmp_path):
    """Dashboards show 0 retries, failovers and ejections, not "no data", before the first one."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, gateway_config([worker_entry("w", worker.url)], None), tmp_path)
        text = httpx.get(f"{gateway.url}/metrics").text
        for series in ('kvgate_upstream_retries_total{pool="default"} 0.0',
                       'kvgate_retry_budget_refusals_total{pool="default"} 0.0',
                       'kvgate_failovers_total{mode="token_ids",pool="default"} 0.0',
                       'kvgate_failovers_total{mode="text",pool="default"} 0.0',
                       'kvgate_worker_ejections_total{worker="w"} 0.0'):
            assert series in text
        assert "_created" not in text
