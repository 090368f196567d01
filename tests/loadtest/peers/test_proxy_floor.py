"""The proxy floor (loadtest/peers/proxy_floor.py) between a real client and a real upstream: it must pass
requests and answers through whole, or bench_proxy's floor row would measure less than a proxy does."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from loadtest.peers.proxy_floor import ProxyFloor, create_app
from loadtest.procs import free_port
from tests.loadtest.fake_upstream import Timing, build_app, serve_in_thread

TIMING = Timing(first_chunk_s=0.01, interval_s=0.0, num_chunks=4)


@pytest.fixture
def floor_url():
    with serve_in_thread(build_app(TIMING), free_port()) as upstream, \
            serve_in_thread(ProxyFloor(upstream), free_port(), lifespan="on") as floor:
        yield floor


def test_a_streamed_answer_reaches_an_openai_client_through_the_floor_whole(floor_url):
    client = OpenAI(base_url=f"{floor_url}/v1", api_key="unused", max_retries=0)

    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))

    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " tok0 tok1 tok2 tok3"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_the_upstreams_status_and_content_type_pass_through_and_its_other_headers_do_not(floor_url):
    answer = httpx.post(f"{floor_url}/v1/completions", json={"model": "m", "prompt": "hi"})

    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert "x-kvgate-worker" not in answer.headers  # the fake upstream's own header
    assert answer.text.endswith("data: [DONE]\n\n")
    assert httpx.post(f"{floor_url}/v1/nowhere", json={}).status_code == 404


def test_an_upstream_that_cannot_be_reached_is_a_502():
    with serve_in_thread(ProxyFloor(f"http://127.0.0.1:{free_port()}"), free_port(), lifespan="on") as floor:
        answer = httpx.post(f"{floor}/v1/completions", json={"model": "m", "prompt": "hi"})
        health = httpx.get(f"{floor}/health")

    assert answer.status_code == 502 and "ConnectError" in answer.json()["error"]["message"]
    assert health.status_code == 200


def test_the_factory_needs_the_upstream_named(monkeypatch):
    monkeypatch.delenv("PROXY_FLOOR_UPSTREAM", raising=False)
    with pytest.raises(SystemExit, match="PROXY_FLOOR_UPSTREAM"):
        create_app()
    monkeypatch.setenv("PROXY_FLOOR_UPSTREAM", "http://127.0.0.1:9/")
    assert create_app().upstream == "http://127.0.0.1:9"
