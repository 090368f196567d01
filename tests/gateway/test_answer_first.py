"""A non-streaming answer goes to the client before the gateway records the request (metrics, cost,
its admission permit): the client does not wait for the accounting, and the request is still
recorded exactly once, right after."""

from __future__ import annotations

import asyncio
import json

from gateway.app import completion_endpoints
from gateway.core import GatewayCore
from kvgate.config import KvgateConfig, build
from tests.gateway.conftest import MODEL, gateway_config, worker_entry
from tests.gateway.test_client_watch import Client

CHUNKS = [{"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "logprobs": None,
                        "finish_reason": None}]},
          {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
           "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
          {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}]


class AnsweringWorker(asyncio.Protocol):
    """Answers every request on the connection with one short, complete SSE answer."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        body = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in CHUNKS) + b"data: [DONE]\n\n"
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))


def test_a_non_streaming_answer_is_sent_before_the_request_is_recorded():
    async def scenario() -> tuple[dict, float, float, int]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(AnsweringWorker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = build(KvgateConfig, gateway_config([worker_entry("w", f"http://127.0.0.1:{port}")], None))
        core = GatewayCore(config)
        await core.start()
        answered = core.metrics.child(core.metrics.requests, "t", MODEL, "default", "200")
        try:
            endpoint = completion_endpoints(core)["/v1/chat/completions"]
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            client = Client(json.dumps(body).encode())
            counted_when_sent = []
            send = client.send

            async def send_and_look(message: dict) -> None:
                if message["type"] == "http.response.body":
                    counted_when_sent.append(answered.value)
                await send(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
                     "state": {"tenant": "t", "request_id": "r1", "trace_headers": {}}}
            await asyncio.wait_for(endpoint(scope, client.receive, send_and_look), 10.0)
            answer = json.loads(client.messages[-1]["body"])
            return answer, counted_when_sent[0], answered.value, core.metrics.requests_in_flight
        finally:
            await core.stop()
            server.close()

    answer, counted_when_sent, counted_after, in_flight = asyncio.run(scenario())
    assert answer["choices"][0]["message"]["content"] == "hi"
    assert answer["usage"]["total_tokens"] == 4
    assert (counted_when_sent, counted_after, in_flight) == (0, 1, 0)
