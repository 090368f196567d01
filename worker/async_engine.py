"""Runs the engine loop on its own thread and streams each request's outputs to asyncio callers.

The HTTP handlers live on the event loop; model math must not. Requests and aborts cross to the
engine thread through a queue; outputs cross back with call_soon_threadsafe. KV events gathered
during a step are handed to the publisher once per step (it never blocks).

Failures: a step the executor fails (engine.StepFailed) fails only the requests of that step
(each gets RequestFailed, which the server answers with a 500) and the loop goes on serving; a
bad request or a transient device error must not take the worker down. MAX_CONSECUTIVE_FAILED_STEPS
failed steps in a row mean the device itself is broken (each failed step ended its requests, so
the next step holds other ones), and any other exception means the engine's bookkeeping can no
longer be trusted: then the loop stops, every waiter gets EngineShutDown, /health turns 503 and
on_crash is called, which the worker CLI uses to exit non-zero so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol, Sequence

from worker.engine.engine import Engine, RequestOutput, StepFailed
from worker.engine.sampling_params import SamplingParams

log = logging.getLogger("kvgate.worker")

MAX_CONSECUTIVE_FAILED_STEPS = 3


class StepObserver(Protocol):
    """Told about every step (metrics): the outputs, the request timings and the engine."""

    def on_step(self, engine: Engine, outputs: Sequence[RequestOutput], timings: dict[str, "RequestTiming"]) -> None: ...


class EventPublisher(Protocol):
    def publish(self, events: list) -> None: ...


@dataclass(slots=True)
class RequestTiming:
    """One request's marks on the engine's clock (AsyncEngine.clock, monotonic seconds), for the latency
    metrics, the request log and the request's spans; the engine thread fills them in as it runs.

    arrival_s: when the worker received the request (the HTTP handler; else when the engine took it);
    queued_s: when the engine took it; first_step_s: the start of the step that produced its first
    token (the first step that ran it, unless a long prompt was prefilled in chunks over several
    steps: the engine reports no step before the first token); first_token_s / last_token_s: the ends
    of the steps that produced its first and last tokens; token_gaps_s: the gaps between its tokens.
    max_tokens: the request's max_tokens (vllm:request_params_max_tokens).
    """

    arrival_s: float
    queued_s: float | None = None
    first_step_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)
    max_tokens: int | None = None


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class EngineShutDown(RuntimeError):
    """The engine thread stopped (shutdown or a crash); no more requests are served."""


class RequestFailed(RuntimeError):
    """The step running this request failed and ended it; the engine serves other requests on."""


class EngineCrashed(RuntimeError):
    """Steps failed MAX_CONSECUTIVE_FAILED_STEPS times in a row: the device is not usable."""


class AsyncEngine:
    """Thread-safe front of an Engine: `generate_choices()` is an async iterator of a request's outputs."""

    def __init__(self, engine: Engine, step_events: list | None = None, publisher: EventPublisher | None = None,
                 observer: StepObserver | None = None, clock: Callable[[], float] = time.monotonic,
                 on_crash: Callable[[], None] | None = None) -> None:
        """step_events is the list the Engine's event_sink appends to; it is drained every step.
        on_crash is called on the engine thread once, if the loop stops for a crash."""
        self.engine = engine
        self.on_crash = on_crash
        self._num_failed_steps_in_a_row = 0
        self._events = step_events if step_events is not None else []
        self._publisher = publisher
        self._observer = observer
        self.clock = clock  # the clock of every RequestTiming mark
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._timings: dict[str, RequestTiming] = {}
        self._stopping = threading.Event()
        self._crash: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._crash is None

    @property
    def crashed(self) -> bool:
        """The loop stopped for an error, not for shutdown()."""
        return self._crash is not None

    async def generate_choices(self, request_ids: list[str], prompt_token_ids: list[int],
                               params: list[SamplingParams], priority: int = 0,
                               timing: RequestTiming | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """A request's choices (OpenAI's n; one for most): one engine request each over the same prompt,
        with its own sampling params; yields (choice index, output) as outputs come, until every one has
        finished. Leaving early (a disconnect) aborts those still running; an error of any one ends them
        all. request_ids must be unique among the requests running. timing, when given, is the first
        choice's, filled in by the engine thread (its arrival_s is the caller's); read it once the
        request has ended."""
        if not self.is_alive:
            raise EngineShutDown("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        index_of = {request_id: index for index, request_id in enumerate(request_ids)}
        for index, (request_id, choice_params) in enumerate(zip(request_ids, params, strict=True)):
            self._streams[request_id] = stream
            self._inbox.put(("add", request_id, prompt_token_ids, choice_params, priority,
                             timing if index == 0 else None))
        self._wakeup.set()
        unfinished = set(request_ids)
        try:
            while unfinished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield index_of[item.request_id], item
        finally:
            for request_id in unfinished:
                self.abort(request_id)
            for request_id in request_ids:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._drain_inbox() and self._observer is not None:
                    self._observer.on_step(self.engine, [], self._timings)  # gauges after aborts
                self._flush_events()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self._step()
        except BaseException as exc:  # the loop must tell every waiter, whatever happened
            log.exception("engine loop crashed")
            self._crash = exc
        finally:
            self._fail_all(EngineShutDown(f"the engine stopped: {self._crash!r}" if self._crash else
                                          "the worker is shutting down"))
        if self._crash is not None and self.on_crash is not None:
            self.on_crash()

    def _drain_inbox(self) -> bool:
        """Apply queued adds and aborts; True if there were any."""
        handled = False
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return handled
            handled = True
            if command[0] == "add":
                self._add(*command[1:])
            else:
                output = self.engine.abort(command[1])
                self._timings.pop(command[1], None)
                if output is not None:
                    self._deliver(output)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
             timing: RequestTiming | None) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority)
        except ValueError as exc:
            self._deliver_to(request_id, exc)
            return
        now = self.clock()
        timing = timing if timing is not None else RequestTiming(arrival_s=now)
        timing.queued_s = now
        timing.max_tokens = params.max_tokens
        self._timings[request_id] = timing

    def _step(self) -> None:
        step_start_s = self.clock()
        try:
            outputs = self.engine.step()
        except StepFailed as failure:
            self._fail_step(failure)
            return
        self._num_failed_steps_in_a_row = 0
        now = self.clock()
        for output in outputs:
            self._record_timing(output, step_start_s, now)
        if self._observer is not None:
            self._observer.on_step(self.engine, outputs, self._timings)
        for output in outputs:
            if output.finished:
                self._timings.pop(output.request_id, None)
            self._deliver(output)
        self._flush_events()

    def _fail_step(self, failure: StepFailed) -> None:
        """Fail the requests of a failed step; raise EngineCrashed after too many failures in a row."""
        log.error("engine step failed; failing its %d requests", len(failure.request_ids), exc_info=failure.cause)
        self._num_failed_steps_in_a_row += 1
        for request_id in failure.request_ids:
            self._timings.pop(request_id, None)
            self._deliver_to(request_id, RequestFailed(str(failure)))
        if self._observer is not None:
            self._observer.on_step(self.engine, [], self._timings)  # gauges: the failed requests are gone
        self._flush_events()
        if self._num_failed_steps_in_a_row >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineCrashed(f"{self._num_failed_steps_in_a_row} engine steps failed in a row") from failure

    def _flush_events(self) -> None:
        """One KV-event batch per step (and per burst of aborts between steps)."""
        if self._events:
            if self._publisher is not None:
                self._publisher.publish(list(self._events))
            self._events.clear()

    def _record_timing(self, output: RequestOutput, step_start_s: float, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None or not output.new_token_ids:
            return
        if timing.first_token_s is None:
            timing.first_step_s = step_start_s
            timing.first_token_s = now
        else:
            timing.token_gaps_s.append(now - (timing.last_token_s or now))
        timing.last_token_s = now

    def _deliver(self, output: RequestOutput) -> None:
        self._deliver_to(output.request_id, output)

    def _deliver_to(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver_to(request_id, error)
