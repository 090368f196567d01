"""A worker that fails on purpose, for gateway fault tests.

usage: fake_worker.py PORT MODE
  (MODE: status503 | status500 | status429 | hang | hang_after_headers | hang_first | answer | slow | hold |
   trickle | stall_mid_stream | fail_twice_then_trickle | error_before_token | finish_without_usage |
   tool_call | logprobs_die_mid_stream)
answer streams a one-token completion at once; slow does the same after SLOW_FIRST_TOKEN_S; hold
answers its first token at once and finishes after HOLD_S (a request that takes a while to serve);
hang_first hangs after the headers on its first request and answers the others;
trickle streams a token every 0.1 s for a minute; stall_mid_stream sends two tokens, then nothing;
status500 / status429 answer that status; fail_twice_then_trickle answers 503 twice, then trickles;
error_before_token answers 200 and streams an error event before any token; finish_without_usage
streams two tokens, the last with its finish reason, then ends the stream (no usage, no [DONE]);
tool_call streams a chat answer that calls get_weather, its arguments in two deltas, with logprobs;
logprobs_die_mid_stream answers like vLLM asked for token ids and logprobs: a chat, or a completion of a
text prompt, streams "A" and "B" and then drops the connection; a completion of a token-id prompt (a
failover's continuation) streams "C" and "D" to its end;
GET /calls counts requests ("generate") and streams (trickle, hang_after_headers, hang_first) cut off by the
client ("cancelled"); GET /requests lists every request's headers and JSON body, in order.
/health always answers 200 so the worker stays in rotation: only the breaker, the timeouts
and slow-worker ejection can take it out.
"""

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODE = sys.argv[2]
SLOW_FIRST_TOKEN_S = 1.0
HOLD_S = 1.0
calls = {"generate": 0, "cancelled": 0}
received: list[dict] = []


async def generate(request: Request) -> Response:
    calls["generate"] += 1
    received.append({"headers": dict(request.headers), "body": json.loads(await request.body() or b"null")})
    if MODE == "status503" or (MODE == "fail_twice_then_trickle" and calls["generate"] <= 2):
        return JSONResponse({"error": {"message": "overloaded", "type": "service_unavailable"}}, status_code=503)
    if MODE in ("status500", "status429"):
        status = int(MODE.removeprefix("status"))
        return JSONResponse({"error": {"message": f"status {status}", "type": "server_error"}}, status_code=status)
    if MODE == "error_before_token":
        return StreamingResponse(iter([event({"error": {"message": "engine failed", "type": "server_error",
                                                         "code": 500}})]), media_type="text/event-stream")
    if MODE == "tool_call":
        return StreamingResponse(iter(tool_call_chunks()), media_type="text/event-stream")
    if MODE == "logprobs_die_mid_stream":
        body = received[-1]["body"]
        return StreamingResponse(logprob_chunks(request.url.path.endswith("chat/completions"), body["prompt"]
                                                if "prompt" in body else None), media_type="text/event-stream")
    if MODE == "finish_without_usage":
        return StreamingResponse(iter([token("hi"), token(" there", "stop")]), media_type="text/event-stream")
    if MODE == "hang":
        await asyncio.sleep(3600)
    if MODE in ("answer", "slow", "hold") or (MODE == "hang_first" and calls["generate"] > 1):
        return StreamingResponse(one_token_answer(), media_type="text/event-stream")
    if MODE in ("trickle", "stall_mid_stream", "fail_twice_then_trickle"):
        return StreamingResponse(tokens(), media_type="text/event-stream")

    async def nothing():
        try:
            await asyncio.sleep(3600)
        except BaseException:  # the gateway went away
            calls["cancelled"] += 1
            raise
        yield b""

    return StreamingResponse(nothing(), media_type="text/event-stream")


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
                                   **payload}).encode() + b"\n\n"


def token(text: str, finish_reason: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]})


async def one_token_answer():
    if MODE == "slow":
        await asyncio.sleep(SLOW_FIRST_TOKEN_S)
    if MODE == "hold":
        yield token("hi")
        await asyncio.sleep(HOLD_S)
        yield token("", "length")
    else:
        yield token("hi", "length")
    yield event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
    yield b"data: [DONE]\n\n"


def tool_call_chunks() -> list[bytes]:
    def chunk(delta: dict, finish_reason: str | None = None, logprob: float | None = None) -> bytes:
        logprobs = None if logprob is None else {"content": [{"token": "x", "logprob": logprob, "top_logprobs": []}]}
        return event({"object": "chat.completion.chunk",
                      "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]})

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    return [chunk({"role": "assistant", "content": ""}),
            chunk({"tool_calls": [call]}, logprob=-0.5),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, logprob=-0.25),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, logprob=-0.125),
            chunk({}, "tool_calls"),
            event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}),
            b"data: [DONE]\n\n"]


async def logprob_chunks(chat: bool, prompt):
    """Two tokens and a dropped connection, or (a continuation: a token-id prompt) two tokens to the end."""
    def chunk(text: str, token_id: int, finish_reason: str | None = None, **extra) -> bytes:
        logprob = -0.25 * (token_id - 64)
        if chat:
            logprobs = {"content": [{"token": text, "logprob": logprob, "bytes": list(text.encode()),
                                     "top_logprobs": [{"token": text, "logprob": logprob, "bytes": list(text.encode())}]}]}
            choice = {"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish_reason,
                      "token_ids": [token_id]}
            return event({"object": "chat.completion.chunk", "choices": [choice], **extra})
        logprobs = {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [{text: logprob, "Z": -9.0}],
                    "text_offset": [token_id - 67 if isinstance(prompt, list) else token_id - 65]}
        return event({"choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                                   "token_ids": [token_id], **extra}]})

    if isinstance(prompt, list):  # the continuation
        yield chunk("C", 67)
        yield chunk("D", 68, "length")
        yield event({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 2,
                                              "total_tokens": len(prompt) + 2}})
        yield b"data: [DONE]\n\n"
        return
    if chat:
        yield event({"object": "chat.completion.chunk", "prompt_token_ids": [1, 2, 3],
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]})
        yield chunk("A", 65)
    else:
        yield chunk("A", 65, prompt_token_ids=[1, 2, 3])
    yield chunk("B", 66)
    await asyncio.sleep(0.05)
    raise RuntimeError("the worker dies mid-stream")  # uvicorn drops the connection


async def tokens():
    try:
        for i in range(2 if MODE == "stall_mid_stream" else 600):
            yield token(f" t{i}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(3600)
    except BaseException:  # the client went away: Starlette cancels the stream
        calls["cancelled"] += 1
        raise


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def stats(request: Request) -> Response:
    return JSONResponse(calls)


async def requests_received(request: Request) -> Response:
    return JSONResponse(received)


app = Starlette(routes=[Route("/v1/chat/completions", generate, methods=["POST"]),
                        Route("/v1/completions", generate, methods=["POST"]),
                        Route("/health", health), Route("/calls", stats), Route("/requests", requests_received)])

if __name__ == "__main__":
    # a hanging handler would hold a stop until the test kills it (10 s): it is cancelled after 1 s
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_graceful_shutdown=1)
