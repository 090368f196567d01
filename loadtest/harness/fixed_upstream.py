"""The fixed-response upstream of the proxy benchmarks: nginx answering POST /v1/chat/completions and
/v1/completions with one fixed OpenAI-style answer, JSON or SSE as the request's body asks.

nginx cannot branch on a body by itself: the echo module (peers.NGINX_ECHO) reads the body, a `map` on
`$request_body` picks the answer and `echo_exec` jumps to it, so each proxy gets what it asks for (kvgate
always asks its worker for a stream, also for a non-streaming client). SSE answers are NUM_CHUNKS content
chunks, a usage chunk and `data: [DONE]`, in one write with a content-length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from loadtest.harness.gateway import API_KEY, MODEL
from loadtest.peers import NGINX_ECHO
from loadtest.peers.nginx import nginx_head
from loadtest.procs import ChildProcess, pin
from loadtest.sse import StreamReader


PATH = "/v1/chat/completions"

PROMPT = "Say hello to the benchmark in a few words."

NUM_CHUNKS = 4


def _sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n"


def _usage() -> dict[str, Any]:
    return {"prompt_tokens": 12, "completion_tokens": NUM_CHUNKS, "total_tokens": 12 + NUM_CHUNKS,
            "prompt_tokens_details": {"cached_tokens": 0}}


def answer_body(kind: str, stream: bool) -> str:
    """The fixed answer: NUM_CHUNKS x "tok " as JSON, or as SSE chunks then usage and [DONE]."""
    chat = kind == "chat"
    head = {"id": "chatcmpl-bench" if chat else "cmpl-bench",
            "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion",
            "created": 0, "model": MODEL}
    if not stream:
        choice = ({"index": 0, "message": {"role": "assistant", "content": "tok " * NUM_CHUNKS}} if chat
                  else {"index": 0, "text": "tok " * NUM_CHUNKS})
        return json.dumps({**head, "choices": [{**choice, "logprobs": None, "finish_reason": "length"}],
                           "usage": _usage()}, separators=(",", ":"))
    chunks = []
    for i in range(NUM_CHUNKS):
        finish = "length" if i == NUM_CHUNKS - 1 else None
        choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
        chunks.append(_sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}))
    return "".join(chunks) + _sse({**head, "choices": [], "usage": _usage()}) + "data: [DONE]\n\n"


def _nginx_string(text: str) -> str:
    """text as a single-quoted nginx string (nginx unescapes \\n; the answers hold no ' \\ or $)."""
    if any(c in text for c in "'\\$"):
        raise ValueError("an nginx answer must not contain ', \\ or $")
    return "'" + text.replace("\n", "\\n") + "'"


def nginx_conf(port: int, tmp_dir: Path) -> str:
    """One worker process, no daemon, no logs; the answers above, chosen by the body's "stream";
    /health, /v1/models and an empty /metrics for the proxies' own checks, /v1/traces taking OTLP span
    batches as a collector would (loadtest/benchmarks/telemetry_overhead.py), 404 elsewhere."""
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                     "owned_by": "bench"}]}, separators=(",", ":"))
    answers = "\n".join(
        f"        location = /_{name}{path} {{ internal; default_type {media_type}; "
        f"return 200 {_nginx_string(answer_body(kind, name == 'sse'))}; }}"
        for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion"))
        for name, media_type in (("json", "application/json"), ("sse", "text/event-stream")))
    return f"load_module {NGINX_ECHO.file};\n" + nginx_head(tmp_dir, 8192) + f"""    keepalive_requests 100000000;
    keepalive_timeout 300s;
    client_body_buffer_size 64k;
    map $request_body $answer {{ '~"stream"\\s*:\\s*true' sse; default json; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        default_type application/json;
        location = /health {{ return 200 '{{"status":"ok"}}'; }}
        location = /v1/models {{ return 200 {_nginx_string(models)}; }}
        location = /metrics {{ default_type text/plain; return 200 ''; }}
        location = /v1/traces {{ default_type application/x-protobuf; return 200 ''; }}
        location / {{ return 404 '{{"error":{{"message":"not found","type":"not_found_error"}}}}'; }}
        location ~ ^/v1/(chat/)?completions$ {{ echo_read_request_body; echo_exec /_$answer$uri; }}
{answers}
    }}
}}
"""


def request_body(stream: bool) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": NUM_CHUNKS, "stream": stream}, separators=(",", ":"))


def start_nginx(port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    conf = tmp_dir / "nginx.conf"
    conf.write_text(nginx_conf(port, tmp_dir))
    return ChildProcess("nginx", [*pin(cpus), "nginx", "-c", str(conf), "-p", str(tmp_dir)], tmp_dir / "nginx.log",
                        f"http://127.0.0.1:{port}/health")


def check_answers(name: str, port: int) -> None:
    """One request per mode through this proxy; the whole fixed answer must come back."""
    for stream in (False, True):
        response = httpx.post(f"http://127.0.0.1:{port}{PATH}", content=request_body(stream), timeout=10.0,
                              headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
        if response.status_code != 200 or answer_text(response.text, stream) != "tok " * NUM_CHUNKS:
            raise RuntimeError(f"{name} answered {response.status_code} (stream={stream}): {response.text[:500]}")


def answer_text(body: str, stream: bool) -> str | None:
    """The content of a chat answer (JSON, or SSE that ends with [DONE]); None if it is not whole."""
    if not stream:
        return json.loads(body)["choices"][0]["message"]["content"]
    reader = StreamReader()
    for line in body.splitlines():
        reader.feed_line(line)
    return reader.text if reader.done and reader.error is None else None
