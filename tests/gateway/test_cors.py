"""Browsers on other origins: preflights answered before auth, an allowed origin's answers (errors and
streams included) readable by its pages, any other origin's not; CORS off unless configured."""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.app import build_middleware
from gateway.auth import KeyStore
from gateway.telemetry import Telemetry
from kvgate.config import AuthConfig, LimitsConfig, ServerConfig
from tests.gateway.conftest import API_KEY, MODEL, gateway_config, start_gateway, worker_entry
from tests.processes import fake_worker_process, running

APP_ORIGIN = "https://chat.example.com"
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type,x-stainless-retry-count"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A real gateway allowing APP_ORIGIN, in front of a worker that answers at once."""
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = gateway_config([worker_entry("w0", worker.url)], None,
                                gateway={"cors_allowed_origins": [APP_ORIGIN]})
        yield start_gateway(stack, config, tmp_path_factory.mktemp("cors"))


@pytest.mark.slow
def test_preflight_is_answered_without_a_key(gateway):
    response = httpx.options(f"{gateway.url}/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == APP_ORIGIN
    assert response.headers["vary"] == "Origin"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
    assert int(response.headers["access-control-max-age"]) > 0
    assert "access-control-allow-credentials" not in response.headers  # keys travel in headers, not cookies


@pytest.mark.slow
def test_preflight_from_another_origin_is_refused_clearly(gateway):
    response = httpx.options(f"{gateway.url}/v1/chat/completions",
                             headers={**PREFLIGHT, "Origin": "https://evil.example.net"})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "origin_not_allowed" and "https://evil.example.net" in error["message"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_an_allowed_origins_answer_is_readable_by_its_page(gateway, stream):
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={**BODY, "stream": stream}, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}", "Origin": APP_ORIGIN})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "x-request-id" in response.headers["access-control-expose-headers"]
    assert ("data: [DONE]" in response.text) if stream else response.json()["choices"]


@pytest.mark.slow
def test_errors_are_readable_too_and_other_origins_get_no_cors_headers(gateway):
    refused = httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, headers={"Origin": APP_ORIGIN})
    assert refused.status_code == 401  # no key: the page can read why
    assert refused.headers["access-control-allow-origin"] == APP_ORIGIN
    other = httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}", "Origin": "https://evil.example.net"})
    assert other.status_code == 200  # served as ever: the browser keeps it from the other page
    assert "access-control-allow-origin" not in other.headers
    plain = httpx.post(f"{gateway.url}/v1/chat/completions", json=BODY, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def in_process_client(origins: tuple[str, ...]) -> TestClient:
    """build_middleware as the gateway builds it, over one route that needs a key."""
    config = SimpleNamespace(limits=LimitsConfig(), gateway=ServerConfig(cors_allowed_origins=origins))
    core = SimpleNamespace(metrics=None, telemetry=Telemetry(), config=config)
    keys = KeyStore(AuthConfig(), {"KVGATE_API_KEY": API_KEY})
    routes = [Route("/v1/models", lambda request: PlainTextResponse("models"), methods=["GET"])]
    return TestClient(Starlette(routes=routes, middleware=build_middleware(core, keys, {})))


def test_any_origin_answers_a_wildcard_without_vary():
    with in_process_client(("*",)) as client:
        preflight = client.options("/v1/models", headers={**PREFLIGHT, "Origin": "http://localhost:5173"})
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == "*"
        answer = client.get("/v1/models", headers={"Origin": "http://localhost:5173",
                                                   "Authorization": f"Bearer {API_KEY}"})
        assert answer.text == "models" and answer.headers["access-control-allow-origin"] == "*"
        assert "vary" not in answer.headers


def test_origins_match_regardless_of_case():
    with in_process_client(("https://Chat.Example.com",)) as client:
        assert client.options("/v1/models", headers=PREFLIGHT).status_code == 204


def test_cors_is_off_unless_configured():
    """No CORS headers, and a preflight goes on to auth as any request does (the browser refuses then)."""
    with in_process_client(()) as client:
        assert client.options("/v1/models", headers=PREFLIGHT).status_code == 401
        answer = client.get("/v1/models", headers={"Origin": APP_ORIGIN, "Authorization": f"Bearer {API_KEY}"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
