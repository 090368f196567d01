"""The fixed-response upstream (loadtest/harness/fixed_upstream.py): its answers and its nginx config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loadtest.harness.fixed_upstream import (NUM_CHUNKS, _nginx_string, answer_body, answer_text, nginx_conf,
                                             request_body)
from loadtest.sse import StreamReader


def _stream_reader(text: str) -> StreamReader:
    reader = StreamReader()
    for line in text.splitlines():
        reader.feed_line(line)
    return reader


def test_the_upstream_answers_whole_json_and_whole_sse():
    plain = json.loads(answer_body("chat", stream=False))
    reader = _stream_reader(answer_body("completion", stream=True))

    assert plain["choices"][0]["message"]["content"] == "tok " * NUM_CHUNKS
    assert plain["usage"]["completion_tokens"] == NUM_CHUNKS
    assert reader.done and reader.error is None and reader.text == "tok " * NUM_CHUNKS
    assert reader.usage is not None and reader.usage["completion_tokens"] == NUM_CHUNKS


def test_nginx_picks_the_sse_answer_only_for_a_streaming_body():
    conf = nginx_conf(18080, Path("/tmp/bench"))
    pattern = re.search(r"map \$request_body \$answer \{ '~(.+?)' sse; default json; \}", conf).group(1)

    assert re.search(pattern, request_body(stream=True))
    assert re.search(pattern, '{"model": "m", "stream" : true}')
    assert not re.search(pattern, request_body(stream=False))


def test_nginx_serves_each_completion_path_in_both_forms_on_its_own_port():
    conf = nginx_conf(18080, Path("/tmp/bench"))

    assert "listen 127.0.0.1:18080" in conf and "worker_processes 1;" in conf and "daemon off;" in conf
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert f"location = /_sse{path} {{ internal; default_type text/event-stream;" in conf
        assert f"location = /_json{path} {{ internal; default_type application/json;" in conf
    assert "\\n\\ndata: [DONE]\\n\\n'" in conf  # newlines as nginx escapes, inside one quoted string


@pytest.mark.parametrize("text", ["it's", "a\\b", "$uri"], ids=["quote", "backslash", "variable"])
def test_an_nginx_answer_with_a_character_nginx_would_interpret_is_refused(text):
    with pytest.raises(ValueError):
        _nginx_string(text)


@pytest.mark.parametrize(("body", "stream", "expected"), [
    (answer_body("chat", False), False, "tok " * NUM_CHUNKS),
    (answer_body("chat", True), True, "tok " * NUM_CHUNKS),
    (answer_body("chat", True).replace("data: [DONE]\n\n", ""), True, None),
], ids=["json", "sse", "sse-without-done"])
def test_a_proxied_answer_counts_only_when_whole(body, stream, expected):
    assert answer_text(body, stream) == expected
