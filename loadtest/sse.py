"""Reads one OpenAI SSE stream as it arrives: content-chunk times, usage, errors, and the end marker."""

from __future__ import annotations

import json
from typing import Any, Callable


class StreamReader:
    """Feed it each line of the stream; it notes when content arrives (clock seconds) and what usage says."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.content_times_s: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed_line(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.error = "bad_chunk"
            return
        self._feed_chunk(chunk)

    def _feed_chunk(self, chunk: dict[str, Any]) -> None:
        if chunk.get("error"):
            self.error = "stream_error"
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if any(_content(choice) for choice in chunk.get("choices") or ()):
            self.content_times_s.append(self.clock())

    def usage_int(self, *path: str) -> int | None:
        """A number inside usage, e.g. usage_int("prompt_tokens_details", "cached_tokens"); None if absent."""
        value: Any = self.usage
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return int(value) if isinstance(value, (int, float)) else None


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""
