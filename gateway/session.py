"""One client request across upstream attempts: retries before the first byte, failover after.

Before anything reaches the client, a failed attempt is retried on the next ranked candidate
(within max_retries and the pool's retry budget, with full-jitter backoff). After the stream
has started, a worker that dies or stalls is replaced mid-answer: the next worker gets the
prompt's token ids and those generated so far as a completions prompt (workers are asked for them;
a chat's are its rendered conversation), or, from a worker that gives no ids, the prompt plus the
text already delivered (completions: appended to the prompt; chat: a partial assistant message
with continue_final_message), with max_tokens reduced by what was delivered; its chunks are
rewritten to carry the first stream's id (a chat's as chat chunks), so the client sees one stream (a tool
call half streamed is not continued, nor an answer of n > 1 choices: it ends with an error). A
non-streaming answer is assembled from the stream, choice by choice: text, tool calls and logprobs.
Usage is the worker's, or counted from what was streamed when none came.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, Tracer
from gateway.admission import Permit
from gateway.chunks import NOT_GIVEN, ChoiceParts, ToolCalls, carries_token_ids, chat_logprobs, merge_logprobs
from gateway.continuation import text_continuation, token_id_continuation
from gateway.errors import UpstreamError
from gateway.fleet import Fleet
from gateway.loop_metrics import HistogramChild
from gateway.metrics import GatewayMetrics
from gateway.sse import DONE, SseEvent, encode_event
from gateway.telemetry import end_attempt_span, start_attempt_span, step_span
from gateway.upstream import Attempt, open_attempt, read_events, wait_first_progress
from gateway.upstream_http import UpstreamClient
from kvgate.api_error import ApiError
from kvgate.config import UpstreamConfig
from kvgate.json_body import dump_json
from kvgate.offload import Offloader
from router.ticket import RouteTicket
from router.tokenization import RoutingTokenizer

Write = Callable[[bytes, bool], Awaitable[None]]  # (data, more_body): a piece of the client's stream

BACKOFF_BASE_S = 0.025
BACKOFF_CAP_S = 0.5
_ROLE_FIELDS = frozenset(("role", "content"))  # a delta of these alone, without text, announces the role


def full_jitter_backoff_s(retry: int, rng: random.Random) -> float:
    """AWS "Full Jitter": uniform(0, min(cap, base * 2^retry))."""
    return rng.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** retry))


@dataclass(slots=True)
class ProxyRequest:
    """What the handler learned about the client's request."""

    kind: str  # "chat" or "completion"
    path: str
    body: dict[str, Any]
    model: str
    pool: str
    tenant: str
    request_id: str
    headers: dict[str, str]
    client_stream: bool
    client_include_usage: bool
    body_bytes: int = 0  # the client's body size: a larger one is encoded off the event loop
    started_s: float = field(default_factory=time.monotonic)
    state: dict[str, Any] = field(default_factory=dict)  # the ASGI scope's: its SERVER span and log record


@dataclass(slots=True, kw_only=True, eq=False)
class Session:
    """One request's answer, across its upstream attempts. Its collaborators are what a request
    touches: the routing ticket (candidates, predictions, load), its admission permit (deadline;
    retries and failovers spend the pool's retry budget through it), the fleet (who is in rotation;
    breakers and slow-worker ejection hear each attempt's outcome), the upstream client and its
    timeouts, the metrics, and the model's tokenizer (None when only an approximate one is known)
    for continuing after a failover; offload encodes a large body off the event loop. The ticket ends exactly once: in
    start() when no attempt could begin the answer, else in end(), which the caller runs once the
    client has its answer from stream() or collect()."""

    req: ProxyRequest
    ticket: RouteTicket
    fleet: Fleet
    upstream: UpstreamClient
    settings: UpstreamConfig
    permit: Permit
    metrics: GatewayMetrics
    tokenizer: RoutingTokenizer | None
    rng: random.Random
    offload: Offloader
    tracer: Tracer | None = None  # spans per attempt and failover (gateway/telemetry.py); None: tracing off
    n: int = 1  # the answer's choices (OpenAI's n); the fields below are the first's, more_choices the others'
    # what happened so far
    tried: list[str] = field(default_factory=list)
    attempt: Attempt | None = None
    text_parts: list[str] = field(default_factory=list)  # the answer's text as it came (see `text`)
    finish_reason: str | None = None
    stop_reason: Any = NOT_GIVEN  # the worker's stop_reason (vLLM's: a stop string or token id, or null), if given
    usage: dict[str, Any] | None = None
    usage_raw: bytes | None = None
    first_payload: dict[str, Any] | None = None
    failovers: int = 0
    role_sent: bool = False
    done: bool = False
    first_token_s: float | None = None
    last_token_s: float | None = None
    itl: HistogramChild | None = None  # the model's inter-token latency series, from the first token on
    delivered_tokens_at_failover: int = 0
    text_offset_base: int = 0  # characters of the answer before the last failover (a continuation counts from 0)
    next_text_offset: int | None = None  # where a completion's next token starts, as its logprobs count (if any)
    token_ids: list[int] = field(default_factory=list)  # generated so far (return_token_ids)
    prompt_token_ids: list[int] | None = None  # the prompt as the first worker tokenized (chat: rendered) it
    tool_calls: ToolCalls = field(default_factory=ToolCalls)  # streamed tool-call deltas, folded
    logprobs: dict[str, Any] | None = None  # the choice's logprobs, concatenated across chunks (collect() only)
    num_token_chunks: int = 0  # chunks that carried text or a tool call (about a token each), every choice's
    more_choices: dict[int, ChoiceParts] = field(default_factory=dict)  # by index, from 1 (n > 1)
    end_reason: str | None = None  # why the answer stopped short, when it did
    error_status: int | None = None  # the status of the error the answer ended with
    ended: bool = False
    answer_sent: bool = False  # stream(): the last write is out
    recorded: bool = False  # the endpoint has recorded its outcome (metrics, permit)
    attempt_span: Span | None = None  # the current attempt's CLIENT span, while tracing is on

    # -- before the first byte ---------------------------------------------------------------

    async def start(self) -> list[SseEvent]:
        """Open the stream on the best candidate that answers; events held so far are returned.

        Raises UpstreamError for a non-retryable worker answer (the client gets it as is) and
        ApiError when no worker could take the request; the ticket has failed then.
        """
        try:
            return await self._open_with_retries(await self._payload(self.req.body), first=True)
        except ApiError as error:  # no worker took it, or its deadline passed first
            self.ticket.failed(error.code or "upstream_unavailable")
            raise
        except UpstreamError:
            self.ticket.failed("refused")
            raise
        except BaseException:  # cancelled: the client went away
            self.ticket.failed("client_gone")
            raise

    async def _open_with_retries(self, payload: bytes, first: bool, path: str | None = None) -> list[SseEvent]:
        last_error: UpstreamError | None = None
        for attempt_no in range(self.settings.max_retries + 1):
            worker_id = self._next_candidate()
            if worker_id is None:
                break
            if self.permit.deadline_passed():  # nothing goes upstream after the request's deadline
                raise ApiError(503, "the request's deadline passed before a worker could take it",
                               "service_unavailable", code="deadline_exceeded", retry_after_s=1)
            if attempt_no > 0 or not first:
                if not self.permit.retry_allowed():
                    self.metrics.budget_refusals.labels(pool=self.req.pool).inc()
                    break
                self.metrics.retries.labels(pool=self.req.pool).inc()
                await asyncio.sleep(full_jitter_backoff_s(attempt_no, self.rng))
            try:
                return await self._try(worker_id, payload, path or self.req.path)
            except UpstreamError as error:
                if not error.retryable:
                    raise
                last_error = error
        reason = f" (last error: {last_error})" if last_error else ""
        raise ApiError(503, f"no worker could serve the request{reason}", "service_unavailable",
                       code="upstream_unavailable", retry_after_s=1)

    def _next_candidate(self) -> str | None:
        for worker_id in self.ticket.candidates:
            if worker_id not in self.tried and self.fleet.available(worker_id):
                return worker_id
        return None

    async def _try(self, worker_id: str, payload: bytes, path: str) -> list[SseEvent]:
        worker = self.fleet.workers[worker_id]
        self.tried.append(worker_id)
        worker.breaker.begin_attempt()
        self.ticket.dispatched(worker_id)
        attempt = None
        up = self.settings
        span, headers = None, self.req.headers
        if self.tracer is not None:
            span, headers = start_attempt_span(self.tracer, self.req.kind, self.req.model, worker_id, worker.url,
                                               len(self.tried), self.failovers, headers)
        try:
            attempt = await open_attempt(self.upstream, worker_id, worker.url + path, payload, headers,
                                         up.connect_timeout_s, up.first_byte_timeout_s, up.idle_timeout_s)
            held = await wait_first_progress(attempt, up.first_byte_timeout_s)
        except BaseException as error:  # refused, failed, or cancelled (the client left): the worker did not serve it
            if span is not None:
                end_attempt_span(span, error.kind if isinstance(error, UpstreamError) else "client_gone")
            self.ticket.attempt_failed()
            healthy = error.worker_healthy if isinstance(error, UpstreamError) else None
            if healthy is None:  # back-pressure, or the client left: no outcome; a half-open trial may go again
                worker.breaker.end_attempt()
            else:
                self.fleet.record_attempt(worker_id, ok=healthy)
            if attempt is not None:
                await asyncio.shield(attempt.close())
            raise
        attempt.expected_first_byte_s = self.ticket.first_token()
        self.attempt = attempt
        self.attempt_span = span
        return held

    async def _payload(self, body: dict[str, Any]) -> bytes:
        """The upstream body, encoded once for all its attempts (off the event loop when large)."""
        return await self.offload.run_yielding(self.req.body_bytes, dump_json, self._upstream_body(body))

    def _upstream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """Always stream from the worker (timeouts, failover and usage work the same for both), with
        the token ids it generates (a failover continues from them exactly)."""
        upstream = dict(body)
        upstream["stream"] = True
        upstream["return_token_ids"] = True
        options = dict(body.get("stream_options") or {}) if body.get("stream") else {}
        options["include_usage"] = True
        upstream["stream_options"] = options
        return upstream

    # -- after the first byte ----------------------------------------------------------------

    async def stream(self, held: list[SseEvent], write: Write) -> None:
        """Send the answer to the client: write(data, more_body) once per upstream read, with the
        client's events of that read as they came (rewritten after a failover); the last write
        carries the usage, [DONE] and more_body=False. end() is the caller's, once the client has it."""
        try:
            last = await self._run(held, write)
        except ApiError as error:  # no worker could continue: end the stream with an error
            self.error_status = error.status
            last = [encode_event(error.body())]
        last.append(DONE)
        await write(b"".join(last), False)
        self.answer_sent = True

    async def collect(self, held: list[SseEvent]) -> dict[str, Any]:
        """Run to the end and build a non-streaming OpenAI response (end() is the caller's, once the
        client has it)."""
        await self._run(held, None)
        return self._full_response()

    async def end(self) -> None:
        """End the ticket and close the last attempt, once: after stream() or collect(), however
        they ended (also for a stream that was never read). A client that went away is no fault of
        the worker: its attempt records no outcome then."""
        if self.ended:
            return
        self.ended = True
        if self.done or self.finish_reason is not None:
            self.ticket.finished(self.usage)
        else:
            self.ticket.failed(self.end_reason or "client_gone")
        # An attempt still open here was answering (upstream failures fail over, closing theirs): the
        # worker served what it was asked until the answer ended, its client left, or the gateway
        # failed on its own. Its breaker hears a success, so a half-open trial always ends.
        await self._close_attempt(ok=True)

    async def _run(self, held: list[SseEvent], write: Write | None) -> list[bytes]:
        """Read the answer to its end, across failovers. With write (a streaming client), each
        upstream read's events for the client are written at once, as one piece; the last read's
        are returned unwritten, with the usage event the client asked for. Without write, nothing
        is encoded for the client (collect() builds its answer from what _process() keeps)."""
        pending = held
        up = self.settings
        while True:
            out: list[bytes] = []
            try:
                for event in pending:
                    if self._process(event) and write is not None:
                        out.append(self._for_client(event))
                if self.done:
                    break
                if out:
                    await write(b"".join(out) if len(out) > 1 else out[0], True)
                    out = []
                assert self.attempt is not None
                pending = await read_events(self.attempt, up.idle_timeout_s)
                if self.attempt.eof:
                    raise UpstreamError("protocol", "stream ended before it finished")
            except UpstreamError as error:
                if self._every_choice_finished():  # only the trailer was lost
                    self.done = True
                    break
                if out:  # what this read gave before its error event reaches the client first
                    await write(b"".join(out), True)
                pending = await self._failover(error)
        if write is not None and self.req.client_include_usage:
            usage = self.final_usage()
            if usage is not None:
                out.append(self.usage_raw if (self.failovers == 0 and self.usage_raw) else encode_event(
                    {**self._envelope(), "choices": [], "usage": usage}))
        return out

    def _process(self, event: SseEvent) -> bool:
        """Take in one upstream event; True if the client sees it (as _for_client writes it). Runs for
        every token: each field is read once."""
        payload = event.payload
        if payload is None:
            if event.is_done:
                self.done = True
            return False
        if "error" in payload:
            raise UpstreamError("protocol", f"worker reported an error mid-stream: {payload['error']}")
        usage = payload.get("usage")
        if usage:
            self.usage = usage
        choices = payload.get("choices")
        if not choices:
            if usage:
                self.usage_raw = event.raw
            return False
        choice = choices[0]
        if self.first_payload is None:
            self.first_payload = payload
            # the prompt as the worker tokenized it: a chat's first chunk carries it, a completion's choice
            self.prompt_token_ids = payload.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if self.n > 1 and choice.get("index"):
            self._take_further_choice(choice)
            return True
        token_ids = choice.get("token_ids")
        if token_ids:
            self.token_ids.extend(token_ids)
        finish_reason = choice.get("finish_reason")
        delta = choice.get("delta")
        if delta is None:
            text, tool_calls = choice.get("text"), None
        else:
            text = delta.get("content") if delta else None
            tool_calls = delta.get("tool_calls") if delta else None
            if not text and not token_ids and finish_reason is None and set(delta) <= _ROLE_FIELDS:
                if self.role_sent:
                    return False  # a continuation's role announcement
                self.role_sent = True
        if finish_reason is not None:
            self.finish_reason = finish_reason
            self.stop_reason = choice.get("stop_reason", NOT_GIVEN)  # vLLM's: the stop string or token id
        if text or tool_calls:
            self._mark_token()
            if text:
                self.text_parts.append(text)
            self.num_token_chunks += 1
            if tool_calls:
                self.tool_calls.add(tool_calls)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if self.failovers:
                logprobs = choice["logprobs"] = self._continued_logprobs(logprobs)
            offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
            if offsets and tokens and isinstance(offsets[-1], int) and isinstance(tokens[-1], str):
                self.next_text_offset = offsets[-1] + len(tokens[-1])
            if not self.req.client_stream:  # a stream's client has them chunk by chunk: only an assembled answer keeps them
                self.logprobs = merge_logprobs(self.logprobs, logprobs)
        return True

    def _take_further_choice(self, choice: dict[str, Any]) -> None:
        """A chunk of a choice beyond the first (n > 1): its parts are kept apart, for the whole answer."""
        parts = self.more_choices.get(choice["index"])
        if parts is None:
            parts = self.more_choices[choice["index"]] = ChoiceParts()
        token_ids = choice.get("token_ids")
        if token_ids:
            parts.token_ids.extend(token_ids)
        if choice.get("finish_reason") is not None:
            parts.finish_reason = choice["finish_reason"]
            parts.stop_reason = choice.get("stop_reason", NOT_GIVEN)
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else (delta or {}).get("content")
        tool_calls = None if delta is None else (delta or {}).get("tool_calls")
        if text:
            parts.text_parts.append(text)
        if tool_calls:
            parts.tool_calls.add(tool_calls)
        if (text or tool_calls) and self.first_token_s is None:  # the answer's first token, whichever choice's
            self._mark_token()
        self.num_token_chunks += bool(text or tool_calls)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and not self.req.client_stream:
            parts.logprobs = merge_logprobs(parts.logprobs, logprobs)

    def _every_choice_finished(self) -> bool:
        if self.finish_reason is None:
            return False
        return self.n == 1 or all(self.more_choices.get(index) is not None
                                  and self.more_choices[index].finish_reason is not None for index in range(1, self.n))

    @property
    def text(self) -> str:
        """The answer's text so far. Kept as the chunks' pieces and joined when read (at a failover,
        at the end): appending to one string each chunk copies it each time, a cost that grows with
        the square of a long answer."""
        parts = self.text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def _continued_logprobs(self, logprobs: dict[str, Any]) -> dict[str, Any]:
        """A continuation's logprobs as the client's answer has them: a chat's as a chat's (it went on
        through completions), completions' text offsets counted from the start of the whole answer."""
        if self.req.kind == "chat" and "content" not in logprobs:
            return chat_logprobs(logprobs, int(self.req.body.get("top_logprobs") or 0))
        if isinstance(logprobs.get("text_offset"), list):
            return {**logprobs, "text_offset": [offset + self.text_offset_base for offset in logprobs["text_offset"]]}
        return logprobs

    def _for_client(self, event: SseEvent) -> bytes:
        """The event as the client sees it: as the worker sent it, unless the gateway asked for token
        ids the client did not (they go), or a failover changed the stream (its chunks carry the first
        stream's id; a chat continued through the completions endpoint is shown as chat chunks)."""
        wants_ids = bool(self.req.body.get("return_token_ids"))
        if self.failovers == 0:
            payload = event.payload or {}
            if wants_ids or not carries_token_ids(payload):
                return event.raw
            # the chunk was parsed for this request alone, and nothing reads its token ids after this
            payload.pop("prompt_token_ids", None)
            payload["choices"] = [self._client_choice(c, False, copy=False) for c in payload.get("choices") or ()]
            return encode_event(payload)
        payload = dict(event.payload or {})
        if self.failovers:
            payload.update(self._envelope())
            payload.pop("usage", None)
        choices = [self._client_choice(c, wants_ids) for c in payload.get("choices") or ()]
        if not wants_ids or self.failovers:
            payload.pop("prompt_token_ids", None)
        return encode_event({**payload, "choices": choices})

    def _client_choice(self, choice: dict[str, Any], wants_ids: bool, copy: bool = True) -> dict[str, Any]:
        if copy:
            choice = dict(choice)
        if not wants_ids:
            choice.pop("token_ids", None)
        if not wants_ids or self.failovers:  # a continuation's prompt is not the client's
            choice.pop("prompt_token_ids", None)
        if self.req.kind == "chat" and "delta" not in choice:  # a completions chunk continuing a chat
            choice = {"index": choice.get("index", 0), "delta": {"content": choice.pop("text", "")},
                      "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason"),
                      **({"stop_reason": choice["stop_reason"]} if "stop_reason" in choice else {}),
                      **({"token_ids": choice["token_ids"]} if wants_ids and "token_ids" in choice else {})}
        return choice

    def _mark_token(self) -> None:
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
            metrics, model = self.metrics, self.req.model
            metrics.child(metrics.ttft, model, self.req.pool).observe(now - self.req.started_s)
            self.itl = metrics.child(metrics.itl, model, self.req.pool)
        else:
            self.itl.observe(now - (self.last_token_s or now))
        self.last_token_s = now

    def _envelope(self) -> dict[str, Any]:
        first = self.first_payload or {}
        return {key: first[key] for key in ("id", "object", "created", "model") if key in first}

    # -- failover ----------------------------------------------------------------------------

    async def _failover(self, error: UpstreamError) -> list[SseEvent]:
        failed_worker = self.attempt.worker_id if self.attempt is not None else None
        with step_span(self.tracer, "failover", {"kvgate.failed_worker": failed_worker or "",
                                                 "kvgate.error": error.kind}):
            return await self._continue_elsewhere(error)

    async def _continue_elsewhere(self, error: UpstreamError) -> list[SseEvent]:
        await self._close_attempt(ok=False, outcome=error.kind)
        self.ticket.attempt_failed()
        if self.tool_calls:  # a call half streamed cannot be continued as text by another worker
            self.end_reason = "failover_failed"
            raise ApiError(502, f"worker failed mid-stream ({error}) during a tool call, which cannot be continued "
                           "on another worker", "upstream_error", code="failover_failed")
        if self.n > 1:  # one continuation goes on one answer; n of them cannot be told apart in one
            self.end_reason = "failover_failed"
            raise ApiError(502, f"worker failed mid-stream ({error}) with {self.n} choices (n), which cannot be "
                           "continued on another worker", "upstream_error", code="failover_failed")
        self.failovers += 1
        # the continuation's offsets go on from the last token's end as the worker counted it (a token's own
        # decoded text: not always the answer's characters, where the tokenizer joins tokens with spaces)
        self.text_offset_base = self.next_text_offset if self.next_text_offset is not None else len(self.text)
        path, body, mode = self._continuation()
        self.metrics.failovers.labels(pool=self.req.pool, mode=mode).inc()
        if body is None:  # the answer had already used its whole max_tokens
            self.finish_reason, self.done = "length", True
            return [SseEvent(b"", b"", self._synthetic_finish("length"))]
        self.usage, self.usage_raw = None, None
        try:
            return await self._open_with_retries(await self._payload(body), first=False, path=path)
        except ApiError:
            self.end_reason = "failover_failed"
            raise
        except UpstreamError as failed:
            self.end_reason = "failover_failed"
            raise ApiError(502, f"worker failed mid-stream ({error}) and the continuation failed: {failed}",
                           "upstream_error", code="failover_failed") from None

    def _continuation(self) -> tuple[str, dict[str, Any] | None, str]:
        """(path, body, mode) of the request that continues the answer on another worker (body None:
        nothing is left to generate). From token ids where the worker gave them ("token_ids": the
        prompt's ids and the generated ids as a completions prompt, so greedy output goes on token
        for token, a chat included, its template already applied in its prompt's ids); else from
        the delivered text ("text": it may not re-tokenize to the same ids)."""
        if self.prompt_token_ids is not None and self.token_ids:
            self.delivered_tokens_at_failover = len(self.token_ids)
            body = token_id_continuation(self.req.kind, self.req.body, self.prompt_token_ids + self.token_ids,
                                         len(self.token_ids))
            return "/v1/completions", body, "token_ids"
        delivered = self._count_tokens(self.text)
        self.delivered_tokens_at_failover = delivered
        encode = self.tokenizer.encode_text if self.tokenizer is not None else None
        return self.req.path, text_continuation(self.req.kind, self.req.body, self.text, delivered, encode), "text"

    def _count_tokens(self, text: str) -> int:
        """Tokens in generated text, with the model's tokenizer (else ~4 bytes a token)."""
        if self.tokenizer is None:
            return max(1, len(text.encode()) // 4) if text else 0
        return len(self.tokenizer.encode_text(text))

    def _synthetic_finish(self, reason: str) -> dict[str, Any]:
        choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
                                  if self.req.kind == "chat" else
                                  {"index": 0, "text": "", "logprobs": None, "finish_reason": reason})
        return {**self._envelope(), "choices": [choice]}

    async def _close_attempt(self, ok: bool, outcome: str = "failed") -> None:
        """Close the current upstream stream and record its outcome (outcome: why it failed, when not ok)."""
        attempt = self.attempt
        if attempt is None:
            return
        self.attempt = None
        span, self.attempt_span = self.attempt_span, None
        if span is not None:
            end_attempt_span(span, "ok" if ok else outcome, self.usage, self.finish_reason)
        try:  # the outcome first: nothing the fleet knows waits on the rest of the answer's bytes
            self.fleet.record_attempt(attempt.worker_id, ok=ok, first_byte_s=attempt.first_byte_s,
                                      expected_first_byte_s=attempt.expected_first_byte_s)
        finally:
            await attempt.close(drain=ok and self.done)

    # -- results -----------------------------------------------------------------------------

    def final_usage(self) -> dict[str, Any] | None:
        """Usage as the client sees it: after a failover, the delivered tokens plus the continuation's."""
        usage = self.usage
        if self.failovers == 0 or usage is None:
            return usage
        prompt = (self.ticket.decision.num_prompt_tokens
                  or max(0, usage.get("prompt_tokens", 0) - self.delivered_tokens_at_failover))
        completion = self.delivered_tokens_at_failover + usage.get("completion_tokens", 0)
        cached = min(prompt, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def accounted_usage(self) -> dict[str, Any] | None:
        """Usage to count and bill: the worker's when it sent one, else what was streamed (a client
        that left mid-answer, a worker that died after its last token, a failover that failed): the
        prompt, once a first token showed it was computed, and the tokens delivered."""
        usage = self.final_usage()
        if usage is not None or self.first_token_s is None:
            return usage
        prompt = self.ticket.decision.num_prompt_tokens or 0
        more = self.more_choices.values()
        if self.token_ids:
            completion = len(self.token_ids) + sum(len(parts.token_ids) for parts in more)
        elif self.tokenizer is not None:
            completion = sum(len(self.tokenizer.encode_text(text)) for text in (self.text, *(p.text for p in more)))
        else:  # engines stream about a token a chunk
            completion = self.num_token_chunks
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0}}

    def _full_response(self) -> dict[str, Any]:
        first = self.first_payload or {}
        usage = self.final_usage()
        first_choice = ChoiceParts([self.text], self.token_ids, self.tool_calls, self.logprobs, self.finish_reason,
                                   self.stop_reason)
        # the choices the worker gave (one, from a worker that ignores n)
        choices = [self._whole_choice(0, first_choice),
                   *(self._whole_choice(index, self.more_choices[index]) for index in sorted(self.more_choices))]
        body = {"id": first.get("id"), "object": "chat.completion" if self.req.kind == "chat" else "text_completion",
                "created": first.get("created"), "model": first.get("model", self.req.model), "choices": choices}
        if "system_fingerprint" in first:
            body["system_fingerprint"] = first["system_fingerprint"]
        if self.req.body.get("return_token_ids") and self.prompt_token_ids is not None:
            if self.req.kind == "chat":  # where the worker puts them in its own non-streaming answer
                body["prompt_token_ids"] = self.prompt_token_ids
            else:
                for choice in choices:
                    choice["prompt_token_ids"] = self.prompt_token_ids
        if usage is not None:
            body["usage"] = usage
        return body

    def _whole_choice(self, index: int, parts: ChoiceParts) -> dict[str, Any]:
        """One choice of the whole answer, from what its chunks carried."""
        text = parts.text
        if self.req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if parts.tool_calls:
                message["content"] = text or None
                message["tool_calls"] = parts.tool_calls.calls()
            choice = {"index": index, "message": message, "logprobs": parts.logprobs,
                      "finish_reason": parts.finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": parts.logprobs, "finish_reason": parts.finish_reason}
        if parts.stop_reason is not NOT_GIVEN:
            choice["stop_reason"] = parts.stop_reason
        if self.req.body.get("return_token_ids"):
            choice["token_ids"] = parts.token_ids
        return choice
