"""One attempt at one worker: open a streaming request, then read SSE events with timeouts.

Time to first byte counts until the first event that shows progress (text, a finish reason, usage
or an error), not just response headers: a worker that answers headers and then hangs is caught
before anything reaches the client, so the request can still be retried elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from gateway.errors import UpstreamError, map_upstream_errors, upstream_error
from gateway.sse import SseError, SseEvent, SseParser
from gateway.upstream_http import UpstreamClient, UpstreamResponse

MAX_ERROR_BODY_BYTES = 64 * 1024
MAX_DRAIN_BYTES = 64 * 1024
DRAIN_TIMEOUT_S = 0.05  # what is left after [DONE] is the chunked body's end, normally already here


@dataclass(slots=True)
class Attempt:
    """An open upstream stream: events are read from it with read_events()."""

    worker_id: str
    response: UpstreamResponse
    started_s: float
    parser: SseParser = field(default_factory=SseParser)
    first_byte_s: float | None = None
    expected_first_byte_s: float | None = None  # the router's expectation (Router.on_first_token)
    eof: bool = False

    async def close(self, drain: bool = False) -> None:
        """Close the stream; drain=True first reads the rest of a finished answer (a little, briefly),
        so the connection goes back to the pool instead of being closed mid-body."""
        try:
            if drain and not self.eof:
                await self._drain()
        finally:
            await self.response.aclose()

    async def _drain(self) -> None:
        received, deadline = 0, time.monotonic() + DRAIN_TIMEOUT_S
        try:
            while (chunk := await self.response.next_chunk(max(0.0, deadline - time.monotonic()))) is not None:
                received += len(chunk)
                if received > MAX_DRAIN_BYTES:
                    return
        except (httpx.HTTPError, TimeoutError):
            return
        self.eof = True


async def open_attempt(client: UpstreamClient, worker_id: str, url: str, payload: bytes,
                       headers: dict[str, str], connect_timeout_s: float, first_byte_timeout_s: float,
                       idle_timeout_s: float) -> Attempt:
    """POST payload (a JSON body) to url as a stream; raises UpstreamError (status errors carry the worker's body)."""
    started = time.monotonic()
    try:
        with map_upstream_errors("headers"):
            response = await client.post_stream(url, payload, headers, connect_timeout_s, first_byte_timeout_s)
    except TimeoutError:
        raise UpstreamError("first_byte_timeout", f"no response within {first_byte_timeout_s} s") from None
    if response.status_code != 200:
        try:
            async with asyncio.timeout(idle_timeout_s):
                with map_upstream_errors("error body"):
                    content = await _read_limited(response)
        except (UpstreamError, TimeoutError):
            content = b""
        finally:
            await response.aclose()
        raise UpstreamError("status", f"worker answered {response.status_code}", response.status_code, content)
    return Attempt(worker_id, response, started)


async def _read_limited(response: UpstreamResponse) -> bytes:
    data = b""
    while (chunk := await response.next_chunk()) is not None:
        data += chunk
        if len(data) >= MAX_ERROR_BODY_BYTES:
            break
    return data[:MAX_ERROR_BODY_BYTES]


async def read_events(attempt: Attempt, timeout_s: float) -> list[SseEvent]:
    """The next complete events; [] with attempt.eof set at the end of the stream."""
    while True:
        try:
            chunk = await attempt.response.next_chunk(timeout_s)
        except TimeoutError:
            raise UpstreamError("idle_timeout", f"no data for {timeout_s} s") from None
        except httpx.HTTPError as exc:  # map_upstream_errors' translation, without entering it for every token
            error = upstream_error(exc, "a chunk")
            if error is None:
                raise
            raise error from exc
        if chunk is None:
            attempt.eof = True
            return []
        try:
            events = attempt.parser.feed(chunk)
        except SseError as exc:
            raise UpstreamError("protocol", str(exc)) from None
        if events:
            return events


def shows_progress(event: SseEvent) -> bool:
    """True for an event other than a bare role announcement: text, a tool call, finish, usage, error or DONE
    (wait_first_progress raises on an error event before the first token)."""
    payload = event.payload
    if payload is None:
        return True
    if "error" in payload or payload.get("usage"):
        return True
    for choice in payload.get("choices") or ():
        if choice.get("finish_reason") is not None:
            return True
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("tool_calls"):
            return True
    return False


async def wait_first_progress(attempt: Attempt, first_byte_timeout_s: float) -> list[SseEvent]:
    """Read until an event shows progress, within first_byte_timeout_s of the attempt's start."""
    held: list[SseEvent] = []
    while True:
        remaining = first_byte_timeout_s - (time.monotonic() - attempt.started_s)
        if remaining <= 0:
            raise UpstreamError("first_byte_timeout", f"no first token within {first_byte_timeout_s} s")
        events = await read_events(attempt, remaining)
        if attempt.eof:
            raise UpstreamError("protocol", "stream ended before the first token")
        for event in events:
            _raise_stream_error(event)
        held.extend(events)
        if any(shows_progress(e) for e in events):
            attempt.first_byte_s = time.monotonic() - attempt.started_s
            return held


def _raise_stream_error(event: SseEvent) -> None:
    """An error event before the first token: the attempt failed before the answer began. One that
    names a 4xx code (vLLM's error events carry the HTTP status) is the request's fault and goes to the
    client as that status; any other is the worker failing, to be retried on another."""
    payload = event.payload
    if payload is None or "error" not in payload:
        return
    error = payload["error"]
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500 and code != 429:
        body = json.dumps(payload if isinstance(error, dict) else {"error": {"message": str(error)}}).encode()
        raise UpstreamError("status", f"worker refused the request in its stream ({code})", code, body)
    raise UpstreamError("stream_error", f"worker reported an error before the first token: {error}")
