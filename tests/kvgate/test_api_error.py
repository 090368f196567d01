"""The shared OpenAI-style error (kvgate/api_error.py), as a client reads it over loopback."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from kvgate.api_error import ApiError
from tests.conftest import free_port
from tests.loadtest.fake_upstream import serve_in_thread


async def _refuse(request):
    return ApiError(429, "tenant over its rate limit", "rate_limit_error", code="rate_limited",
                    retry_after_s=2).response({"x-extra": "1"})


def test_response_carries_the_openai_body_status_and_retry_after():
    with serve_in_thread(Starlette(routes=[Route("/", _refuse)]), free_port()) as url:
        response = httpx.get(url)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2" and response.headers["x-extra"] == "1"
    assert response.json() == {"error": {"message": "tenant over its rate limit", "type": "rate_limit_error",
                                         "param": None, "code": "rate_limited"}}


def test_param_and_code_are_keywords_and_the_message_is_the_exception_text():
    error = ApiError(400, "top_p must be in (0, 1], got 2", param="top_p")
    assert str(error) == error.message and error.type == "invalid_request_error"
    assert error.body()["error"]["param"] == "top_p" and error.retry_after_s is None
    with pytest.raises(TypeError):
        ApiError(400, "m", "invalid_request_error", "param")  # type: ignore[misc]
