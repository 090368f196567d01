"""A small HTTP/1.1 client for worker calls (completions, streamed; health checks and metrics scrapes):
keep-alive connections per origin, parsed by httptools.

httpx's pool scans every pooled connection (and polls its socket) on each request, which costs
more than the rest of the proxy at a few hundred connections; this client pops an idle
connection in O(1). The reader takes whatever body bytes have arrived as one piece; reading stops
while more than MAX_BUFFERED_BYTES wait for it, so a slow client still pushes back on the worker.
Network failures raise httpx's exception types, so gateway/errors.py stays the one place that
translates upstream errors.

Idle connections expire after KEEPALIVE_EXPIRY_S, below the workers' own idle close (uvicorn's
default is 5 s), so the gateway normally drops a connection before the worker does. A request on a
pooled connection that the worker closed anyway (EOF or reset before any byte of the answer: it
was idle-closed as the request went out) is sent once more on a fresh connection, unseen by callers.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Awaitable
from urllib.parse import urlsplit

import httptools
import httpx

MAX_BUFFERED_BYTES = 256 * 1024
KEEPALIVE_EXPIRY_S = 4.0  # below the worker's idle close (uvicorn's timeout_keep_alive, 5 s by default)
MAX_IDLE_PER_ORIGIN = 1024
MAX_GET_BYTES = 8 * 1024 * 1024  # a GET's whole body (a worker's /metrics page: vLLM's is ~100 KiB)

Origin = tuple[str, str, int]  # scheme, host, port


TIMER_SLACK_S = 0.001  # a timer may fire this early (the loop's clock runs in milliseconds): it times out then


class _Connection(asyncio.Protocol):
    """One TCP connection; at most one request in flight; its response is read with next_chunk()."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since_s = 0.0
        self._timer: asyncio.TimerHandle | None = None  # bounds the wait in progress (_arm)
        self._deadline: float | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.num_response_bytes = 0  # of the current response, as received (headers included)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.num_response_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response from the worker: {exc}"))
            self.transport.close()
            return
        if self._buffered > MAX_BUFFERED_BYTES and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.complete:
            return
        if exc is None and self.headers_done and self._ends_at_close():
            self.complete = True  # the worker's close is the body's end (an HTTP/1.0-style answer)
            self._wake()
            return
        self._fail(httpx.ReadError(f"worker closed the connection: {exc!r}") if exc else
                   httpx.RemoteProtocolError("worker closed the connection before the response ended"))

    def _ends_at_close(self) -> bool:
        """Whether the response's body is delimited by the connection's close: neither a content-length
        nor a chunked transfer-encoding (RFC 9112 6.3; httptools reads such a body but cannot end it)."""
        return not any(name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower())
                       for name, value in self.headers)

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- reading -----------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _arm(self, timeout_s: float | None) -> asyncio.Future:
        """A future the parser or the connection resolves when it has news, failed with TimeoutError once
        timeout_s passes without any (None: no bound). Await it, then _disarm() in a finally: the callers
        do so inline, a coroutine frame fewer for every token of a stream.

        The bound is kept by one timer a connection, set once and moved only when it fires before the
        current wait's deadline: each read of a stream sets a later deadline without a timer of its own (a
        timer set and cancelled for every token cost ~2 us; asyncio.timeout, cancelling and uncancelling
        the task, several times that)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        if timeout_s is None:
            self._deadline = None
            return waiter
        self._deadline = deadline = loop.time() + timeout_s
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline, self._deadline_reached)
        return waiter

    def _disarm(self) -> None:
        self._waiter = None

    def _deadline_reached(self) -> None:
        """The timer: the wait in progress times out if its deadline has passed; else the timer moves to it."""
        self._timer = None
        waiter, deadline = self._waiter, self._deadline
        if waiter is None or waiter.done() or deadline is None:
            return  # no wait in progress: the next one sets the timer again
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline - TIMER_SLACK_S:
            waiter.set_exception(TimeoutError())
        else:
            self._timer = loop.call_at(deadline, self._deadline_reached)

    async def wait_headers(self, deadline: float | None = None) -> None:
        """Until the response headers are in; TimeoutError once the loop's clock passes deadline."""
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError()
            waiter = self._arm(remaining)
            try:
                await waiter
            finally:
                self._disarm()

    async def next_chunk(self, timeout_s: float | None = None) -> bytes | None:
        """The body bytes received since the last call (all of them, as one piece: a read of several
        HTTP chunks is not handed on chunk by chunk); None at the end of the response. timeout_s
        bounds each wait for data (TimeoutError); bytes already received are returned without a timer."""
        while True:
            if self._chunks:
                chunks = self._chunks
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self.transport.resume_reading()
                return chunk
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            waiter = self._arm(timeout_s)
            try:
                await waiter
            finally:
                self._disarm()

    def reusable(self) -> bool:
        return self.complete and not self.closed and self.keep_alive

    def is_open(self) -> bool:
        """Neither closed by the worker (as far as this loop has seen) nor being closed here."""
        return not self.closed and not self.transport.is_closing()


async def _no_more_chunks() -> None:
    return None


class UpstreamResponse:
    """A response whose body is read chunk by chunk; aclose() returns its connection to the pool
    when the body was read to the end, and closes it otherwise."""

    def __init__(self, client: UpstreamClient, origin: Origin, conn: _Connection) -> None:
        self._client, self._origin, self._conn = client, origin, conn
        self.status_code = conn.status
        self.headers = conn.headers

    def next_chunk(self, timeout_s: float | None = None) -> Awaitable[bytes | None]:
        """The next body bytes, None at the end (or after aclose); see _Connection.next_chunk. The
        connection's own coroutine, not one awaiting it: one frame fewer for every token of a stream."""
        return _no_more_chunks() if self._conn is None else self._conn.next_chunk(timeout_s)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.release(self._origin, conn)


class UpstreamClient:
    """POST JSON, stream the answer: `await client.post_stream(url, payload, headers, connect_timeout_s,
    headers_timeout_s)`; GET a page whole: `status, body = await client.get(url, timeout_s)`."""

    def __init__(self, *, keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S, clock=time.monotonic) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
        self._targets: dict[str, tuple[Origin, str]] = {}  # url -> (origin, a POST head's fixed start)
        self._get_requests: dict[str, tuple[Origin, bytes]] = {}  # url -> (origin, a GET's request)
        self._keepalive_expiry_s = keepalive_expiry_s
        self._clock = clock
        self._ssl: ssl.SSLContext | None = None

    async def post_stream(self, url: str, payload: bytes, headers: dict[str, str], connect_timeout_s: float,
                          headers_timeout_s: float | None = None) -> UpstreamResponse:
        """Send payload (the JSON body, encoded) and wait for the response headers: TimeoutError when
        they are not in within headers_timeout_s (None: no bound), connecting included (a timer on
        the loop: asyncio.timeout would cancel and uncancel the task, at several times the cost). On
        a pooled connection the worker closed before answering a byte, the request goes once more on
        a fresh connection; a fresh connection's failure is raised as it is."""
        origin, head_start = self._target(url)
        return await self._send(origin, _request_head(head_start, headers, len(payload)) + payload, connect_timeout_s,
                                headers_timeout_s)

    async def get(self, url: str, timeout_s: float, max_bytes: int = MAX_GET_BYTES) -> tuple[int, bytes]:
        """GET url: its status and whole body, within timeout_s in all (TimeoutError); httpx.ReadError for a
        body over max_bytes. For health checks and metrics scrapes: a fraction of httpx's CPU a request,
        which a fleet's checks pay every interval for every worker."""
        origin, request = self._get_target(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        response = await self._send(origin, request, timeout_s, timeout_s)
        body = bytearray()
        try:
            while (chunk := await response.next_chunk(max(0.0, deadline - loop.time()))) is not None:
                body += chunk
                if len(body) > max_bytes:
                    raise httpx.ReadError(f"{url}: response body over {max_bytes} bytes")
        finally:
            await response.aclose()
        return response.status_code, bytes(body)

    async def _send(self, origin: Origin, request: bytes, connect_timeout_s: float,
                    headers_timeout_s: float | None) -> UpstreamResponse:
        deadline = None if headers_timeout_s is None else asyncio.get_running_loop().time() + headers_timeout_s
        conn = self._pop_idle(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, request, deadline)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                if conn.num_response_bytes:  # the worker began to answer: its failure, not an idle close
                    raise
        conn = await self._connect(origin, connect_timeout_s, deadline)
        return await self._exchange(origin, conn, request, deadline)

    async def _exchange(self, origin: Origin, conn: _Connection, request: bytes,
                        deadline: float | None) -> UpstreamResponse:
        """Write the request on conn and wait for the response headers; conn is closed on any failure."""
        conn._reset()
        try:
            conn.transport.write(request)
            await conn.wait_headers(deadline)
        except BaseException:
            conn.transport.close()
            raise
        return UpstreamResponse(self, origin, conn)

    def release(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if conn.reusable() and len(idle) < MAX_IDLE_PER_ORIGIN:
            if conn._paused:
                conn._paused = False
                conn.transport.resume_reading()
            conn.idle_since_s = self._clock()
            idle.append(conn)
        else:
            conn.transport.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()

    def _pop_idle(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = self._clock()
        while idle:
            conn = idle.pop()
            if conn.is_open() and now - conn.idle_since_s < self._keepalive_expiry_s:
                return conn
            conn.transport.close()
        return None

    async def _connect(self, origin: Origin, connect_timeout_s: float, deadline: float | None) -> _Connection:
        """A new connection to origin: httpx.ConnectTimeout after connect_timeout_s, TimeoutError
        when the loop's clock passes deadline first (the caller's bound on the whole exchange)."""
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        connect_deadline = loop.time() + connect_timeout_s
        bound = connect_deadline if deadline is None else min(deadline, connect_deadline)
        try:
            async with asyncio.timeout_at(bound):
                _, conn = await loop.create_connection(_Connection, host, port,
                                                       ssl=self._ssl_context() if scheme == "https" else None)
        except TimeoutError:
            if bound < connect_deadline:
                raise
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{exc}") from None
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _target(self, url: str) -> tuple[Origin, str]:
        """url's origin, and the start of a POST's head to it (up to its content-length), made once a url."""
        cached = self._targets.get(url)
        if cached is None:
            origin, target, authority = _split_url(url)
            head_start = (f"POST {target} HTTP/1.1\r\nhost: {authority}\r\naccept: */*\r\n"
                          "content-type: application/json\r\n")
            cached = self._targets[url] = (origin, head_start)
        return cached

    def _get_target(self, url: str) -> tuple[Origin, bytes]:
        """url's origin, and a GET's whole request to it, made once a url."""
        cached = self._get_requests.get(url)
        if cached is None:
            origin, target, authority = _split_url(url)
            request = f"GET {target} HTTP/1.1\r\nhost: {authority}\r\naccept: */*\r\n\r\n".encode("latin-1")
            cached = self._get_requests[url] = (origin, request)
        return cached


def _split_url(url: str) -> tuple[Origin, str, str]:
    """url's origin, its request target (path and query) and its host header's value."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"unsupported worker URL {url!r}")
    default_port = 443 if parts.scheme == "https" else 80
    port = parts.port or default_port
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.hostname if port == default_port else f"{parts.hostname}:{port}"
    return (parts.scheme, parts.hostname, port), target, authority


def _request_head(head_start: str, headers: dict[str, str], content_length: int) -> bytes:
    lines = [f"{head_start}content-length: {content_length}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise httpx.LocalProtocolError(f"invalid header {name!r}")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
