"""POST /v1/chat/completions and /v1/completions: validate, route, proxy, record.

A plain ASGI app (reached without building Request and Response objects): this is the one path
every completion takes, so it does no more per request than it must. Its constructor lists every
part of the gateway a request touches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from admission.cost import request_cost_usd
from admission.priority import Priority
from gateway import fallbacks
from gateway.admission import Admission, AdmissionRequest, Permit, Refused
from gateway.batch import Batch, batch_prompts
from gateway.client_watch import ClientWatch
from gateway.errors import UpstreamError
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.request_body import estimate_prompt_tokens, parse_body, read_body
from gateway.session import ProxyRequest, Session, Write
from gateway.shutdown import Shutdown, shutdown_error
from gateway.sse import DONE, compact_json, compact_json_pieces, encode_event
from gateway.telemetry import OPERATIONS, Telemetry, set_usage, step_span
from gateway.upstream_http import UpstreamClient
from kvgate.api_error import ApiError
from kvgate.config import PricesConfig, UpstreamConfig
from kvgate.offload import Offloader
from router.errors import PromptTooLongError
from router.router import NoRouteError, Router
from router.ticket import RouteTicket
from router.tokenization import RoutingTokenizer
from router.types import RouteRequest

log = logging.getLogger("kvgate.gateway")

# passed on to workers; a client's x-priority is not (the worker gets the admitted one)
FORWARDED_HEADERS = ("traceparent", "tracestate", "x-request-deadline-ms", "x-session-id", "x-workflow-id",
                     "x-workflow-step", "x-workflow-steps")
KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclass(slots=True, kw_only=True, eq=False)
class ProxyEndpoint:
    """One completion path. models maps each served model to its pool; tokenizers, each model's
    routing tokenizer (only exact ones are used to continue after a failover); prices, each pool's
    (for the cost of each request); debug_header_for(tenant) says whether its answers carry x-kvgate-route;
    offload parses, tokenizes and encodes a large request off the event loop; longest_prompt_tokens,
    the longest prompt any pool takes (None: some pool has no known limit), bounds a large body's parse;
    telemetry, the spans and the fields of the request's log line (gateway/telemetry.py); shutdown, whether
    the server is stopping (a request it cancels then ends with a clear error: gateway/shutdown.py)."""

    path: str
    admission: Admission
    router: Router
    fleet: Fleet
    upstream: UpstreamClient
    settings: UpstreamConfig
    metrics: GatewayMetrics
    prices: Mapping[str, PricesConfig]
    tokenizers: Mapping[str, RoutingTokenizer]
    models: Mapping[str, str]
    debug_header_for: Callable[[str], bool]
    rng: random.Random
    offload: Offloader
    longest_prompt_tokens: int | None
    telemetry: Telemetry = field(default_factory=Telemetry)
    shutdown: Shutdown = field(default_factory=Shutdown)
    kind: str = field(init=False)

    def __post_init__(self) -> None:
        self.kind = KINDS[self.path]
        self.tokenizers = {model: t for model, t in self.tokenizers.items() if t.mode == "exact"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()
        state = scope.setdefault("state", {})
        tenant = state.get("tenant", "anonymous")
        model_label = "unknown"
        metrics = self.metrics
        record = state.get("log")  # the request's log line (None: not logged)
        watch = None
        in_flight = False
        prompts = None
        try:
            try:
                raw = state.pop("body", None)  # read by BodyLimitsMiddleware
                if raw is None:  # reached without it
                    raw = await read_body(receive)
                body = await self.offload.run_yielding(len(raw), parse_body, raw, self.kind,
                                                       max_prompt_tokens=self.longest_prompt_tokens)
                model = body["model"]
                model_label = model if model in self.models else "unknown"
                if record is not None:
                    record["model"] = model_label
                prompts = batch_prompts(body["prompt"]) if self.kind == "completion" else None
                if prompts is not None:  # each prompt a request of its own, through this endpoint
                    await Batch(self, scope, body, prompts, self.admission.allowed_in_flight(tenant),
                                self.shutdown).run(receive, send)
                    return
                metrics.requests_in_flight += 1
                in_flight = True
                watch = ClientWatch(receive, total_s=self.settings.total_timeout_s)  # for the rest of the request
                started = await watch.run(self._start(scope, body, len(raw), tenant))
            except ApiError as error:
                self._count_unanswered(state, tenant, model_label, error.status, error.code or error.type,
                                       error.message)
                await error.response(self._refusal_timing(error, arrived))(scope, receive, send)
                return
            except UpstreamError as error:  # the worker refused the request itself (4xx): pass its answer on
                self._count_unanswered(state, tenant, model_label, error.status or 502, "refused_by_worker",
                                       str(error))
                await Response(error.body, status_code=error.status or 502, media_type="application/json")(
                    scope, receive, send)
                return
            except Exception:  # a bug: the client still gets an OpenAI-style 500 (with its request id), counted
                log.exception("request %s failed", state.get("request_id", ""))
                self._count_unanswered(state, tenant, model_label, 500, "internal_error")
                await ApiError(500, "internal error in the gateway", "server_error").response()(scope, receive, send)
                return
            except asyncio.CancelledError:  # a batch's prompts end as their client gone (gateway/batch.py)
                error = None if prompts is not None else self._cut_short(watch)
                if error is None:
                    raise
                self._count_unanswered(state, tenant, model_label, error.status, error.code, error.message)
                await error.response()(scope, receive, send)
                return
            if started is None:  # the client went away before the first token: the attempt was cancelled
                self._count_unanswered(state, tenant, model_label, 499, "client_gone")
                await _client_gone(send)
                return
            session, held = started
            await self._respond(session, held, tenant, watch, scope, receive, send)
        finally:
            if in_flight:
                metrics.requests_in_flight -= 1
            if watch is not None:
                watch.stop()

    def _count_unanswered(self, state: dict, tenant: str, model: str, status: int, outcome: str,
                          error: str | None = None) -> None:
        """A request that ended before its answer began: counted (pool "none" when it never had one)
        and its log line says why."""
        pool = state.get("pool", "none")
        self.metrics.child(self.metrics.requests, tenant, model, pool, str(status)).inc()
        record = state.get("log")
        if record is not None:
            record.setdefault("outcome", outcome)
            if error is not None:
                record.setdefault("error", error[:300])

    def _refusal_timing(self, error: ApiError, arrived: float) -> dict[str, str] | None:
        """An admission refusal is timed from the request's arrival at this endpoint: counted in
        kvgate_refusal_seconds and told to the client as Server-Timing (the gateway's own share of the
        latency it sees)."""
        if not isinstance(error, Refused):
            return None
        refused_after_s = time.perf_counter() - arrived
        self.metrics.child(self.metrics.refusal_seconds, error.code).observe(refused_after_s)
        return {"server-timing": f"gateway;dur={refused_after_s * 1000:.3f}"}

    async def _start(self, scope: Scope, body: dict[str, Any], body_bytes: int, tenant: str) -> tuple[Session, list]:
        """Admit, route and open the upstream stream; the permit ends here unless a session holds it."""
        request_headers = _request_headers(scope["headers"])
        priority = self.admission.priority_for(tenant, _requested_priority(request_headers.get("x-priority")))
        state = scope.get("state", {})
        request_id = state.get("request_id", "")
        route_req = RouteRequest(
            model=body["model"], messages=body.get("messages") if self.kind == "chat" else None,
            prompt=body.get("prompt") if self.kind == "completion" else None, tools=body.get("tools"),
            request_id=request_id, tenant=tenant, priority=priority.label,
            session_id=request_headers.get("x-session-id"), headers=request_headers, path=self.path)
        pool_plan = self._pool_plan(route_req, tenant)
        pool = pool_plan.first.pool
        state["pool"] = pool
        record = state.get("log")
        tracer = self.telemetry.tracer
        if record is not None:
            record.update(tenant=tenant, pool=pool, priority=priority.label)
        waited = time.perf_counter()
        with step_span(tracer, "admission") as span:
            if span is not None:
                span.set_attributes({"kvgate.tenant": tenant, "kvgate.pool": pool, "kvgate.priority": priority.label})
            permit = await self.admission.admit(AdmissionRequest(
                tenant, pool, priority, deadline_ms=_deadline_ms(request_headers.get("x-request-deadline-ms")),
                workflow_step=_workflow_step(request_headers.get("x-workflow-step")),
                prompt_tokens_estimate=estimate_prompt_tokens(body), max_tokens=_max_tokens(body),
                counts_request=not state.get("batch_part")), overflow=[c.pool for c in pool_plan.overflow])
            if (reason := fallbacks.reason_for(pool_plan, permit.request.pool)) is not None:
                fallbacks.note_move(self.metrics, record, span, pool_plan.rule_pool, permit.request.pool, reason)
        if record is not None:
            record["admission_s"] = round(time.perf_counter() - waited, 6)
        session = None
        try:
            headers = {name: request_headers[name] for name in FORWARDED_HEADERS if name in request_headers}
            headers.update(state.get("trace_headers", {}))
            headers["x-request-id"] = request_id
            headers["x-priority"] = str(int(priority))  # the admitted class, as the worker's integer priority
            client_stream = bool(body.get("stream"))
            stream_options = body.get("stream_options") or {}
            tried_pools: list[str] = []
            while True:
                with step_span(tracer, "route") as span:
                    ticket, routed = await self._route_in_plan(route_req, pool_plan, permit, body_bytes, record, span)
                    if span is not None or record is not None:
                        self._describe_route(ticket, span, record)
                if permit.request.pool != pool:  # served by a fallback pool
                    pool = state["pool"] = permit.request.pool
                    if record is not None:
                        record["pool"] = pool
                # a fallback pool serving another model gets the request under its model's name
                sent = body if routed.model == body["model"] else {**body, "model": routed.model}
                permit.prompt_counted(ticket.decision.num_prompt_tokens or 0)
                req = ProxyRequest(kind=self.kind, path=self.path, body=_without_client_priority(sent),
                                   model=sent["model"], pool=pool, tenant=tenant, request_id=request_id,
                                   headers=headers, client_stream=client_stream,
                                   # the aggregated response always carries usage
                                   client_include_usage=not client_stream or bool(stream_options.get("include_usage")),
                                   body_bytes=body_bytes, state=state)
                session = Session(req=req, ticket=ticket, permit=permit, fleet=self.fleet, upstream=self.upstream,
                                  settings=self.settings, metrics=self.metrics,
                                  tokenizer=self.tokenizers.get(req.model), rng=self.rng, offload=self.offload,
                                  tracer=tracer, n=body.get("n") or 1)
                try:
                    return session, await session.start()
                except ApiError as exc:  # no worker of the pool could begin the answer
                    tried_pools.append(pool)
                    target = fallbacks.after_failed_attempts(pool_plan, exc.code, tried_pools)
                    if target is None or not permit.retry_allowed():  # the move is a retry: it spends the budget
                        raise
                await self.admission.move(permit, target.pool)
                fallbacks.note_move(self.metrics, record, None, pool, target.pool, fallbacks.UNAVAILABLE)
        except BaseException:
            dropped = session is not None and session.ticket.outcome in _DROPPED
            permit.end(queue_delay_s=None, dropped=dropped, usage=None)
            raise

    def _pool_plan(self, route_req: RouteRequest, tenant: str) -> fallbacks.PoolPlan:
        """The pools the request may use (gateway/fallbacks.py); 404 / 503 when it has none."""
        try:
            choices = self.router.pool_choices(route_req)
        except NoRouteError as exc:
            raise self._no_route(route_req, exc) from None
        pool_plan = fallbacks.plan(choices, self.admission.tenant(tenant))
        if pool_plan is None:
            raise self._no_route(route_req, NoRouteError(fallbacks.no_pool_message(choices, tenant)))
        return pool_plan

    async def _route_in_plan(self, route_req: RouteRequest, pool_plan: fallbacks.PoolPlan, permit: Permit,
                             body_bytes: int, record: dict | None, span) -> tuple[RouteTicket, RouteRequest]:
        """The ticket in the pool admission gave the request, with the request as routed there (the model
        its workers serve); a prompt too long for that pool moves on to the first longer-context
        fallback that takes it (admitted there first), if its rule has one."""
        longer = [c for c in pool_plan.longer_context if c.pool != permit.request.pool]
        while True:
            pool = permit.request.pool
            model = pool_plan.choice(pool).model
            routed = route_req if model == route_req.model else replace(route_req, model=model)
            try:
                return await self._route(routed, pool, body_bytes, record), routed
            except ApiError as exc:
                if exc.code != fallbacks.CONTEXT_LENGTH_EXCEEDED or not longer:
                    raise
            target = longer.pop(0)
            await self.admission.move(permit, target.pool)
            fallbacks.note_move(self.metrics, record, span, pool, target.pool, fallbacks.CONTEXT_LENGTH_EXCEEDED)

    async def _route(self, route_req: RouteRequest, pool: str, body_bytes: int, record: dict | None) -> RouteTicket:
        """The routing ticket; a large request's prompt is tokenized off the event loop first (and
        any prompt first when its token ids go into the log line)."""
        started = time.perf_counter()
        try:
            token_ids = None
            if self.offload.is_large(body_bytes):
                token_ids = await self.offload.run(body_bytes, self.router.tokenize, route_req, pool)
            elif record is not None and self.telemetry.log_prompt_token_ids:
                token_ids = self.router.tokenize(route_req, pool)
            if record is not None and self.telemetry.log_prompt_token_ids:
                record["prompt_token_ids"] = token_ids
            ticket = self.router.route(route_req, token_ids, pool=pool)
        except NoRouteError as exc:
            raise self._no_route(route_req, exc) from None
        except PromptTooLongError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded",
                           param="messages" if route_req.messages is not None else "prompt") from None
        except OverflowError:  # token ids are packed as u32 for the block keys
            raise ApiError(400, "prompt token ids must be integers in [0, 2**32)", param="prompt") from None
        except (ValueError, TypeError) as exc:  # e.g. a chat template that rejects the messages
            raise ApiError(400, f"cannot tokenize the request: {exc}",
                           param="messages" if route_req.messages is not None else "prompt") from None
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        decision = ticket.decision
        self.metrics.child(self.metrics.routed, decision.pool or pool, decision.policy, decision.worker_id).inc()
        return ticket

    @staticmethod
    def _describe_route(ticket: RouteTicket, span, record: dict | None) -> None:
        """The decision on the route span and in the log line: policy, rule, chosen worker, candidates,
        predicted cached tokens, and why the first ranked first (its cached blocks, requests, predicted TTFT)."""
        decision = ticket.decision
        reason = decision.explanation[0].describe() if decision.explanation else None
        if span is not None:
            span.set_attribute("kvgate.pool", decision.pool or "")
            span.set_attribute("kvgate.route.policy", decision.policy)
            span.set_attribute("kvgate.route.worker", decision.worker_id)
            span.set_attribute("kvgate.route.candidates", decision.worker_ids[:8])
            if decision.rule is not None:
                span.set_attribute("kvgate.route.rule", decision.rule)
            if decision.num_prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", decision.num_prompt_tokens)
            if decision.predicted_cached_tokens is not None:
                span.set_attribute("kvgate.route.predicted_cached_tokens", decision.predicted_cached_tokens)
            if reason is not None:
                span.set_attribute("kvgate.route.reason", reason)
        if record is not None:
            record.update(policy=decision.policy, rule=decision.rule, routed_to=decision.worker_id,
                          candidates=list(decision.worker_ids[:4]),
                          predicted_cached_tokens=decision.predicted_cached_tokens, route_reason=reason)

    def _no_route(self, route_req: RouteRequest, exc: NoRouteError) -> ApiError:
        if route_req.model not in self.models:
            return ApiError(404, f"The model `{route_req.model}` does not exist.", "invalid_request_error",
                            code="model_not_found", param="model")
        return ApiError(503, f"no healthy worker: {exc}", "service_unavailable", code="no_healthy_worker",
                        retry_after_s=1)

    async def _respond(self, session: Session, held: list, tenant: str, watch: ClientWatch, scope: Scope,
                       receive: Receive, send: Send) -> None:
        """The answer, with raw ASGI messages: a stream as one body message per upstream read, or the
        assembled response; a client that goes away meanwhile cancels the rest upstream (499)."""
        headers = [(b"x-kvgate-worker", session.tried[-1].encode()), (b"x-kvgate-pool", session.req.pool.encode())]
        rate_limits = session.permit.rate_limit_headers()
        if rate_limits:
            headers += rate_limits
        if self.debug_header_for(tenant):
            headers.append((b"x-kvgate-route", session.ticket.decision.explain()[:2000].encode("latin-1", "replace")))
        try:  # the answer goes out first: the client does not wait for the request's accounting
            if session.req.client_stream:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + headers})
                write = _body_writer(send)
                try:
                    await watch.run(session.stream(held, write), own_task=True)
                except asyncio.CancelledError:  # (cut short just as the stream ended: nothing more to say)
                    error = self._cut_short(watch, None if session.answer_sent else session)
                    if error is None:
                        raise
                    if not session.answer_sent:
                        await write(encode_event(error.body()) + DONE, False)
                return
            try:
                result = await watch.run(session.collect(held))
            except ApiError as error:  # the worker failed mid-answer and no other could continue it
                session.error_status = error.status
                await error.response()(scope, receive, send)
                return
            except asyncio.CancelledError:
                error = self._cut_short(watch, session)
                if error is None:
                    raise
                await error.response()(scope, receive, send)
                return
            if result is None:
                await _client_gone(send)
                return
            content = await _encoded_answer(result, session.num_token_chunks)
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                        (b"x-kvgate-failovers", str(session.failovers).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": content})
        finally:  # however the answer ended (its client left, the gateway failed): recorded before anything
            # is awaited, so the permit is free by the time the client can send its next request
            self._finish(session, tenant)
            await session.end()

    def _cut_short(self, watch: ClientWatch | None, session: Session | None = None) -> ApiError | None:
        """After the request's task was cancelled: the error to end the request with if the gateway cut
        it short (its total time ran out, or the server stopped and its grace ran out), the task then
        uncancelled and the session's end recorded; None for any other cancellation (re-raise it)."""
        if watch is not None and watch.expired:
            error = ApiError(504, "the request ran past the gateway's total timeout "
                                  f"({self.settings.total_timeout_s:g} s, upstream.total_timeout_s)", "timeout_error",
                             code="total_timeout")
        elif self.shutdown.started:
            error = shutdown_error()
        else:
            return None
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        if session is not None:
            session.end_reason, session.error_status = error.code, error.status
        return error

    def _finish(self, session: Session, tenant: str) -> None:
        """The request's one terminal record: status (200 if answered, the error it ended with, else
        499 for a client that left), latency, tokens, cost; its permit ends."""
        if session.recorded:
            return
        session.recorded = True
        req, m = session.req, self.metrics
        answered = session.done or session.finish_reason is not None
        status = "200" if answered else str(session.error_status or 499)
        m.child(m.requests, tenant, req.model, req.pool, status).inc()
        e2e_s = time.monotonic() - req.started_s
        m.child(m.e2e, req.model, req.pool).observe(e2e_s)
        usage = session.accounted_usage() or {}
        self._trace_and_log(session, usage, answered, e2e_s)
        session.permit.end(queue_delay_s=session.ticket.queue_delay_s, dropped=session.end_reason in _DROPPED,
                           usage=usage or None, first_token_at_s=session.first_token_s)
        if usage:
            m.child(m.prompt_tokens, tenant, req.model, req.pool).inc(usage.get("prompt_tokens", 0))
            m.child(m.completion_tokens, tenant, req.model, req.pool).inc(usage.get("completion_tokens", 0))
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            m.child(m.cached_tokens, tenant, req.model, req.pool).inc(cached)
        prices = self.prices[req.pool]
        m.record_cost(tenant, request_cost_usd(usage, prompt_per_1m=prices.prompt_per_1m,
                                               cached_per_1m=prices.cached_per_1m,
                                               completion_per_1m=prices.completion_per_1m), answered)

    def _trace_and_log(self, session: Session, usage: dict[str, Any], answered: bool, e2e_s: float) -> None:
        """The answer's outcome on the request's SERVER span and in its log line."""
        req, state = session.req, session.req.state
        span, record = state.get("span"), state.get("log")
        if span is None and record is None:
            return
        outcome = "answered" if answered else (session.end_reason or session.ticket.outcome or "client_gone")
        if span is not None:
            span.set_attribute("gen_ai.operation.name", OPERATIONS[req.kind])
            span.set_attribute("gen_ai.request.model", req.model)
            span.set_attribute("kvgate.tenant", req.tenant)
            span.set_attribute("kvgate.pool", req.pool)
            span.set_attribute("kvgate.outcome", outcome)
            if session.tried:
                span.set_attribute("kvgate.worker", session.tried[-1])
            if usage:
                set_usage(span, usage)
            if session.finish_reason is not None:
                span.set_attribute("gen_ai.response.finish_reasons", (session.finish_reason,))
        if record is None:
            return
        details = usage.get("prompt_tokens_details") or {}
        first_token_s = (None if session.first_token_s is None
                         else round(session.first_token_s - req.started_s, 6))
        record.update(pool=req.pool, worker=session.tried[-1] if session.tried else None,
                      workers_tried=session.tried if len(session.tried) > 1 else None, outcome=outcome,
                      finish_reason=session.finish_reason, failovers=session.failovers or None,
                      ttft_s=first_token_s, e2e_s=round(e2e_s, 6), stream=req.client_stream,
                      prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"),
                      completion_tokens=usage.get("completion_tokens"))


LARGE_ANSWER_CHUNKS = 2048  # a non-streaming answer this long is encoded in pieces (_encoded_answer)
# what StreamingResponse sent for text/event-stream, in its order
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8")]
# how a request ended when the fleet caused it (a ticket's outcome, a session's end_reason): congestion to the limiter
_DROPPED = ("upstream_unavailable", "failover_failed")


async def _encoded_answer(result: dict[str, Any], num_chunks: int) -> bytes:
    """A non-streaming answer as JSON. One of LARGE_ANSWER_CHUNKS chunks or more is encoded a piece at a
    time, the event loop running the other requests between pieces: a 32,000-token answer with its
    logprobs takes ~11 ms to encode at once, and no piece more than ~0.5 ms."""
    if num_chunks < LARGE_ANSWER_CHUNKS:
        return compact_json(result)
    pieces = []
    for index, piece in enumerate(compact_json_pieces(result)):
        pieces.append(piece)
        if index % 8 == 7:
            await asyncio.sleep(0)
    return b"".join(pieces)


async def _client_gone(send: Send) -> None:
    """Close the exchange of a client that disconnected (499, nginx's "client closed request")."""
    await send({"type": "http.response.start", "status": 499, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _request_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by name (ASGI gives them in lower case), the first of repeated ones (as
    Headers.get has it), without its credentials: what routing rules match and the worker may be sent."""
    headers = {}
    for name, value in reversed(raw):
        headers[name.decode("latin-1")] = value.decode("latin-1")
    headers.pop("authorization", None)
    headers.pop("x-api-key", None)
    return headers


def _requested_priority(value: str | None) -> Priority | None:
    if value is None:
        return None
    try:
        return Priority.parse(value)
    except ValueError as exc:
        raise ApiError(400, f"X-Priority: {exc}", param="X-Priority") from None


def _deadline_ms(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        deadline_ms = float(value)
    except ValueError:
        deadline_ms = math.nan
    if not 0 < deadline_ms < math.inf:
        raise ApiError(400, "X-Request-Deadline-Ms must be a positive number of milliseconds",
                       param="X-Request-Deadline-Ms")
    return deadline_ms


def _workflow_step(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ApiError(400, "X-Workflow-Step must be an integer >= 1", param="X-Workflow-Step")
    return int(value)


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The most tokens the answer can take: max_tokens for each of its n choices."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value * (body.get("n") or 1)
    return None


def _without_client_priority(body: dict[str, Any]) -> dict[str, Any]:
    """The body a worker gets: a client's own `priority` never reaches it (x-priority carries the admitted one)."""
    if "priority" not in body:
        return body
    return {k: v for k, v in body.items() if k != "priority"}


def _body_writer(send: Send) -> Write:
    """The session's write(data, more_body) as raw ASGI body messages (send's own awaitable, not a
    coroutine awaiting it: one frame fewer for every token of a stream)."""

    def write(data: bytes, more_body: bool) -> Awaitable[None]:
        return send({"type": "http.response.body", "body": data, "more_body": more_body})

    return write
