"""Request id and W3C trace context: given to every request, echoed on the response, kept for upstream."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from gateway.middleware import RequestContextMiddleware

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def echo_state(scope, receive, send) -> None:
    """The app behind the middleware: answers with what the proxy would forward upstream."""
    state = scope["state"]
    body = f'{state["request_id"]}|{state["trace_headers"].get("traceparent", "")}'.encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture()
def client():
    return TestClient(RequestContextMiddleware(echo_state))


@pytest.mark.parametrize(("incoming", "kept"), [(None, False), ("req-42.a:b_c", True), ("bad id with spaces", False),
                                                 ("x" * 129, False)],
                         ids=["none", "valid-kept", "invalid-replaced", "too-long-replaced"])
def test_every_request_gets_an_id_echoed_and_kept_for_upstream(client, incoming, kept):
    response = client.get("/", headers={"x-request-id": incoming} if incoming else {})
    request_id = response.headers["x-request-id"]
    assert response.text.split("|")[0] == request_id
    if kept:
        assert request_id == incoming
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)


def test_a_callers_trace_context_continues_on_the_response_and_upstream(client):
    response = client.get("/", headers={"traceparent": PARENT})
    forwarded = response.text.split("|")[1]
    assert forwarded.split("-")[1] == TRACE_ID  # the same trace, for the worker's spans
    assert response.headers["traceparent"].split("-")[1] == TRACE_ID


def test_without_a_caller_trace_or_tracer_nothing_is_invented(client):
    response = client.get("/")
    assert "traceparent" not in response.headers
    assert response.text.split("|")[1] == ""
