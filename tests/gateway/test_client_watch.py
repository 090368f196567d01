"""A request's one disconnect watcher (gateway/client_watch.py): a client that goes away cancels what its
request awaits, in any phase, and nothing once the answer is out; a request over before the watcher's delay
starts no task; and, through a completion endpoint in process, one watcher per request still cancels the
upstream request at once and counts a 499."""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest

from gateway.app import completion_endpoints
from gateway.client_watch import ClientWatch
from gateway.core import GatewayCore
from kvgate.config import KvgateConfig, build
from tests.gateway.conftest import MODEL, gateway_config, worker_entry


class Client:
    """An ASGI client: receive() gives the body, then waits until leave() (or the response's end)."""

    def __init__(self, body: bytes = b"") -> None:
        self.body = body
        self.sent_body = False
        self.left = asyncio.Event()
        self.messages: list[dict] = []

    async def receive(self) -> dict:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.left.set()  # as uvicorn answers receive() once the response is complete

    def leave(self) -> None:
        self.left.set()


def test_a_client_that_leaves_cancels_the_work_it_waits_on():
    async def scenario() -> tuple[object, list[str]]:
        client, events = Client(), []
        await client.receive()  # the body

        async def work() -> str:
            try:
                await asyncio.sleep(10)
            finally:
                events.append("cleaned up")
            return "answer"

        watch = ClientWatch(client.receive)
        asyncio.get_running_loop().call_later(0.01, client.leave)
        result = await watch.run(work())
        watch.stop()
        return result, events

    assert asyncio.run(scenario()) == (None, ["cleaned up"])


def test_work_that_ends_first_gives_its_result_and_a_later_disconnect_cancels_nothing():
    async def scenario() -> tuple[object, bool]:
        client = Client()
        await client.receive()

        async def work() -> str:
            await asyncio.sleep(0)
            return "answer"

        watch = ClientWatch(client.receive, after_s=0)
        result = await watch.run(work())
        client.leave()
        await asyncio.sleep(0.01)  # the watcher sees the disconnect between runs
        after = await watch.run(work())  # not started: the client is gone
        watch.stop()
        await asyncio.sleep(0.01)
        return (result, after), watch.gone

    assert asyncio.run(scenario()) == (("answer", None), True)


def test_a_request_over_before_the_delay_starts_no_watcher_task():
    async def scenario() -> int:
        client = Client()
        await client.receive()
        tasks_before = len(asyncio.all_tasks())
        watch = ClientWatch(client.receive, after_s=0.05)
        await watch.run(asyncio.sleep(0))
        tasks_during = len(asyncio.all_tasks()) - tasks_before
        watch.stop()
        await asyncio.sleep(0.1)  # past the delay: the stopped watch starts nothing
        return tasks_during + len(asyncio.all_tasks()) - tasks_before

    assert asyncio.run(scenario()) == 0


def test_a_client_gone_within_the_delay_is_noticed_once_it_ends():
    async def scenario() -> tuple[object, float]:
        client = Client()
        await client.receive()
        loop = asyncio.get_running_loop()
        watch = ClientWatch(client.receive, after_s=0.05)
        client.leave()  # at once: noticed when the watcher starts, 0.05 s later
        started = loop.time()
        result = await watch.run(asyncio.sleep(10))
        watch.stop()
        return result, loop.time() - started

    result, waited_s = asyncio.run(scenario())
    assert result is None
    assert 0.04 <= waited_s < 1.0


def test_the_total_time_running_out_cancels_the_run_and_says_so():
    async def scenario() -> tuple[bool, float, bool, bool]:
        client = Client()
        await client.receive()
        loop = asyncio.get_running_loop()
        watch = ClientWatch(client.receive, after_s=0.01, total_s=0.1)
        started = loop.time()
        try:
            await watch.run(asyncio.sleep(10))
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        waited_s = loop.time() - started
        asyncio.current_task().uncancel()
        started_again = []

        async def more() -> None:
            started_again.append(True)

        try:  # a run after the total is up does not start
            await watch.run(more())
            refused = False
        except asyncio.CancelledError:
            refused = True
        watch.stop()
        return cancelled and watch.expired and not watch.gone, waited_s, refused, bool(started_again)

    expired, waited_s, refused, started_again = asyncio.run(scenario())
    assert expired and 0.09 <= waited_s < 1.0
    assert refused and not started_again


def test_a_request_over_within_its_total_time_is_not_touched():
    async def scenario() -> object:
        client = Client()
        await client.receive()
        watch = ClientWatch(client.receive, after_s=0.01, total_s=0.2)
        result = await watch.run(asyncio.sleep(0.05, "answer"))
        watch.stop()
        await asyncio.sleep(0.3)  # the expiry timer is gone with stop()
        return result, watch.expired

    assert asyncio.run(scenario()) == ("answer", False)


def test_a_cancellation_from_elsewhere_is_not_taken_for_a_client_gone():
    async def scenario() -> None:
        client = Client()
        await client.receive()
        watch = ClientWatch(client.receive)
        try:
            await watch.run(asyncio.sleep(10))
        finally:
            watch.stop()

    async def main() -> bool:
        task = asyncio.ensure_future(scenario())
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(main())


# -- through a completion endpoint ---------------------------------------------------------------

TOKEN = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
         "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]}


class StallingWorker(asyncio.Protocol):
    """Answers /health and /metrics; a completion gets its headers (and, with token=True, one token)
    and then nothing until the gateway closes the connection, which `closed` records; `streaming_started` is set
    once a completion has been answered that far."""

    token = True
    closed: asyncio.Event
    streaming_started: asyncio.Event

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.streaming = False

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        if self.url in (b"/health", b"/metrics"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        self.streaming = True
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        event = b"data: " + json.dumps(TOKEN).encode() + b"\n\n"
        self.transport.write(head + (b"%x\r\n%s\r\n" % (len(event), event) if self.token else b""))
        self.streaming_started.set()

    def connection_lost(self, exc) -> None:
        if self.streaming:
            self.closed.set()


@pytest.mark.parametrize("token", [True, False], ids=["mid-answer", "before-the-first-token"])
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_a_client_that_leaves_cancels_the_upstream_request_with_one_watcher(stream, token):
    async def scenario() -> tuple[float, int, float]:
        StallingWorker.token, StallingWorker.closed = token, asyncio.Event()
        StallingWorker.streaming_started = asyncio.Event()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(StallingWorker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = build(KvgateConfig, gateway_config([worker_entry("w", f"http://127.0.0.1:{port}")], None,
                                                    upstream={"first_byte_timeout_s": 30.0, "idle_timeout_s": 30.0}))
        core = GatewayCore(config)
        await core.start()
        try:
            endpoint = completion_endpoints(core)["/v1/chat/completions"]
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
            client = Client(json.dumps(body).encode())
            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
                     "state": {"tenant": "t", "request_id": "r1", "trace_headers": {}}}
            tasks_before = len(asyncio.all_tasks())
            request = asyncio.ensure_future(endpoint(scope, client.receive, client.send))
            # admitted, routed, the worker streaming (or computing its first token): a fixed 0.2 s was not
            # always enough on a busy machine
            await asyncio.wait_for(StallingWorker.streaming_started.wait(), 10.0)
            await asyncio.sleep(0.1)  # the token (if any) read by the gateway
            # the request's own task and its watcher, and a stream's reader once it streams (ClientWatch.run's own_task)
            tasks_during = len(asyncio.all_tasks()) - tasks_before
            left_at = loop.time()
            client.leave()
            await asyncio.wait_for(StallingWorker.closed.wait(), 2.0)
            closed_after_s = loop.time() - left_at
            await asyncio.wait_for(request, 2.0)
            await asyncio.sleep(0)
            answered_499 = core.metrics.child(core.metrics.requests, "t", MODEL, "default", "499").value
            return closed_after_s, tasks_during, answered_499
        finally:
            await core.stop()
            server.close()

    closed_after_s, tasks_during, answered_499 = asyncio.run(scenario())
    assert closed_after_s < 0.5
    assert tasks_during == (3 if stream and token else 2)
    assert answered_499 == 1
