"""Reads one OpenAI SSE stream on the client side: its chunks, content (text and arrival times), usage,
errors and the end marker. The one reader for the load tests, the benchmarks and the tests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable


class StreamReader:
    """Feed it each line of the stream; it keeps the content text, when content arrived (clock
    seconds), the last usage, the error if any, and whether `data: [DONE]` came."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.content_times_s: list[float] = []
        self.content_parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    @property
    def text(self) -> str:
        """The content so far: completions' choice text, chat's delta content."""
        return "".join(self.content_parts)

    def read(self, lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        """Feed lines in turn, yielding each JSON chunk as it is read."""
        for line in lines:
            chunk = self.feed_line(line)
            if chunk is not None:
                yield chunk

    def feed_line(self, line: str) -> dict[str, Any] | None:
        """Read one line; returns the JSON chunk of a `data:` line, None for any other line, for
        [DONE] and for a chunk that is not a JSON object (which sets error to "bad_chunk")."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            self.error = "bad_chunk"
            return None
        self._feed_chunk(chunk)
        return chunk

    def _feed_chunk(self, chunk: dict[str, Any]) -> None:
        if chunk.get("error"):
            self.error = "stream_error"
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        parts = [text for text in map(_content, chunk.get("choices") or ()) if text]
        if parts:
            self.content_times_s.append(self.clock())
            self.content_parts.extend(parts)

    def usage_int(self, *path: str) -> int | None:
        """A number inside usage, e.g. usage_int("prompt_tokens_details", "cached_tokens"); None if absent."""
        value: Any = self.usage
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return int(value) if isinstance(value, (int, float)) else None


def _content(choice: Any) -> str:
    """The content a stream choice carries ("" for none): chat's delta.content or completions' text."""
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""
