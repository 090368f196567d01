"""A completions request whose prompt is a batch (a list of texts, or of token-id lists): each prompt
is served as a request of its own by the completions endpoint (admitted against the tenant's limits,
routed to the worker most likely to hold its prefix, retried and failed over alone, counted and billed
alone) and the answers are merged into the one answer OpenAI's API gives for a batch: prompt i's n
choices at indexes i*n to i*n + n - 1, usage summed, one id.

All or nothing until the answer starts: if a prompt is refused or fails before its first token, the
others are told their client left (each ends as 499) and the client gets that prompt's error, its
message naming the prompt. A streamed batch starts once every prompt's stream has started; chunks then
go out as they come, rewritten to the batch's id and index. A prompt whose worker fails mid-answer and
cannot be continued ends its part with the error event it would have streamed alone; the others go on.
A batch still running when a stopping gateway's grace runs out ends as each of its prompts then does
(gateway/shutdown.py): a 503 before the answer starts, else each prompt's error event in the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from gateway.shutdown import Shutdown, shutdown_error
from gateway.sse import DONE, SseParser, compact_json, encode_event
from kvgate.api_error import ApiError
from kvgate.json_body import dump_json

MAX_BATCH_PROMPTS = 128  # prompts in one completions request; each is a request of its own here
# a batch's prompts in flight at once (fewer where the tenant's max_concurrency is lower): the rest wait
# their turn in the batch, not in the pool's queue, whose waits are bounded (a batch larger than what the
# pool takes at once still completes) and which other tenants' requests share
MAX_BATCH_IN_FLIGHT = 16
_ERROR_HEADERS = (b"content-type", b"retry-after")  # a failed part's, passed on with its answer


def batch_prompts(prompt: Any) -> list[Any] | None:
    """The prompts of a batch (a list of two or more texts or token-id lists), else None (one prompt,
    or a batch of one, which the endpoint serves as it is). 400 for a batch over MAX_BATCH_PROMPTS or
    one with an element that is neither."""
    if not isinstance(prompt, list) or len(prompt) < 2 or not isinstance(prompt[0], (str, list)):
        return None
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise ApiError(400, f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    for index, item in enumerate(prompt):
        if not isinstance(item, (str, list)):
            raise ApiError(400, f"prompt[{index}] must be a string or a list of token ids", param="prompt")
    return prompt


class _Part:
    """One prompt's request: what its endpoint sent, as it came."""

    __slots__ = ("index", "status", "headers", "messages", "ended", "parser", "record")

    def __init__(self, index: int, logged: bool) -> None:
        self.index = index
        self.record: dict[str, Any] | None = {} if logged else None  # its log fields, in the batch's line
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.messages: list[Message] = []  # body messages not yet taken
        self.ended = False
        self.parser = SseParser()

    def body(self) -> bytes:
        return b"".join(message.get("body", b"") for message in self.messages)


class Batch:
    """One batched request across its prompts' requests. run() answers the client, once."""

    def __init__(self, endpoint: Callable[[Scope, Receive, Send], Awaitable[None]], scope: Scope, body: dict[str, Any],
                 prompts: list[Any], tenant_in_flight: int | None = None, shutdown: Shutdown | None = None) -> None:
        """tenant_in_flight: the tenant's requests allowed at once, if limited (the batch keeps under it);
        shutdown: the endpoint's, whose cancellation of the batch ends its prompts as it ends requests."""
        self.endpoint = endpoint
        self.shutdown = shutdown or Shutdown()
        self.scope = scope
        self.body = body
        self.prompts = prompts
        self.n = body.get("n") or 1
        self.stream = bool(body.get("stream"))
        self.include_usage = self.stream and bool((body.get("stream_options") or {}).get("include_usage"))
        self.record = scope.get("state", {}).get("log")  # the batch's log line (None: not logged)
        self.parts = [_Part(index, self.record is not None) for index in range(len(prompts))]
        self.events: asyncio.Queue[tuple[_Part, Message]] = asyncio.Queue()
        self.abort = asyncio.Event()  # set: every part's client is gone (the batch's left, or failed)
        self.slots = asyncio.Semaphore(min(MAX_BATCH_IN_FLIGHT, tenant_in_flight or MAX_BATCH_IN_FLIGHT))
        self.usage: dict[str, int] = {}
        self.cached_tokens = 0
        self.envelope: dict[str, Any] | None = None  # the batch's id, object, created and model: the first chunk's

    async def run(self, receive: Receive, send: Send) -> None:
        tasks = [asyncio.create_task(self._serve(part)) for part in self.parts]
        watcher = asyncio.create_task(self._watch(receive))
        answer = asyncio.ensure_future(self._answer(send))
        try:
            try:
                await asyncio.shield(answer)
            except asyncio.CancelledError:
                if not self.shutdown.started:
                    answer.cancel()
                    raise
                # the server's grace ran out: each prompt ends as a request of its own then does, and the
                # batch answers from what they sent, as ever
                asyncio.current_task().uncancel()
                if not answer.done():
                    for task in tasks:
                        task.cancel()
                await answer
        finally:
            self.abort.set()  # parts still running (an error, or the client left) end as their client gone
            watcher.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.record is not None:
                self.record["prompts"] = [part.record for part in self.parts]

    async def _answer(self, send: Send) -> None:
        failed = await self._wait_started()
        if failed is not None:
            self.abort.set()
            await self._send_error(failed, send)
        elif self.stream:
            await self._stream(send)
        else:
            await self._collect(send)

    # -- the parts ---------------------------------------------------------------------------

    async def _serve(self, part: _Part) -> None:
        """The prompt's request through the endpoint, its messages onto the batch's queue."""
        body = {**self.body, "prompt": self.prompts[part.index]}
        if self.stream:  # each part's usage, to sum: the client gets the sum if it asked for usage
            body["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
        state = self.scope.get("state", {})
        scope = {**self.scope, "state": {"tenant": state.get("tenant", "anonymous"), "batch_part": part.index,
                                         "request_id": f"{state.get('request_id', '')}-{part.index}",
                                         "trace_headers": state.get("trace_headers", {}),
                                         "body": dump_json(body)}}
        if part.record is not None:
            scope["state"]["log"] = part.record

        async def receive() -> Message:  # the body is in state; then only a client that leaves
            await self.abort.wait()
            return {"type": "http.disconnect"}

        answered = False

        async def send(message: Message) -> None:
            nonlocal answered
            answered = message["type"] == "http.response.body" and not message.get("more_body", False)
            self.events.put_nowait((part, message))

        try:
            async with self.slots:
                if not self.abort.is_set():  # else the batch has ended: this prompt is not sent
                    await self.endpoint(scope, receive, send)  # (which answers a shutdown's cancellation itself)
        except asyncio.CancelledError:  # while waiting its turn
            if not self.shutdown.started:
                raise
            await shutdown_error().response()(scope, receive, send)
        finally:
            if not answered:  # ended without a whole answer (a bug the endpoint did not catch)
                self.events.put_nowait((part, {"type": "http.response.body", "body": b"", "more_body": False}))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.abort.set()

    async def _next(self) -> tuple[_Part, Message]:
        part, message = await self.events.get()
        if message["type"] == "http.response.start":
            part.status = message["status"]
            part.headers = dict(message.get("headers", []))
        else:
            part.ended = part.ended or not message.get("more_body", False)
            if part.status is None:  # a body before any start: the endpoint failed past its own handlers
                part.status = 500
        return part, message

    async def _wait_started(self) -> _Part | None:
        """Wait until every part's answer has started: None when all are 200, else the first part seen
        to fail, once its answer is whole."""
        while any(part.status is None for part in self.parts):
            part, message = await self._next()
            if message["type"] == "http.response.body":
                part.messages.append(message)
            if part.status not in (None, 200):
                while not part.ended:
                    other, message = await self._next()
                    if message["type"] == "http.response.body":
                        other.messages.append(message)
                return part
        return None

    # -- answers -----------------------------------------------------------------------------

    async def _send_error(self, part: _Part, send: Send) -> None:
        content = part.body()
        try:
            error = orjson.loads(content)
            error["error"]["message"] = f"prompt {part.index}: {error['error']['message']}"
            error["error"]["param"] = error["error"].get("param") or "prompt"
            content = compact_json(error)
        except (ValueError, TypeError, KeyError):
            pass  # not an OpenAI error object: passed on as it came
        headers = [(name, part.headers[name]) for name in _ERROR_HEADERS if name in part.headers]
        await send({"type": "http.response.start", "status": part.status,
                    "headers": [*headers, (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})

    def _batch_headers(self) -> list[tuple[bytes, bytes]]:
        """Which worker and pool started each prompt's answer, in prompt order; a collected batch's failovers,
        all its prompts' (a stream's are known only as it ends, as for one prompt)."""
        headers = [(name, b",".join(part.headers.get(name, b"-") for part in self.parts))
                   for name in (b"x-kvgate-worker", b"x-kvgate-pool")]
        if not self.stream:
            failovers = sum(int(part.headers.get(b"x-kvgate-failovers", b"0")) for part in self.parts)
            headers.append((b"x-kvgate-failovers", str(failovers).encode()))
        return headers

    async def _collect(self, send: Send) -> None:
        while not all(part.ended for part in self.parts):
            part, message = await self._next()
            part.messages.append(message)
        answers = [orjson.loads(part.body()) for part in self.parts]
        choices = []
        for part, answer in zip(self.parts, answers):
            for choice in answer.get("choices") or ():
                choices.append({**choice, "index": part.index * self.n + (choice.get("index") or 0)})
            self._add_usage(answer.get("usage"))
        first = answers[0]
        merged = {key: first[key] for key in ("id", "object", "created", "model", "system_fingerprint") if key in first}
        merged["choices"] = choices
        merged["usage"] = self._summed_usage()
        content = compact_json(merged)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                                *self._batch_headers()]})
        await send({"type": "http.response.body", "body": content})

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8"),
                                *self._batch_headers()]})
        for part in self.parts:  # what came while the others started
            for message in part.messages:
                await self._forward(part, message, send)
            part.messages.clear()
        while not all(part.ended for part in self.parts):
            part, message = await self._next()
            await self._forward(part, message, send)
        last = [encode_event({**(self.envelope or {}), "choices": [], "usage": self._summed_usage()})
                ] if self.include_usage else []
        await send({"type": "http.response.body", "body": b"".join([*last, DONE]), "more_body": False})

    async def _forward(self, part: _Part, message: Message, send: Send) -> None:
        """A part's events, as the batch's: choices re-indexed and under the batch's id; its usage kept
        for the sum, its [DONE] dropped; an error event passed on as it came."""
        out = []
        for event in part.parser.feed(message.get("body", b"")):
            payload = event.payload
            if payload is None or "error" in payload:
                if not event.is_done:
                    out.append(event.raw)
                continue
            choices = payload.get("choices")
            if not choices:  # the part's usage chunk (a chunk with choices may carry a running count: not summed)
                self._add_usage(payload.get("usage"))
                continue
            if self.envelope is None:
                self.envelope = {key: payload[key] for key in ("id", "object", "created", "model") if key in payload}
            payload.pop("usage", None)
            payload.update(self.envelope)
            payload["choices"] = [{**choice, "index": part.index * self.n + (choice.get("index") or 0)}
                                  for choice in choices]
            out.append(encode_event(payload))
        if out:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})

    def _add_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            self.usage[key] = self.usage.get(key, 0) + int(usage.get(key) or 0)
        self.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def _summed_usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.usage.get("prompt_tokens", 0),
                "completion_tokens": self.usage.get("completion_tokens", 0),
                "total_tokens": self.usage.get("total_tokens", 0),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
