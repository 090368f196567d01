"""A load generator's HTTP/1.1 client on raw asyncio streams (not httpx, whose own CPU would swamp the
gateway's): keep-alive connections, a pool of them, and the check that an answer came back whole."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, TypeVar

from loadtest.harness.gateway import API_KEY, MODEL
from loadtest.sse import StreamReader


class Connection:
    """One keep-alive HTTP/1.1 connection; request() returns (status, body)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        if headers.get("transfer-encoding") == "chunked":
            return status, await self._read_chunked()
        return status, await self.reader.readexactly(int(headers.get("content-length", "0")))

    async def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append((await self.reader.readexactly(size + 2))[:-2])

    def close(self) -> None:
        self.writer.close()


def http_request(port: int, path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {API_KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data


def completion_body(stream: bool, num_tokens: int = 1, chunk_delay_ms: float = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": num_tokens, "stream": stream}
    if chunk_delay_ms:
        body["bench_chunk_delay_ms"] = chunk_delay_ms
    return body


def check_answer(status: int, body: bytes, stream: bool, num_tokens: int) -> bool:
    if status != 200:
        return False
    if stream:
        reader = StreamReader()
        for line in body.decode(errors="replace").splitlines():
            reader.feed_line(line)
        return reader.done and reader.error is None and reader.text == "tok " * num_tokens
    return json.loads(body)["choices"][0]["text"] == "tok " * num_tokens


class Pool:
    """A fixed set of keep-alive connections to one port, opened up front and reused (the most
    recently used first), as a pooling client (httpx, an L7 balancer, wrk2's `-c`) uses them:
    when every connection is busy a request waits for one (its latency still counts from its
    scheduled arrival) instead of opening a new connection in the middle of a burst. A
    connection that fails is replaced."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.idle: asyncio.LifoQueue[Connection] = asyncio.LifoQueue()  # the warmest connection first

    async def open(self) -> None:
        for conn in await asyncio.gather(*(Connection.open(self.port) for _ in range(self.size))):
            self.idle.put_nowait(conn)

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        return await self.use(lambda conn: conn.request(raw))

    async def use(self, work: Callable[[Connection], Awaitable[T]]) -> T:
        """work(conn) on an idle connection; one that failed is closed and replaced by a fresh one."""
        conn = await self.idle.get()
        try:
            answer = await work(conn)
        except BaseException:
            conn.close()
            self.idle.put_nowait(await Connection.open(self.port))
            raise
        self.idle.put_nowait(conn)
        return answer

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait().close()

T = TypeVar("T")

PROMPT = "You are a helpful assistant. Summarise the following text in one sentence: " + "lorem ipsum " * 20
