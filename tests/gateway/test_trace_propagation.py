"""What a worker receives from a real gateway process: the caller's trace context (traceparent), the
request id the gateway answered with, and the admitted priority (never the client's own)."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from tests.conftest import free_port
from tests.gateway.conftest import API_KEY, MODEL, gateway_config, start_gateway, worker_entry
from tests.gateway.recording_worker import recording_worker
from tests.loadtest.fake_upstream import serve_in_thread

pytestmark = pytest.mark.slow  # a gateway process

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def gateway_and_seen(tmp_path_factory):
    """A gateway process in front of one recording worker (served in this process)."""
    seen: list[dict[str, str]] = []
    with ExitStack() as stack:
        worker_url = stack.enter_context(serve_in_thread(recording_worker(seen), free_port()))
        config = gateway_config([worker_entry("w0", worker_url)], None)
        gateway = start_gateway(stack, config, tmp_path_factory.mktemp("trace"))
        yield gateway.url, seen


def complete(gateway_url: str, headers: dict[str, str]) -> httpx.Response:
    response = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}", **headers},
                          json={"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response


def test_the_callers_trace_and_the_request_id_reach_the_worker(gateway_and_seen):
    url, seen = gateway_and_seen
    response = complete(url, {"traceparent": PARENT, "x-request-id": "client-req-1"})
    worker_saw = seen[-1]
    assert worker_saw["traceparent"].split("-")[1] == TRACE_ID  # the worker's spans join the caller's trace
    assert worker_saw["x-request-id"] == response.headers["x-request-id"]
    assert response.headers["traceparent"].split("-")[1] == TRACE_ID


def test_without_a_callers_trace_none_is_invented_for_the_worker(gateway_and_seen):
    url, seen = gateway_and_seen
    response = complete(url, {})
    worker_saw = seen[-1]
    assert "traceparent" not in worker_saw
    assert worker_saw["x-request-id"] == response.headers["x-request-id"]


@pytest.mark.parametrize(("asked", "admitted"), [(None, "1"), ("batch", "2"), ("critical", "1")],
                         ids=["none-standard", "batch-granted", "critical-capped-at-the-tenants-standard"])
def test_the_worker_gets_the_admitted_priority_not_the_clients(gateway_and_seen, asked, admitted):
    url, seen = gateway_and_seen
    complete(url, {"x-priority": asked} if asked else {})
    assert seen[-1]["x-priority"] == admitted
