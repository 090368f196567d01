"""The routing ticket: one request's ranked candidates, predictions and load, from route() to its end.

    route() --> ROUTED --dispatched(w)--> SENT --first_token()--> STREAMING
                  ^                        |                        |
                  +---- attempt_failed() --+------------------------+
    any state --finished(usage) | failed(reason)--> ENDED  (exactly one takes effect)

A request may take several attempts (a retry before the first token, a failover mid-stream);
each is dispatched, and ends either by attempt_failed() (the next attempt follows) or with the
request. An attempt that never produced a first token did not compute the prompt, so the cache
its routing predicted on that worker is withdrawn. The closed loop (predicted vs reported cached
tokens) counts a request served in one attempt by the worker it was routed to.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.kv_index import KvIndex
from router.load_view import InFlight, LoadView, WorkerLoad
from router.types import RouteDecision, WorkerSpec


@dataclass(slots=True)
class ClosedLoopStats:
    """Predicted vs reported cached tokens; prediction_hit_ratio = sum(min(p, r)) / sum(p)."""

    outcomes: int = 0
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    confirmed_cached_tokens: int = 0

    def record(self, predicted_cached_tokens: int, reported_cached_tokens: int) -> None:
        self.outcomes += 1
        self.predicted_cached_tokens += predicted_cached_tokens
        self.reported_cached_tokens += reported_cached_tokens
        self.confirmed_cached_tokens += min(predicted_cached_tokens, reported_cached_tokens)

    @property
    def prediction_hit_ratio(self) -> float | None:
        if not self.predicted_cached_tokens:
            return None
        return self.confirmed_cached_tokens / self.predicted_cached_tokens


@dataclass(slots=True)  # built per request: not frozen (its __init__ would cost ~3x); never changed once built
class Prediction:
    """What route() recorded as predicted cache on the chosen worker: the prompt's keys, of which
    the first num_held were already known there (this request added the rest), and their expiry;
    withdrawn if that worker does not serve the request."""

    worker_id: str
    keys: Sequence[int]
    num_held: int
    expiry: float | None


@dataclass(frozen=True, slots=True)
class TicketBooks:
    """The router's state a ticket updates; built once by the router and shared by its tickets."""

    load: LoadView
    index: KvIndex
    pools: Mapping[str, Sequence[WorkerSpec]]  # for the pool's median prefill rate
    closed_loop: dict[str, ClosedLoopStats]  # per pool


ROUTED, SENT, STREAMING, ENDED = "routed", "sent", "streaming", "ended"


@dataclass(slots=True)
class RouteTicket:
    """The one handle on a routed request (see the module docstring for its states).

    cached_tokens_at(worker) is the prefix the router expected that worker to hold when it routed
    the request; a dispatch queues only the rest as prefill work.
    """

    decision: RouteDecision
    books: TicketBooks
    cached_tokens_at: Callable[[str], int]
    prediction: Prediction | None = None
    state: str = ROUTED
    outcome: str | None = None  # "finished" or the reason given to failed()
    attempts: int = 0
    worker_id: str | None = None  # the current (or last) attempt's worker
    queue_delay_s: float | None = None  # the last first token's wait at the worker beyond its own prefill
    _flight: InFlight | None = field(default=None, repr=False)

    @property
    def candidates(self) -> tuple[str, ...]:
        """Workers in the order to try them."""
        return self.decision.worker_ids

    def dispatched(self, worker_id: str) -> None:
        """An attempt on worker_id begins (the first, a retry or a mid-stream continuation)."""
        if self.state == ENDED:
            return
        if self.state != ROUTED:
            self.attempt_failed()
        prompt_tokens = self.decision.num_prompt_tokens or 0
        prefill = max(0, prompt_tokens - self.cached_tokens_at(worker_id))
        self._flight = self.books.load.on_dispatch(worker_id, prefill)
        self.worker_id, self.state = worker_id, SENT
        self.attempts += 1

    def first_token(self) -> float | None:
        """The attempt's first token arrived. Returns the seconds it was expected to take: the
        prefill work it waited for (queued ahead at dispatch plus its own uncached tokens) at the
        median measured prefill rate of its pool. A worker busy with long prompts meets that; a
        sick one falls behind it (the gateway's slow-worker ejection compares workers on it).
        Sets queue_delay_s: the wait beyond computing its own uncached prompt at that rate, the
        congestion signal of the pool's admission limit."""
        if self.state != SENT or self._flight is None:
            return None
        self.state = STREAMING
        prediction = self.prediction
        if prediction is not None and prediction.worker_id == self.worker_id:  # its prompt is computed there now
            self.books.index.prediction_landed(prediction.worker_id, prediction.keys)
        flight = self._flight
        rates = self._pool_prefill_rates()  # before the sample below moves this worker's rate
        work_tokens = self.books.load.on_first_token(flight)
        if work_tokens is None or not rates or flight.first_token_at is None:
            return None
        rate = statistics.median(rates)
        waited_s = flight.first_token_at - flight.dispatched_at
        self.queue_delay_s = max(0.0, waited_s - flight.prefill_tokens / rate)
        return work_tokens / rate

    def attempt_failed(self) -> None:
        """The current attempt ended without finishing the request; another may follow."""
        if self.state in (SENT, STREAMING):
            self._end_attempt(output_tokens=0)
            self.state = ROUTED

    def finished(self, usage: Mapping[str, Any] | None) -> None:
        """The request completed; usage is the final attempt's (OpenAI usage object, or None)."""
        if self.state == ENDED:
            return
        usage = usage or {}
        served_in_one = self.attempts == 1 and self.state == STREAMING
        self._end_attempt(output_tokens=usage.get("completion_tokens") or 0)
        self._release_prediction()
        self.state, self.outcome = ENDED, "finished"
        predicted = self.decision.predicted_cached_tokens
        if served_in_one and predicted is not None and self.worker_id == self.decision.worker_id:
            reported = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.books.closed_loop.setdefault(self.decision.pool or "", ClosedLoopStats()).record(predicted, reported)

    def failed(self, reason: str) -> None:
        """The request ended without an answer (no worker could serve it, the client left, ...)."""
        if self.state == ENDED:
            return
        self._end_attempt(output_tokens=0)
        self._release_prediction()
        self.state, self.outcome = ENDED, reason

    def _end_attempt(self, output_tokens: int) -> None:
        flight, self._flight = self._flight, None
        if flight is None:
            return
        if flight.first_token_at is None:  # the worker never computed the prompt: its prediction goes
            self._withdraw_prediction()
        self.books.load.on_finish(flight, output_tokens)

    def _release_prediction(self) -> None:
        """The request is over: the blocks its routing counted on are free at the chosen worker."""
        if self.prediction is not None:
            self.books.index.release(self.prediction.worker_id, self.prediction.keys)

    def _withdraw_prediction(self) -> None:
        prediction = self.prediction
        if prediction is not None and prediction.worker_id == self.worker_id and prediction.expiry is not None:
            added = prediction.keys[prediction.num_held:]
            self.books.index.withdraw_prediction(prediction.worker_id, added, prediction.expiry)

    def _pool_prefill_rates(self) -> list[float]:
        loads: Mapping[str, WorkerLoad] = self.books.load.loads
        specs = self.books.pools.get(self.decision.pool or "", ())
        return [loads[s.worker_id].prefill_tokens_per_s for s in specs if s.worker_id in loads]
