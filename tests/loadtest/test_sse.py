"""The client-side SSE reader (loadtest/sse.py): content, its arrival times, usage, errors, the end."""

from __future__ import annotations

import json

import httpx
import pytest

from loadtest.sse import StreamReader
from tests.conftest import free_port
from tests.loadtest.fake_upstream import Timing, build_app, serve_in_thread


def data(payload: dict) -> str:
    return "data: " + json.dumps(payload)


CHAT = [
    data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    "",
    data({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
    data({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}),
    data({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                   "prompt_tokens_details": {"cached_tokens": 4}}}),
    "data: [DONE]",
]
COMPLETION = [
    ": keep-alive comment",
    data({"choices": [{"index": 0, "text": "Hel"}]}),
    "data:" + json.dumps({"choices": [{"index": 0, "text": "lo"}]}),  # no space after the colon
    "data: [DONE]",
]


@pytest.mark.parametrize("lines", [CHAT, COMPLETION], ids=["chat", "completion"])
def test_only_chunks_with_content_count_as_content(lines):
    ticks = iter(range(100))
    reader = StreamReader(clock=lambda: float(next(ticks)))
    chunks = list(reader.read(lines))
    assert reader.text == "Hello" and reader.content_times_s == [0.0, 1.0]  # the role chunk is not content
    assert len(chunks) == len([line for line in lines if line.startswith("data:")]) - 1
    assert reader.done and reader.error is None


def test_usage_numbers_are_read_by_path_and_absent_ones_are_none():
    reader = StreamReader()
    list(reader.read(CHAT))
    assert reader.usage_int("prompt_tokens_details", "cached_tokens") == 4
    assert reader.usage_int("completion_tokens_details", "reasoning_tokens") is None


@pytest.mark.parametrize(("line", "error"), [
    ("data: {not json", "bad_chunk"),
    ("data: [1, 2]", "bad_chunk"),
    (data({"error": {"message": "worker died", "type": "server_error"}}), "stream_error"),
], ids=["not-json", "not-an-object", "error-chunk"])
def test_a_broken_or_error_chunk_sets_error_and_no_done(line, error):
    reader = StreamReader()
    reader.feed_line(line)
    assert reader.error == error and not reader.done and reader.text == ""


def test_reads_a_live_stream_over_loopback_role_chunk_first():
    timing = Timing(first_chunk_s=0.05, interval_s=0.01, num_chunks=4)
    with serve_in_thread(build_app(timing), free_port()) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        reader = StreamReader()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as response:
            list(reader.read(response.iter_lines()))
    assert reader.text == " tok0 tok1 tok2 tok3" and len(reader.content_times_s) == 4
    assert reader.done and reader.usage_int("completion_tokens") == 4
