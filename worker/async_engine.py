"""Runs the engine loop on its own thread and streams each request's outputs to asyncio callers.

The HTTP handlers live on the event loop; model math must not. Requests and aborts cross to the
engine thread through a queue; outputs cross back with call_soon_threadsafe. KV events gathered
during a step are handed to the publisher once per step (it never blocks).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol, Sequence

from worker.engine.engine import Engine, RequestOutput
from worker.engine.sampling_params import SamplingParams

log = logging.getLogger("kvgate.worker")


class StepObserver(Protocol):
    """Told about every step (metrics): the outputs, the request timings and the engine."""

    def on_step(self, engine: Engine, outputs: Sequence[RequestOutput], timings: dict[str, "RequestTiming"]) -> None: ...


class EventPublisher(Protocol):
    def publish(self, events: list) -> None: ...


@dataclass(slots=True)
class RequestTiming:
    """Wall-clock marks of one request, for latency metrics."""

    arrival_s: float
    first_step_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class EngineShutDown(RuntimeError):
    """The engine thread stopped (shutdown or a crash); no more requests are served."""


class AsyncEngine:
    """Thread-safe front of an Engine: `generate()` is an async iterator of RequestOutputs."""

    def __init__(self, engine: Engine, step_events: list | None = None, publisher: EventPublisher | None = None,
                 observer: StepObserver | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """step_events is the list the Engine's event_sink appends to; it is drained every step."""
        self.engine = engine
        self._events = step_events if step_events is not None else []
        self._publisher = publisher
        self._observer = observer
        self._clock = clock
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

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes; leaving early (disconnect) aborts it."""
        if not self.is_alive:
            raise EngineShutDown("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt_token_ids, params, priority))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
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

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority)
        except ValueError as exc:
            self._deliver_to(request_id, exc)
            return
        self._timings[request_id] = RequestTiming(arrival_s=self._clock())

    def _step(self) -> None:
        step_start_s = self._clock()
        outputs = self.engine.step()
        now = self._clock()
        for output in outputs:
            self._record_timing(output, step_start_s, now)
        if self._observer is not None:
            self._observer.on_step(self.engine, outputs, self._timings)
        for output in outputs:
            if output.finished:
                self._timings.pop(output.request_id, None)
            self._deliver(output)
        self._flush_events()

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
