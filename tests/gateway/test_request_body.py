"""The completion body's checks: fields the gateway cannot carry through retries and failover are
refused with a 400 naming them; the rest pass on."""

from __future__ import annotations

import json

import pytest

from gateway.request_body import parse_body
from kvgate.api_error import ApiError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("field", "value"), [("n", 2), ("best_of", 3), ("echo", True),
                                              ("chat_template", "{{ messages }}"), ("kv_transfer_params", {})],
                         ids=["n", "best_of", "echo", "chat_template", "kv_transfer_params"])
def test_a_field_the_gateway_cannot_carry_is_a_400_naming_it(field, value):
    with pytest.raises(ApiError) as info:
        parse_body(json.dumps({**CHAT, field: value}).encode(), "chat")
    assert info.value.status == 400 and info.value.param == field


@pytest.mark.parametrize("extra", [{"n": 1}, {"best_of": 1}, {"echo": False}, {"n": None}, {"logprobs": True},
                                   {"top_logprobs": 2}, {"tools": [{"type": "function", "function": {"name": "f"}}]}],
                         ids=["n-1", "best_of-1", "echo-false", "n-null", "logprobs", "top_logprobs", "tools"])
def test_fields_that_ask_for_nothing_more_or_that_are_assembled_pass(extra):
    assert parse_body(json.dumps({**CHAT, **extra}).encode(), "chat") == {**CHAT, **extra}

