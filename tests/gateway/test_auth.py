"""API-key auth as clients meet it, and the constant-time comparison underneath."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from gateway.auth import AuthMiddleware, KeyStore
from kvgate.config import ApiKeyConfig, AuthConfig
from kvgate.keys import generate_key, hash_key
from tests.gateway.conftest import API_KEY, MODEL, metric_value

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 1}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("headers", "query"),
    [
        ({}, ""),
        ({"Authorization": "Bearer wrong-key"}, ""),
        ({"x-api-key": "wrong-key"}, ""),
        ({"Authorization": f"Basic {API_KEY}"}, ""),
        ({"Authorization": API_KEY}, ""),
        ({"Authorization": "Bearer"}, ""),
        ({}, f"?api_key={API_KEY}"),
        ({}, f"?key={API_KEY}"),
    ],
    ids=["no-key", "wrong-bearer", "wrong-x-api-key", "basic-scheme", "no-scheme", "empty-bearer",
         "query-api_key", "query-key"],
)
def test_requests_without_a_valid_key_get_401_in_openai_shape(fleet, headers, query):
    response = httpx.post(f"{fleet['gateway'].url}/v1/completions{query}", json=BODY, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert API_KEY not in response.text


@pytest.mark.slow
@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {API_KEY}"}, {"x-api-key": API_KEY}],
                         ids=["bearer", "x-api-key"])
def test_a_valid_key_is_accepted(fleet, headers):
    response = httpx.post(f"{fleet['gateway'].url}/v1/completions", json=BODY, headers=headers, timeout=30)
    assert response.status_code == 200


@pytest.mark.slow
def test_refused_requests_are_counted_under_no_tenant(fleet):
    url = fleet["gateway"].url
    before = metric_value(url, "kvgate_requests_total", tenant="unauthenticated", status="401")
    assert httpx.post(f"{url}/v1/completions", json=BODY, headers={"x-api-key": "wrong"}).status_code == 401
    assert metric_value(url, "kvgate_requests_total", tenant="unauthenticated", status="401") == before + 1


@pytest.mark.slow
def test_health_and_metrics_need_no_key_and_never_show_one(fleet):
    url = fleet["gateway"].url
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert API_KEY not in metrics and hash_key(API_KEY) not in metrics
    assert API_KEY not in fleet["gateway"].output()


def test_key_comparison_time_does_not_depend_on_the_key():
    """Right key, wrong key sharing its hash's first bytes, and a random key: same work each."""
    keys = [generate_key() for _ in range(200)]
    store = KeyStore(AuthConfig(keys=tuple(ApiKeyConfig("t", hash_key(k)) for k in keys), dev_key_env=None), {})
    right = keys[100]

    def timed(digest: bytes) -> float:
        started = time.perf_counter()
        store._match_local(digest)
        return time.perf_counter() - started

    assert store._match_local(hash_key(right).encode()) == "t"
    digests = {"right": hash_key(right).encode(), "wrong": hash_key("kvg-" + "x" * 43).encode()}
    samples: dict[str, list[float]] = {"right": [], "wrong": []}
    for _ in range(600):  # interleaved, so a busy moment of the machine weighs on both alike
        for name, digest in digests.items():
            samples[name].append(timed(digest))
    right_s, wrong_s = (statistics.median(samples[name]) for name in ("right", "wrong"))
    assert abs(right_s - wrong_s) / max(right_s, wrong_s) < 0.25


@pytest.mark.slow
def test_a_key_created_in_redis_is_accepted_by_a_gateway_using_that_redis(gateway_model_dir, tmp_path):
    import subprocess
    import sys
    from contextlib import ExitStack

    import redis

    from tests.gateway.conftest import gateway_config, start_gateway, start_tiny_worker, worker_entry

    url = "redis://127.0.0.1:6379/14"
    redis.Redis.from_url(url).delete("kvgate:api_keys")
    created = subprocess.run([sys.executable, "-m", "kvgate", "keys", "create", "--tenant", "team-r", "--redis", url],
                             capture_output=True, text=True, check=True)
    key = created.stdout.splitlines()[1].strip()
    with ExitStack() as stack:
        worker = start_tiny_worker(stack, gateway_model_dir)
        gateway = start_gateway(stack, gateway_config([worker_entry("w0", worker.url)], gateway_model_dir,
                                                      redis={"url": url}), tmp_path)
        ok = httpx.post(f"{gateway.url}/v1/completions", json=BODY, headers={"x-api-key": key}, timeout=30)
        assert ok.status_code == 200
        bad = httpx.post(f"{gateway.url}/v1/completions", json=BODY, headers={"x-api-key": key + "x"})
        assert bad.status_code == 401
        assert httpx.get(f"{gateway.url}/ready").json() == {"status": "ready"}
    redis.Redis.from_url(url).delete("kvgate:api_keys")


WS_KEY = "kvg-websocket-key"


async def tenant_echo(scope, receive, send) -> None:
    """The app behind auth: accepts any WebSocket and sends it the tenant auth found."""
    assert scope["type"] == "websocket"
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": scope["state"]["tenant"]})
    await send({"type": "websocket.close", "code": 1000})


@pytest.fixture()
def ws_client() -> TestClient:
    store = KeyStore(AuthConfig(keys=(ApiKeyConfig("team-w", hash_key(WS_KEY)),), dev_key_env=None), {})
    return TestClient(AuthMiddleware(tenant_echo, store))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/health"])
@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}], ids=["no-key", "wrong-key"])
def test_a_websocket_without_a_valid_key_is_refused_before_it_is_accepted(ws_client, headers, path):
    with pytest.raises(WebSocketDisconnect) as refused:
        with ws_client.websocket_connect(path, headers=headers):
            pass
    assert refused.value.code == 1008  # policy violation (a server answers the handshake 403)


def test_a_websocket_with_a_valid_key_reaches_the_app_as_its_tenant(ws_client):
    with ws_client.websocket_connect("/v1/chat/completions", headers={"Authorization": f"Bearer {WS_KEY}"}) as ws:
        assert ws.receive_text() == "team-w"


@pytest.mark.parametrize(("keys", "dev_key", "accepted"), [
    ((), None, True), (("real-key",), None, False), (("real-key",), True, True), ((), False, False),
], ids=["no-keys-configured", "keys-configured", "asked-for-beside-keys", "turned-off"])
def test_the_dev_key_works_only_where_no_keys_are_configured_or_when_asked(keys, dev_key, accepted):
    config = AuthConfig(keys=tuple(ApiKeyConfig("team", hash_key(k)) for k in keys), dev_key=dev_key)
    store = KeyStore(config, {"KVGATE_API_KEY": "the-dev-key"})
    assert asyncio.run(store.tenant_for("the-dev-key")) == ("dev" if accepted else None)
    if keys:
        assert asyncio.run(store.tenant_for("real-key")) == "team"
