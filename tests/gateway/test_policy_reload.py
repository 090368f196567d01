"""A running gateway picks up a changed routing-policy file, and says when a bad one is kept out."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.gateway.conftest import API_KEY, MODEL, gateway_config, metric_value, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

pytestmark = pytest.mark.slow  # every test runs a worker and a gateway as processes

AUTH = {"Authorization": f"Bearer {API_KEY}"}
RULES = """
rules:
  - name: default
    pool: default
    policy: {{type: {policy}}}
"""


def route_of(gateway_url: str) -> str:
    response = httpx.post(f"{gateway_url}/v1/completions", headers=AUTH, timeout=10,
                          json={"model": MODEL, "prompt": "p", "max_tokens": 1})
    assert response.status_code == 200
    return response.headers["x-kvgate-route"]


def rewrite(path, text: str) -> None:
    path.write_text(text)
    stamp = time.time() + 5  # a new mtime even on file systems with coarse timestamps
    os.utime(path, (stamp, stamp))


def wait_for_reloads(gateway_url: str, outcome: str, count: int, timeout_s: float = 10.0) -> None:
    """The watcher checks the file every routing.policies_watch_interval_s (not per request)."""
    deadline = time.monotonic() + timeout_s
    while metric_value(gateway_url, "kvgate_policy_reloads_total", outcome=outcome) < count:
        assert time.monotonic() < deadline, f"no {outcome} reload within {timeout_s} s"
        time.sleep(0.05)


def test_a_changed_policy_file_is_applied_and_a_bad_one_is_refused_visibly(tmp_path):
    policies = tmp_path / "policies.yaml"
    policies.write_text(RULES.format(policy="round_robin"))
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = gateway_config([worker_entry("w", worker.url)], None, routing={"policies_file": str(policies)})
        gateway = start_gateway(stack, config, tmp_path)
        assert route_of(gateway.url).startswith("policy=round_robin")
        assert metric_value(gateway.url, "kvgate_policy_reloads_total", outcome="error") == 0

        rewrite(policies, RULES.format(policy="no_such_policy"))
        wait_for_reloads(gateway.url, "error", 1)
        assert route_of(gateway.url).startswith("policy=round_robin")  # the old rules stay
        assert metric_value(gateway.url, "kvgate_policy_reloads_total", outcome="error") == 1
        assert "routing policies not reloaded" in gateway.output() and "no_such_policy" in gateway.output()

        rewrite(policies, RULES.format(policy="least_load"))
        wait_for_reloads(gateway.url, "ok", 1)
        assert route_of(gateway.url).startswith("policy=least_load")
        assert metric_value(gateway.url, "kvgate_policy_reloads_total", outcome="ok") == 1


def test_sighup_reloads_the_policy_file_at_once(tmp_path):
    policies = tmp_path / "policies.yaml"
    policies.write_text(RULES.format(policy="round_robin"))
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = gateway_config([worker_entry("w", worker.url)], None,
                                routing={"policies_file": str(policies), "policies_watch_interval_s": 3600})
        gateway = start_gateway(stack, config, tmp_path)
        rewrite(policies, RULES.format(policy="least_load"))
        assert route_of(gateway.url).startswith("policy=round_robin")  # not checked per request
        gateway.proc.send_signal(signal.SIGHUP)
        wait_for_reloads(gateway.url, "ok", 1)
        assert route_of(gateway.url).startswith("policy=least_load")


def test_sighup_without_a_policy_file_is_logged_not_fatal(tmp_path):
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        gateway = start_gateway(stack, gateway_config([worker_entry("w", worker.url)], None), tmp_path)
        gateway.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "no routing.policies_file to reload" not in gateway.output() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "no routing.policies_file to reload" in gateway.output()
        assert gateway.proc.poll() is None and route_of(gateway.url).startswith("policy=kv_aware")
