"""Size limits and request validation at the gateway: clear errors before any work is done."""

from __future__ import annotations

import gzip
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from gateway.app import build_middleware
from gateway.auth import KeyStore
from gateway.telemetry import Telemetry
from kvgate.config import AuthConfig, LimitsConfig, ServerConfig
from tests.gateway.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow  # every test runs against the process fleet

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(url: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", content=content,
                      headers={**AUTH, "content-type": "application/json", **(headers or {})}, timeout=30)


def test_oversized_body_gets_413(fleet):
    response = post(fleet["gateway"].url, b'{"model": "tiny", "messages": [{"role": "user", "content": "'
                    + b"x" * (5 * 1024 * 1024) + b'"}]}')
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_a_compressed_body_gets_415_not_a_json_error(fleet):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    response = post(fleet["gateway"].url, gzip.compress(body), {"content-encoding": "gzip"})
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_content_encoding"
    assert "'gzip'" in response.json()["error"]["message"]
    assert post(fleet["gateway"].url, body, {"content-encoding": "identity"}).status_code == 200


def test_too_many_headers_get_431(fleet):
    headers = {f"x-filler-{i}": "1" for i in range(150)}
    assert post(fleet["gateway"].url, b"{}", headers).status_code == 431


OVERSIZED_HEADERS = pytest.mark.parametrize(
    "headers", [{f"x-filler-{i}": "1" for i in range(150)}, {"x-filler": "x" * (17 * 1024)}],
    ids=["too-many", "too-large"])


@OVERSIZED_HEADERS
def test_oversized_headers_get_431_before_auth_or_trace_context_run(fleet, headers):
    """No 401 for the missing key, and no request id or trace context made for the request."""
    response = httpx.post(f"{fleet['gateway'].url}/v1/chat/completions", content=b"{}", timeout=30,
                          headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                   **headers})
    assert response.status_code == 431
    assert "x-request-id" not in response.headers and "traceparent" not in response.headers


@OVERSIZED_HEADERS
def test_the_middleware_order_refuses_oversized_headers_first(headers):
    """build_middleware's order in process: header limits before request context and auth."""
    core = SimpleNamespace(metrics=None, config=SimpleNamespace(limits=LimitsConfig(), gateway=ServerConfig()),
                           telemetry=Telemetry())
    keys = KeyStore(AuthConfig(dev_key_env=None), {})
    app = Starlette(middleware=build_middleware(core, keys, {}))
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", content=b"{}", headers=headers)
        assert response.status_code == 431
        assert "x-request-id" not in response.headers
        assert client.post("/v1/chat/completions", content=b"{}").status_code == 401  # the order, within limits


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b"[]", "request body must be a JSON object"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model is required"),
        (b'{"model": "tiny", "messages": []}', "messages must be a non-empty list"),
        (b'{"model": "tiny", "messages": "hi"}', "messages must be a non-empty list"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
         "stream must be a boolean"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
         "NaN is not a JSON number"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", -Infinity]}',
         "-Infinity is not a JSON number"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
         "number out of range"),
        (b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b', "messages": []}',
         "nested too deeply"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": "yes"}',
         "stream_options must be an object"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}',
         "stream_options is only allowed when stream is true"),
    ],
    ids=["malformed", "not-object", "no-model", "empty-messages", "messages-string", "stream-not-bool", "nan",
         "infinity", "float-overflow", "deep-nesting", "stream-options-not-object", "stream-options-without-stream"],
)
def test_invalid_requests_get_400_with_a_clear_message(fleet, body, message):
    response = post(fleet["gateway"].url, body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert response.headers["x-request-id"]  # answered inside the middleware chain, not by a crash handler


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([-1, 5], "prompt token ids must be integers in [0, 2**32)"),
        ([2**40], "prompt token ids must be integers in [0, 2**32)"),
        ([1, "two"], "cannot tokenize the request"),
        (["one"] * 129, "a batch holds at most 128 prompts, got 129"),
        (["one", 2], "prompt[1] must be a string or a list of token ids"),
        (["one", ""], "prompt 1: "),
    ],
    ids=["negative-id", "id-over-u32", "mixed-list", "batch-over-bound", "batch-element", "batch-empty-prompt"],
)
def test_invalid_completion_prompts_get_400(fleet, prompt, message):
    response = httpx.post(f"{fleet['gateway'].url}/v1/completions", headers=AUTH, timeout=30,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "prompt"


def test_a_batch_of_one_prompt_is_served(fleet):
    response = httpx.post(f"{fleet['gateway'].url}/v1/completions", headers=AUTH, timeout=30,
                          json={"model": MODEL, "prompt": [[3, 4, 5, 6]], "max_tokens": 1})
    assert response.status_code == 200, response.text


def test_clients_cannot_choose_the_upstream(fleet):
    body = (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,'
            b' "base_url": "http://169.254.169.254", "url": "http://example.com"}')
    response = post(fleet["gateway"].url, body, {"host": "evil.example", "x-forwarded-host": "evil.example"})
    assert response.status_code == 200
    assert response.headers["x-kvgate-worker"] in ("w0", "w1")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_other_methods_on_the_completion_paths_get_405(fleet, path):
    """The completion paths skip Starlette's router for POST only: other methods still reach it."""
    response = httpx.get(f"{fleet['gateway'].url}{path}", headers=AUTH, timeout=30)
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["allow"] == "POST"


def test_a_trailing_slash_is_not_redirected(fleet):
    response = httpx.post(f"{fleet['gateway'].url}/v1/completions/", headers=AUTH, timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 404


def test_an_unknown_path_gets_an_openai_style_404(fleet):
    response = httpx.post(f"{fleet['gateway'].url}/v1/nothing-here", headers=AUTH, json={}, timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
