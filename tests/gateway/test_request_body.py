"""The completion request as the gateway reads it: fields the gateway cannot carry through retries and
failover are refused with a 400 naming them, the rest pass on; the body is read once, within its limit;
routing sees the first of each header, without the credentials."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.middleware import BodyLimitsMiddleware
from gateway.proxy import _request_headers
from gateway.request_body import parse_body, read_body
from kvgate.api_error import ApiError
from kvgate.config import LimitsConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("field", "value"), [("n", 0), ("n", 129), ("n", True), ("n", "2"), ("best_of", 3),
                                              ("echo", True), ("chat_template", "{{ messages }}"),
                                              ("kv_transfer_params", {})],
                         ids=["n-zero", "n-past-128", "n-bool", "n-string", "best_of", "echo", "chat_template",
                              "kv_transfer_params"])
def test_a_field_the_gateway_cannot_carry_is_a_400_naming_it(field, value):
    with pytest.raises(ApiError) as info:
        parse_body(json.dumps({**CHAT, field: value}).encode(), "chat")
    assert info.value.status == 400 and info.value.param == field


@pytest.mark.parametrize("extra", [{"n": 1}, {"n": 4}, {"best_of": 1}, {"echo": False}, {"n": None}, {"logprobs": True},
                                   {"top_logprobs": 2}, {"tools": [{"type": "function", "function": {"name": "f"}}]}],
                         ids=["n-1", "n-4", "best_of-1", "echo-false", "n-null", "logprobs", "top_logprobs", "tools"])
def test_fields_that_ask_for_nothing_more_or_that_are_assembled_pass(extra):
    assert parse_body(json.dumps({**CHAT, **extra}).encode(), "chat") == {**CHAT, **extra}



def _messages(*parts: bytes, disconnect: bool = False):
    """An ASGI receive() giving the body in parts (or a disconnect after them), then http.disconnect."""
    messages = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1 or disconnect}
                for i, part in enumerate(parts)]
    if disconnect:
        messages.append({"type": "http.disconnect"})

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


def test_a_body_in_parts_is_read_whole():
    assert asyncio.run(read_body(_messages(b'{"a":', b' 1', b"}"), limit=8)) == b'{"a": 1}'


def test_a_body_in_parts_is_refused_once_it_crosses_the_limit():
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(_messages(b"x" * 5, b"x" * 5, b"x" * 5), limit=8))
    assert (refused.value.status, refused.value.code) == (413, "request_too_large")


def test_a_client_that_leaves_before_its_body_ends_is_a_400():
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(_messages(b"{", disconnect=True)))
    assert refused.value.status == 400


def test_body_limits_hand_the_body_on_in_the_scope_state():
    """The app inside reads the body from scope['state'] and its receive() goes on after the body."""
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = scope["state"]["body"]
        seen["next"] = (await receive())["type"]

    middleware = BodyLimitsMiddleware(app, LimitsConfig())
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(middleware(scope, _messages(b'{"model":', b' "m"}'), None))
    assert seen == {"body": b'{"model": "m"}', "next": "http.disconnect"}


def test_the_headers_routing_sees_are_the_first_of_each_name_without_the_credentials():
    raw = [(b"authorization", b"Bearer sk-1"), (b"x-mode", b"sticky"), (b"x-api-key", b"sk-2"),
           (b"x-mode", b"batch"), (b"x-session-id", b"caf\xe9")]
    assert _request_headers(raw) == {"x-mode": "sticky", "x-session-id": "caf\u00e9"}  # latin-1, as ASGI has it
