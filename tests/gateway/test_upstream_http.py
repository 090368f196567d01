"""The gateway's keep-alive client for worker calls (gateway/upstream_http.py) against a raw asyncio
server on loopback: connection reuse and expiry, a worker closing an idle connection as a request
goes out (retried once on a fresh connection, never a worker failure), and GETs read whole (health
checks and scrapes) within their time and size bounds."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from gateway.errors import UpstreamError, map_upstream_errors
from gateway.upstream_http import UpstreamClient, UpstreamResponse
from kvgate.clock import ManualClock

ANSWER = b'data: {"choices":[{"index":0,"text":"hi"}]}\n\ndata: [DONE]\n\n'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
BODY = b'{"model":"tiny","prompt":"hi","stream":true}'

TRICKLE_PIECES = 6
Plan = Callable[[int, int], str]  # (connection number, request number on it) -> what the worker does


def always_answer(conn_index: int, request_index: int) -> str:
    return "answer"


def reused_then(action: str) -> Plan:
    """Answer each connection's first request; do action on any later one (a reused connection)."""
    return lambda conn_index, request_index: action if request_index > 0 else "answer"


def first_connection_then(action: str, later: str = "answer") -> Plan:
    """action on the first connection's first request, later on every other request."""
    return lambda conn_index, request_index: action if conn_index == request_index == 0 else later


class RawWorker:
    """An HTTP/1.1 server on a loopback port that answers each request per plan: "answer" (ANSWER,
    kept alive), "eof" or "reset" (close without a byte, as an idle close racing the request does),
    "partial_head" (half a status line, then close), "partial_body" (headers and part of the body,
    then wait for the client to go), "silent" (no answer: wait for the client to go), "close_delimited"
    (an HTTP/1.0 answer without a length, ended by closing the connection). idle_close_s:
    close a connection idle that long."""

    def __init__(self, plan: Plan = always_answer, idle_close_s: float | None = None) -> None:
        self.plan = plan
        self.idle_close_s = idle_close_s
        self.num_connections = 0
        self.num_requests = 0
        self.num_closed = 0
        self.url = ""
        self.clients: list[UpstreamClient] = []

    def client(self, **options) -> UpstreamClient:
        """An UpstreamClient closed when the worker stops."""
        self.clients.append(UpstreamClient(**options))
        return self.clients[-1]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_index, self.num_connections = self.num_connections, self.num_connections + 1
        try:
            request_index = 0
            while await self._read_request(reader):
                self.num_requests += 1
                action = self.plan(conn_index, request_index)
                request_index += 1
                if action != "answer":
                    await self._misbehave(action, reader, writer)
                    return
                writer.write(HEAD % len(ANSWER) + ANSWER)
                await writer.drain()
        finally:
            writer.close()
            self.num_closed += 1

    async def _read_request(self, reader: asyncio.StreamReader) -> bool:
        """Read one request (head and body); False when the client went away or idled past idle_close_s."""
        try:
            async with asyncio.timeout(self.idle_close_s):
                head = await reader.readuntil(b"\r\n\r\n")
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)  # a GET's: none
        await reader.readexactly(length)
        return True

    @staticmethod
    async def _misbehave(action: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if action == "reset":  # linger 0: close() sends RST instead of FIN
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif action == "partial_head":
            writer.write(b"HTTP/1.1 200")
        elif action == "partial_body":
            writer.write(HEAD % (len(ANSWER) + 100) + ANSWER)
            await reader.read()  # until the client closes
        elif action == "silent":
            await reader.read()
        elif action == "close_delimited":  # HTTP/1.0 style: no length, the close ends the body
            writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + ANSWER)
            await writer.drain()
        elif action.startswith("trickle:"):  # TRICKLE_PIECES pieces of the body, a piece every `gap` seconds
            gap_s = float(action.split(":")[1])
            piece = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
            writer.write(HEAD % (len(piece) * TRICKLE_PIECES))
            for _ in range(TRICKLE_PIECES):
                await asyncio.sleep(gap_s)
                writer.write(piece)
                await writer.drain()
            await reader.read()


@contextlib.asynccontextmanager
async def raw_worker(plan: Plan = always_answer, idle_close_s: float | None = None) -> AsyncIterator[RawWorker]:
    worker = RawWorker(plan, idle_close_s)
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0)
    worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    try:
        yield worker
    finally:
        for client in worker.clients:
            await client.aclose()
        server.close()
        # each handler ends on the client's close (a cancelled one would be logged as an error by asyncio)
        await wait_for(lambda: worker.num_closed == worker.num_connections)


async def post(client: UpstreamClient, worker: RawWorker) -> UpstreamResponse:
    return await client.post_stream(worker.url, BODY, {"x-request-id": "r1"}, connect_timeout_s=1.0)


async def read_all(response: UpstreamResponse) -> bytes:
    chunks = []
    while (chunk := await response.next_chunk(timeout_s=2.0)) is not None:
        chunks.append(chunk)
    await response.aclose()
    return b"".join(chunks)


async def answered(client: UpstreamClient, worker: RawWorker) -> bytes:
    response = await post(client, worker)
    assert response.status_code == 200
    return await read_all(response)


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


def test_a_connection_read_to_the_end_is_reused():
    async def scenario() -> None:
        async with raw_worker() as worker:
            client = worker.client()
            for _ in range(3):
                assert await answered(client, worker) == ANSWER
        assert worker.num_connections == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("idle_s", "num_connections"), [(3.9, 1), (4.0, 2)], ids=["within-expiry", "past-expiry"])
def test_by_default_a_connection_idle_4_s_is_not_reused(idle_s, num_connections):
    """4 s: below a worker's own idle close (uvicorn closes after 5 s idle by default)."""
    async def scenario() -> None:
        clock = ManualClock()
        async with raw_worker() as worker:
            client = worker.client(clock=clock)
            await answered(client, worker)
            clock.advance(idle_s)
            await answered(client, worker)
        assert worker.num_connections == num_connections

    asyncio.run(scenario())


def test_a_response_not_read_to_the_end_is_not_reused():
    async def scenario() -> None:
        async with raw_worker(first_connection_then("partial_body")) as worker:
            client = worker.client()
            response = await post(client, worker)
            assert await response.next_chunk(timeout_s=2.0)
            await response.aclose()  # mid-body: the connection is closed, not pooled
            assert await answered(client, worker) == ANSWER
        assert worker.num_connections == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("close", ["eof", "reset"])
def test_a_pooled_connection_closed_as_the_request_goes_out_is_retried_on_a_fresh_one(close):
    """The worker closes the reused connection on receiving the request without a byte of answer,
    as an idle close racing the request looks: the caller gets the answer, not an error."""
    async def scenario() -> None:
        async with raw_worker(reused_then(close)) as worker:
            client = worker.client()
            assert await answered(client, worker) == ANSWER
            with map_upstream_errors("headers"):
                assert await answered(client, worker) == ANSWER
        assert (worker.num_connections, worker.num_requests) == (2, 3)

    asyncio.run(scenario())


def test_a_fresh_connections_failure_is_still_an_error():
    async def scenario() -> None:
        async with raw_worker(lambda conn_index, request_index: "eof") as worker:
            client = worker.client()
            with pytest.raises(UpstreamError) as failed, map_upstream_errors("headers"):
                await post(client, worker)
            assert failed.value.kind == "protocol"
        assert worker.num_connections == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("pooled", [False, True])
def test_headers_not_in_within_the_bound_time_out_and_close_the_connection(pooled):
    """headers_timeout_s bounds the wait for the response head, on a fresh or a pooled connection."""
    async def scenario() -> None:
        plan = reused_then("silent") if pooled else first_connection_then("silent")
        async with raw_worker(plan) as worker:
            client = worker.client()
            if pooled:
                await answered(client, worker)
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await client.post_stream(worker.url, BODY, {}, connect_timeout_s=1.0, headers_timeout_s=0.2)
            assert 0.2 <= time.monotonic() - started < 1.0
            await wait_for(lambda: worker.num_closed == worker.num_connections)  # the client hung up
        assert worker.num_connections == 1

    asyncio.run(scenario())


def test_a_request_is_sent_again_at_most_once():
    """Pooled connection closed, then the fresh one too: the error reaches the caller, after two connections."""
    async def scenario() -> None:
        async with raw_worker(first_connection_then("answer", later="eof")) as worker:
            client = worker.client()
            await answered(client, worker)
            with pytest.raises(UpstreamError), map_upstream_errors("headers"):
                await post(client, worker)
        assert (worker.num_connections, worker.num_requests) == (2, 3)

    asyncio.run(scenario())


def test_a_pooled_connection_that_began_to_answer_is_not_retried():
    """Bytes of an answer arrived: the worker took the request, so sending it again could run it twice."""
    async def scenario() -> None:
        async with raw_worker(reused_then("partial_head")) as worker:
            client = worker.client()
            await answered(client, worker)
            with pytest.raises(httpx.RemoteProtocolError):
                await post(client, worker)
        assert worker.num_connections == 1

    asyncio.run(scenario())


def test_a_worker_closing_idle_connections_sooner_than_the_pool_expires_them_costs_no_failure():
    """A pool keeping connections longer than the worker does: every request still gets its answer,
    whether the close was seen before the request (a fresh connection) or raced it (sent again)."""
    async def scenario() -> None:
        async with raw_worker(idle_close_s=0.05) as worker:
            client = worker.client(keepalive_expiry_s=60.0)
            for num_closed in range(1, 6):
                assert await answered(client, worker) == ANSWER
                await wait_for(lambda: worker.num_closed == num_closed)
        assert worker.num_connections == 5

    asyncio.run(scenario())


def test_a_get_reads_the_whole_body_on_a_pooled_connection():
    async def scenario() -> None:
        async with raw_worker() as worker:
            client = worker.client()
            assert await answered(client, worker) == ANSWER
            assert await client.get(worker.url.replace("/v1/completions", "/metrics"), timeout_s=2.0) == (200, ANSWER)
            assert await client.get(worker.url, timeout_s=2.0, max_bytes=len(ANSWER)) == (200, ANSWER)
        assert (worker.num_connections, worker.num_requests) == (1, 3)

    asyncio.run(scenario())


def test_a_get_over_its_size_bound_is_an_error():
    async def scenario() -> None:
        async with raw_worker() as worker:
            client = worker.client()
            with pytest.raises(httpx.ReadError, match="over 10 bytes"):
                await client.get(worker.url, timeout_s=2.0, max_bytes=10)
            assert await client.get(worker.url, timeout_s=2.0) == (200, ANSWER)

    asyncio.run(scenario())


@pytest.mark.parametrize("action", ["silent", "partial_body"])
def test_a_get_not_answered_whole_within_its_time_is_a_timeout(action):
    """The bound covers the whole exchange: a worker that never answers, or stops mid-body."""
    async def scenario() -> None:
        async with raw_worker(first_connection_then(action)) as worker:
            client = worker.client()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await client.get(worker.url, timeout_s=0.3)
            assert time.monotonic() - started < 1.5
            assert await client.get(worker.url, timeout_s=2.0) == (200, ANSWER)

    asyncio.run(scenario())


def test_a_body_ended_by_the_workers_close_is_read_whole_by_a_get_and_a_stream():
    """An HTTP/1.0-style answer (no content-length, not chunked): the close is the body's end, not a failure."""
    async def scenario() -> None:
        async with raw_worker(lambda conn_index, request_index: "close_delimited") as worker:
            client = worker.client()
            assert await client.get(worker.url, timeout_s=2.0) == (200, ANSWER)
            assert await answered(client, worker) == ANSWER
        assert worker.num_connections == 2  # neither was kept

    asyncio.run(scenario())


@pytest.mark.parametrize(("gap_s", "times_out"), [(0.1, False), (0.6, True)], ids=["each-wait-in-time", "a-wait-too-long"])
def test_the_read_timeout_bounds_each_wait_not_the_whole_body(gap_s, times_out):
    """next_chunk(timeout_s) bounds each wait for data: a body whose pieces come 0.1 s apart is read whole
    under a 0.3 s bound though it takes 0.6 s in all; pieces 0.6 s apart time out, in about 0.3 s."""
    async def scenario():
        async with raw_worker(lambda conn_index, request_index: f"trickle:{gap_s}") as worker:
            response = await post(worker.client(), worker)
            pieces, started = 0, time.monotonic()
            try:
                while await response.next_chunk(timeout_s=0.3) is not None:
                    pieces += 1
            except TimeoutError:
                assert times_out and pieces == 0 and 0.25 < time.monotonic() - started < 0.55
            else:
                assert not times_out and pieces == TRICKLE_PIECES
            await response.aclose()

    asyncio.run(scenario())
