"""The worker's HTTP API: OpenAI completions and chat (streaming or not), models, health, metrics.

Handlers tokenize, submit to the AsyncEngine and shape OpenAI responses; a client that goes
away aborts its request in the engine at once.

Each completion request has an id: the caller's X-Request-Id when it is one (letters, digits and
`._:-`, at most 128), else a new one. It is echoed as x-request-id, names the response as vLLM does
(`cmpl-<id>`, `chatcmpl-<id>`) and the request's log line; the engine's own id adds a counter, so
the same X-Request-Id twice at once is two requests. Every completion request, answered or not, is
reported once at its end (worker/request_telemetry.py: a log line and, with tracing on, spans).

A worker is meant to be reachable only from the gateway (it binds 127.0.0.1 by default): it
trusts the `x-priority` header, which the gateway sets to the priority it admitted, and ignores
any `priority` in the body, which only a client could have chosen. It does no authentication.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvgate.api_error import ApiError
from kvgate.json_body import parse_json_object
from kvgate.offload import Offloader
from kvgate.request_log import request_id as new_or_incoming_id
from worker.async_engine import AsyncEngine, EngineShutDown, RequestFailed, RequestTiming
from worker.engine.engine import RequestOutput
from worker.engine.sampling_params import SamplingParams
from worker.executor.base import TokenLogprobs
from worker.metrics import WorkerMetrics
from worker.model.tokenizer import ModelTokenizer, TokenBytes
from worker.openai_api import GenerateRequest, parse_chat, parse_completion
from worker.request_telemetry import CLIENT_GONE, ERROR, FINISHED, REJECTED, RequestRecord, RequestTelemetry


@dataclass(slots=True)
class WorkerState:
    """Everything the handlers need; built once by worker.cli."""

    engine: AsyncEngine
    tokenizer: ModelTokenizer
    served_model_name: str
    model_root: str
    executor_name: str
    block_size: int
    max_model_len: int
    metrics: WorkerMetrics
    num_token_ids: int  # rows of the model's embedding: a prompt's token ids must be below this
    telemetry: RequestTelemetry
    created_s: int = dataclasses.field(default_factory=lambda: int(time.time()))
    engine_ids: Iterator[int] = dataclasses.field(default_factory=itertools.count)  # the engine ids' suffixes
    offload: Offloader = dataclasses.field(default_factory=Offloader)  # a large body is prepared off the loop
    token_bytes: TokenBytes = dataclasses.field(init=False)  # each token's bytes, for logprobs

    def __post_init__(self) -> None:
        self.token_bytes = TokenBytes(self.tokenizer.tokenizer)


def build_app(state: WorkerState) -> Starlette:
    routes = [
        Route("/health", _health, methods=["GET"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/v1/completions", _completions, methods=["POST"]),
        Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.worker = state
    return app


async def _http_error(request: Request, exc: HTTPException) -> Response:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return ApiError(exc.status_code, exc.detail or "error", type_).response(exc.headers)


def _state(request: Request) -> WorkerState:
    return request.app.state.worker


async def _health(request: Request) -> Response:
    if not _state(request).engine.is_alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _models(request: Request) -> Response:
    s = _state(request)
    model = {
        "id": s.served_model_name, "object": "model", "created": s.created_s, "owned_by": "kvgate",
        "root": s.model_root, "parent": None, "max_model_len": s.max_model_len,
        "block_size": s.block_size, "executor": s.executor_name,
    }
    return JSONResponse({"object": "list", "data": [model]})


async def _metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _completions(request: Request) -> Response:
    return await _generate(request, "completion")


async def _chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def _generate(request: Request, kind: str) -> Response:
    state = _state(request)
    record = state.telemetry.start(kind, request.url.path, _request_id(request), request.headers.get("traceparent"),
                                   request.headers.get("tracestate"))
    headers = {"x-request-id": record.request_id, "x-kvgate-executor": state.executor_name}
    try:
        raw = await request.body()
        req, prompt_ids = await state.offload.run_yielding(len(raw), _prepare, state, raw, kind,
                                                           _header_priority(request))
    except ApiError as error:
        return _answer_error(state, record, error, headers)
    except ClientDisconnect:
        state.telemetry.report(record, 499, CLIENT_GONE)
        return Response(status_code=499, headers=headers)
    record.request, record.prompt_token_ids = req, prompt_ids
    record.response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{record.request_id}"
    record.timing = RequestTiming(arrival_s=record.arrival_s)
    engine_id = f"{record.response_id}-{next(state.engine_ids)}"  # unique while the same X-Request-Id runs twice
    engine_ids, choice_params = _choice_requests(engine_id, req)
    outputs = state.engine.generate_choices(engine_ids, prompt_ids, choice_params, req.priority, timing=record.timing)
    shaper = _Shaper(state, req, record.response_id, prompt_ids)
    if req.stream:
        return StreamingResponse(_sse(shaper, outputs, state.telemetry, record), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})
    try:
        final = await _collect_unless_disconnected(request, outputs, record)
    except ApiError as error:
        return _answer_error(state, record, error, headers)
    if final is None:
        state.telemetry.report(record, 499, CLIENT_GONE)
        return Response(status_code=499, headers=headers)
    body = shaper.full_response(final)
    state.telemetry.report(record, 200, FINISHED)
    return JSONResponse(body, headers=headers)


def _choice_requests(engine_id: str, req: GenerateRequest) -> tuple[list[str], list[SamplingParams]]:
    """The engine requests of a request's choices: one with its own id and params; for n > 1, ids with
    each choice's index, and a seed moved on by it (as vLLM does: seeded choices draw tokens of their own)."""
    if req.n == 1:
        return [engine_id], [req.sampling]
    seed = req.sampling.seed
    return ([f"{engine_id}.{index}" for index in range(req.n)],
            [req.sampling if seed is None else dataclasses.replace(req.sampling, seed=seed + index)
             for index in range(req.n)])


def _request_id(request: Request) -> str:
    """The caller's X-Request-Id when it is a valid one, else a new id."""
    return new_or_incoming_id(request.headers.get("x-request-id"))


def _answer_error(state: WorkerState, record: RequestRecord, error: ApiError, headers: dict[str, str]) -> Response:
    state.telemetry.report(record, error.status, REJECTED if error.status < 500 else ERROR, error)
    return error.response(headers)


def _prepare(state: WorkerState, raw: bytes, kind: str, header_priority: int | None, *,
             yielding: bool) -> tuple[GenerateRequest, list[int]]:
    """The body as a request and its prompt's token ids (runs off the event loop for a large body)."""
    data = parse_json_object(raw, yielding=yielding, max_prompt_tokens=state.max_model_len)
    req = (parse_completion if kind == "completion" else parse_chat)(data, header_priority)
    _check_model(state, req.model)
    if req.sampling.logprobs is not None and not state.engine.engine.computes_logprobs:
        raise ApiError(400, f"logprobs are not available from this worker's {state.executor_name} executor: it "
                       "computes no distribution over tokens", param="logprobs")
    sampling = req.sampling
    for param, token_ids in (("logit_bias", [token for token, _ in sampling.logit_bias]),
                             ("allowed_token_ids", sampling.allowed_token_ids)):
        if any(token >= state.num_token_ids for token in token_ids):
            raise ApiError(400, f"{param} token ids must be < {state.num_token_ids} (the model's vocabulary size)",
                           param=param)
    prompt_ids = _prompt_token_ids(state, req)
    return _fit_context(state, req, len(prompt_ids)), prompt_ids


def _header_priority(request: Request) -> int | None:
    """The priority the gateway admitted (lower = more urgent); None when the header is absent."""
    value = request.headers.get("x-priority")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ApiError(400, f"X-Priority must be an integer, got {value[:20]!r}", param="X-Priority") from None


def _check_model(state: WorkerState, model: str | None) -> None:
    if model is not None and model not in (state.served_model_name, state.model_root):
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", param="model",
                       code="model_not_found")


def _prompt_token_ids(state: WorkerState, req: GenerateRequest) -> list[int]:
    """The prompt as token ids the model has rows for (400 naming the prompt otherwise)."""
    token_ids = _tokenize(state.tokenizer, req)
    num_token_ids = state.num_token_ids  # the embedding's rows, not the tokenizer's vocabulary
    if token_ids and max(token_ids) >= num_token_ids:
        given = "" if req.prompt_token_ids is not None else "the tokenized "
        raise ApiError(400, f"{given}prompt token ids must be < {num_token_ids} (the model's vocabulary size)",
                       param="messages" if req.kind == "chat" else "prompt")
    return token_ids


def _tokenize(tok: ModelTokenizer, req: GenerateRequest) -> list[int]:
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.prompt_text is not None:
        return tok.encode(req.prompt_text, add_special_tokens=True)
    try:
        text = tok.apply_chat_template(list(req.messages or ()), add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message)
    except (ValueError, jinja2.TemplateError) as exc:
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    return tok.encode(text, add_special_tokens=False)


def _fit_context(state: WorkerState, req: GenerateRequest, num_prompt_tokens: int) -> GenerateRequest:
    """Reject prompts that can't fit; give chat requests without max_tokens the room that is left."""
    room = state.max_model_len - num_prompt_tokens
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                       f"your prompt has {num_prompt_tokens} tokens.",
                       param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
    if not req.max_tokens_given:
        if req.sampling.min_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                           f"your prompt has {num_prompt_tokens} tokens and you asked for min_tokens "
                           f"{req.sampling.min_tokens}.", param="min_tokens", code="context_length_exceeded")
        return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=room))
    if req.sampling.max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                       f"requested {num_prompt_tokens + req.sampling.max_tokens} tokens ({num_prompt_tokens} in the "
                       f"prompt, {req.sampling.max_tokens} for the completion). Please reduce the prompt or "
                       f"{req.max_tokens_param}.", param=req.max_tokens_param, code="context_length_exceeded")
    return req


@dataclass(slots=True)
class _Choice:
    """One choice of a whole answer, as it ends: its text, its last output, and its logprobs if asked."""

    text: str
    last: RequestOutput
    logprobs: list[TokenLogprobs]


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], record: RequestRecord) -> list[_Choice]:
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[TokenLogprobs]] = {}
    try:
        async for index, output in outputs:
            texts.setdefault(index, []).append(output.new_text)
            if output.new_logprobs:
                logprobs.setdefault(index, []).extend(output.new_logprobs)
            record.last_outputs[index] = output
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    except (EngineShutDown, RequestFailed) as exc:
        raise _engine_error(exc) from None
    return [_Choice("".join(texts[index]), record.last_outputs[index], logprobs.get(index, []))
            for index in sorted(texts)]


async def _collect_unless_disconnected(request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]],
                                       record: RequestRecord) -> list[_Choice] | None:
    """Run the request; if the client disconnects first, cancel it (which aborts it) and return None."""
    work = asyncio.ensure_future(_collect(outputs, record))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    await outputs.aclose()
    return None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(shaper: "_Shaper", outputs: AsyncIterator[tuple[int, RequestOutput]], telemetry: RequestTelemetry,
               record: RequestRecord) -> AsyncIterator[bytes]:
    """The stream's events; its end is reported: finished, an error event, or the client gone (the
    response's status is 200 whatever happens once it has started)."""
    outcome, error = CLIENT_GONE, None  # unless the stream gets to its end
    try:
        for chunk in shaper.first_chunks():
            yield _event(chunk)
        async for index, output in outputs:
            record.last_outputs[index] = output
            for chunk in shaper.chunks(index, output):
                yield _event(chunk)
        outcome = FINISHED
    except ValueError as exc:
        outcome, error = REJECTED, ApiError(400, str(exc))
    except (EngineShutDown, RequestFailed) as exc:
        outcome, error = ERROR, _engine_error(exc)
    finally:
        await outputs.aclose()
        telemetry.report(record, 200, outcome, error)
    if error is not None:
        yield _event(error.body())
    yield b"data: [DONE]\n\n"


def _engine_error(exc: EngineShutDown | RequestFailed) -> ApiError:
    """503 when the engine stopped (try another worker); 500 when the step running the request failed."""
    if isinstance(exc, EngineShutDown):
        return ApiError(503, str(exc), "service_unavailable")
    return ApiError(500, str(exc), "server_error")


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Shaper:
    """Builds OpenAI response bodies and stream chunks for one request, its n choices each with its
    index (a streamed choice's chunks come as its tokens do, interleaved with the others')."""

    def __init__(self, state: WorkerState, req: GenerateRequest, request_id: str, prompt_ids: list[int]) -> None:
        self.req = req
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        self.model = state.served_model_name
        self.fingerprint = f"kvgate-{state.executor_name}"
        self.is_chat = req.kind == "chat"
        self._prompt_ids_sent = False  # completions streams carry them in their first chunk (vLLM's place)
        self.num_logprobs = req.sampling.logprobs  # None: the client asked for no logprobs
        self._token_bytes = state.token_bytes
        self._text_offsets: dict[int, int] = {}  # a completion choice's text_offset: where its next token starts
        self._latest: dict[int, RequestOutput] = {}  # each choice's latest output, for a stream's usage

    def _envelope(self, object_: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The request's usage from its choices' latest outputs: the prompt once (and its cached tokens as
        the first choice found them), the tokens of every choice."""
        first = outputs[0]
        completion = sum(output.num_output_tokens for output in outputs)
        return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": first.num_prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}

    def full_response(self, choices: list[_Choice]) -> dict[str, Any]:
        shown = [self._full_choice(index, choice) for index, choice in enumerate(choices)]
        body = {**self._envelope("chat.completion" if self.is_chat else "text_completion"), "choices": shown}
        if self.req.return_token_ids and self.is_chat:
            body["prompt_token_ids"] = self.prompt_ids
        body["usage"] = self.usage([choice.last for choice in choices])
        return body

    def _full_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        final = choice.last
        reason = final.finish_reason.value if final.finish_reason else None
        shown_logprobs = self._logprobs(index, final.output_token_ids, choice.logprobs)
        if self.is_chat:
            shown: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": choice.text},
                                     "logprobs": shown_logprobs, "finish_reason": reason,
                                     "stop_reason": final.stop_reason}
        else:
            shown = {"index": index, "text": choice.text, "logprobs": shown_logprobs, "finish_reason": reason,
                     "stop_reason": final.stop_reason}
            if self.req.return_token_ids:
                shown["prompt_token_ids"] = self.prompt_ids
        if self.req.return_token_ids:
            shown["token_ids"] = final.output_token_ids
        return shown

    def first_chunks(self) -> list[dict[str, Any]]:
        """A chat stream's role announcement, once per choice (the first carries the prompt's ids if asked)."""
        if not self.is_chat:
            return []
        chunks = [self._chunk(index, {"role": "assistant", "content": ""}, None, None) for index in range(self.req.n)]
        if self.req.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.prompt_ids
        return chunks

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """The chunks for one choice's output; after the last choice's end, the usage chunk if asked."""
        self._latest[index] = output
        reason = output.finish_reason.value if output.finished and output.finish_reason else None
        chunks = []
        tokens_shown = self.req.return_token_ids or self.num_logprobs is not None
        if output.new_text or reason is not None or (tokens_shown and output.new_token_ids):
            delta: Any = {"content": output.new_text} if self.is_chat else output.new_text
            chunk = self._chunk(index, delta, reason, output.new_token_ids if self.req.return_token_ids else None)
            choice = chunk["choices"][0]
            if output.new_logprobs:
                choice["logprobs"] = self._logprobs(index, output.new_token_ids, output.new_logprobs)
            if reason is not None:
                choice["stop_reason"] = output.stop_reason
            if self.req.return_token_ids and not self.is_chat and not self._prompt_ids_sent:
                choice["prompt_token_ids"] = self.prompt_ids
                self._prompt_ids_sent = True
            if self.req.include_usage:
                chunk["usage"] = self.usage(self._latest_outputs()) if self.req.continuous_usage else None
            chunks.append(chunk)
        if output.finished and self.req.include_usage and self._all_finished():
            chunks.append({**self._envelope(self._chunk_object()), "choices": [],
                           "usage": self.usage(self._latest_outputs())})
        return chunks

    def _latest_outputs(self) -> list[RequestOutput]:
        return [self._latest[index] for index in sorted(self._latest)]

    def _all_finished(self) -> bool:
        return len(self._latest) == self.req.n and all(output.finished for output in self._latest.values())

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def _chunk(self, index: int, delta: Any, reason: str | None, token_ids: list[int] | None) -> dict[str, Any]:
        if self.is_chat:
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._envelope(self._chunk_object()), "choices": [choice]}

    def _logprobs(self, index: int, token_ids: list[int],
                  logprobs: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        """These tokens' logprobs as the endpoint shows them (vLLM's and OpenAI's shapes); None when the
        client asked for none. A token is shown as its own bytes decoded (U+FFFD for part of a character:
        a chat's `bytes` carry the exact ones)."""
        if self.num_logprobs is None or not logprobs:
            return None
        if self.is_chat:
            return {"content": [{**self._chat_entry(token_id, entry.logprob),
                                 "top_logprobs": [self._chat_entry(top_id, top_logprob) for top_id, top_logprob
                                                  in zip(entry.top_token_ids, entry.top_logprobs)]}
                                for token_id, entry in zip(token_ids, logprobs)]}
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(_finite(entry.logprob))
            top = {self._token_text(top_id): _finite(top_logprob)
                   for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs)}
            top.setdefault(text, _finite(entry.logprob))  # the sampled token is always among them (as vLLM)
            top_logprobs.append(top)
            offset = self._text_offsets.get(index, 0)
            text_offset.append(offset)
            self._text_offsets[index] = offset + len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self._token_bytes(token_id)
        return {"token": raw.decode("utf-8", "replace"), "logprob": _finite(logprob), "bytes": list(raw)}

    def _token_text(self, token_id: int) -> str:
        return self._token_bytes(token_id).decode("utf-8", "replace")


def _finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (a token the model rules out) as vLLM shows it, -9999.0."""
    return max(logprob, -9999.0)
