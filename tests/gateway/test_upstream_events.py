"""Reading an attempt's events (gateway/upstream.py read_events): a stream the SSE parser cannot take
is the worker's protocol failure, which the session retries or fails over like any other."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import UpstreamError
from gateway.sse import SseParser
from gateway.upstream import Attempt, read_events


class Chunks:
    """A response that gives these chunks, then the end of the stream."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def next_chunk(self, timeout_s: float) -> bytes | None:
        return self.chunks.pop(0) if self.chunks else None


def test_an_event_past_the_size_bound_is_a_protocol_failure_of_the_worker():
    async def scenario() -> None:
        first = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        attempt = Attempt("w0", Chunks([first, b"data: " + b"x" * 600, b"x" * 600]), 0.0,
                          parser=SseParser(max_event_bytes=1000))
        [event] = await read_events(attempt, 1.0)
        assert event.raw == first
        with pytest.raises(UpstreamError) as failed:
            await read_events(attempt, 1.0)
        assert failed.value.kind == "protocol" and "1000 bytes" in str(failed.value)

    asyncio.run(scenario())
