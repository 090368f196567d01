"""Per-worker load: counted at dispatch/first token/finish, plus scraped metrics and EWMA rates."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadPriors:
    """Starting rates before anything is measured, and the EWMA weight of each new sample (the
    first samples are averaged instead, so a prior far from the worker's real rate goes at once).

    min_rate_sample_tokens: a prefill-rate sample needs at least this many tokens of prefill work
    (its own plus those queued ahead of it); smaller ones mostly measure the per-step overhead.
    """

    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 40.0
    ewma_alpha: float = 0.2
    min_rate_sample_tokens: int = 512

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("load.prefill_tokens_per_s must be > 0")
        if self.decode_tokens_per_s <= 0:
            raise ValueError("load.decode_tokens_per_s must be > 0")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError("load.ewma_alpha must be in (0, 1]")
        if self.min_rate_sample_tokens < 1:
            raise ValueError("load.min_rate_sample_tokens must be >= 1")


@dataclass(slots=True)
class WorkerLoad:
    """One worker's live load record (mutated by LoadView; policies only read it).

    decode_tokens_per_s is per running sequence. num_requests = max(our in-flight count, scraped
    waiting + running): other gateways' requests count too. It is a stored field, not a property
    (policies read it for every candidate of every decision), so whatever changes the request
    counts calls count_requests() after.

    The scraped counts are a snapshot up to a scrape interval old; our own requests move them on
    in between (a first token takes one from waiting to running, a finish takes one off), so a
    request that has just finished does not keep its worker looking busy until the next scrape.
    The scraped KV usage moves with the running count, each running request taken to hold an equal
    share of the blocks in use: a worker whose cache was full at the scrape does not look full (and
    repel every request) for a whole interval after its requests have finished.
    """

    in_flight_requests: int = 0
    prefill_tokens_queued: int = 0
    decode_seqs_running: int = 0
    # what other gateway replicas told of their own requests here (included in the three above)
    peer_in_flight_requests: int = 0
    peer_prefill_tokens_queued: int = 0
    peer_decode_seqs_running: int = 0
    scraped_waiting_requests: int | None = None
    scraped_running_requests: int | None = None
    kv_usage_frac: float | None = None
    prefill_tokens_per_s: float = 8_000.0
    decode_tokens_per_s: float = 40.0
    prefill_samples: int = 0  # rate samples taken so far (the prior counts for nothing once there is one)
    decode_samples: int = 0
    num_requests: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.count_requests()

    def count_requests(self) -> None:
        scraped = (self.scraped_waiting_requests or 0) + (self.scraped_running_requests or 0)
        self.num_requests = max(self.in_flight_requests, scraped)


@dataclass(slots=True)
class InFlight:
    """One dispatched attempt's share of its worker's load. The caller holds it (a routing ticket)
    and hands it back at the first token and at the end; the view keeps no table of requests."""

    load: WorkerLoad
    prefill_tokens: int
    dispatched_at: float
    tokens_ahead: int = 0
    first_token_at: float | None = None
    finished: bool = False


PeerLoad = tuple[int, int, int]
"""A replica's own requests at one worker: (in flight, uncached prefill tokens queued, decodes running)."""


class LoadView:
    """Load per worker, updated the moment a request is dispatched and as it progresses, plus what
    other gateway replicas report of their own requests (set_peer_load): each replica's latest
    report is added in until it sends another, or until expire_peers() finds it too old."""

    def __init__(self, priors: LoadPriors = LoadPriors(), clock: Callable[[], float] = time.monotonic) -> None:
        self.priors = priors
        self._clock = clock
        self._loads: dict[str, WorkerLoad] = {}
        self._peers: dict[str, tuple[float, dict[str, PeerLoad]]] = {}  # replica -> (received at, its report)

    def add_worker(self, worker_id: str) -> WorkerLoad:
        load = WorkerLoad(
            prefill_tokens_per_s=self.priors.prefill_tokens_per_s,
            decode_tokens_per_s=self.priors.decode_tokens_per_s,
        )
        return self._loads.setdefault(worker_id, load)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker; attempts still in flight on it end without touching any live record."""
        self._loads.pop(worker_id, None)
        for _, report in self._peers.values():
            report.pop(worker_id, None)

    # -- other replicas' requests ----------------------------------------------------------------

    def own_load(self) -> dict[str, PeerLoad]:
        """This view's own requests per worker (what peers add in taken out), for the other replicas."""
        return {worker_id: (load.in_flight_requests - load.peer_in_flight_requests,
                            load.prefill_tokens_queued - load.peer_prefill_tokens_queued,
                            load.decode_seqs_running - load.peer_decode_seqs_running)
                for worker_id, load in self._loads.items()}

    def set_peer_load(self, replica: str, report: Mapping[str, PeerLoad]) -> None:
        """Replica's latest report of its own requests (workers it does not name: none): it replaces
        that replica's last report in every worker's load."""
        _, before = self._peers.get(replica, (0.0, {}))
        known = {w: tuple(counts) for w, counts in report.items() if w in self._loads}
        for worker_id in before.keys() | known.keys():
            old, new = before.get(worker_id, (0, 0, 0)), known.get(worker_id, (0, 0, 0))
            if old != new:
                self._add_peer(self._loads[worker_id], new[0] - old[0], new[1] - old[1], new[2] - old[2])
        if known:
            self._peers[replica] = (self._clock(), known)
        else:
            self._peers.pop(replica, None)

    def expire_peers(self, max_age_s: float) -> None:
        """Take out the reports of replicas silent for longer than max_age_s (stopped, or cut off)."""
        cutoff = self._clock() - max_age_s
        for replica in [r for r, (received, _) in self._peers.items() if received < cutoff]:
            self.set_peer_load(replica, {})

    @staticmethod
    def _add_peer(load: WorkerLoad, in_flight: int, prefill_tokens: int, decodes: int) -> None:
        load.in_flight_requests += in_flight
        load.peer_in_flight_requests += in_flight
        load.prefill_tokens_queued += prefill_tokens
        load.peer_prefill_tokens_queued += prefill_tokens
        load.decode_seqs_running += decodes
        load.peer_decode_seqs_running += decodes
        load.count_requests()

    def get(self, worker_id: str) -> WorkerLoad:
        return self._loads.get(worker_id) or self.add_worker(worker_id)

    @property
    def loads(self) -> Mapping[str, WorkerLoad]:
        """Every added worker's live record (read-only: change them through this class)."""
        return self._loads

    def on_dispatch(self, worker_id: str, prefill_tokens: int) -> InFlight:
        """A request was sent: prefill_tokens (uncached prompt tokens) join the worker's queue."""
        load = self.get(worker_id)
        ahead = max(0, load.prefill_tokens_queued)
        load.in_flight_requests += 1
        load.count_requests()
        load.prefill_tokens_queued += prefill_tokens
        return InFlight(load, prefill_tokens, self._clock(), ahead)

    def on_first_token(self, flight: InFlight) -> int | None:
        """Prefill done: tokens leave the queue, a decode starts; the prefill rate is sampled.

        sample = (tokens queued ahead at dispatch + own prefill tokens) / time to first token: the
        request waited for the work ahead of it, so its own tokens alone would under-read the rate.
        Returns that work in tokens (None for a repeated call or a finished attempt).
        """
        if flight.first_token_at is not None or flight.finished:
            return None
        now = flight.first_token_at = self._clock()
        load = flight.load
        load.prefill_tokens_queued -= flight.prefill_tokens
        load.decode_seqs_running += 1
        if load.scraped_waiting_requests:
            load.scraped_waiting_requests -= 1
        if load.scraped_running_requests is not None:
            _move_kv_usage(load, load.scraped_running_requests + 1)
            load.scraped_running_requests += 1
        elapsed_s = now - flight.dispatched_at
        work = flight.tokens_ahead + flight.prefill_tokens
        if flight.prefill_tokens > 0 and work >= self.priors.min_rate_sample_tokens and elapsed_s > 0:
            load.prefill_tokens_per_s = self._ewma(load.prefill_tokens_per_s, work / elapsed_s, load.prefill_samples)
            load.prefill_samples += 1
        return work

    def on_finish(self, flight: InFlight, output_tokens: int = 0) -> None:
        """The attempt ended (any outcome): release its load; sample the per-sequence decode rate.
        A second call for the same attempt does nothing."""
        if flight.finished:
            return
        flight.finished = True
        load = flight.load
        load.in_flight_requests -= 1
        if flight.first_token_at is None:
            if load.scraped_waiting_requests:
                load.scraped_waiting_requests -= 1
            load.count_requests()
            load.prefill_tokens_queued -= flight.prefill_tokens
            return
        if load.scraped_running_requests:
            _move_kv_usage(load, load.scraped_running_requests - 1)
            load.scraped_running_requests -= 1
        load.count_requests()
        load.decode_seqs_running -= 1
        elapsed_s = self._clock() - flight.first_token_at
        if output_tokens > 1 and elapsed_s > 0:
            sample = (output_tokens - 1) / elapsed_s
            load.decode_tokens_per_s = self._ewma(load.decode_tokens_per_s, sample, load.decode_samples)
            load.decode_samples += 1

    def set_scraped(
        self,
        worker_id: str,
        *,
        waiting_requests: int | None = None,
        running_requests: int | None = None,
        kv_usage_frac: float | None = None,
    ) -> None:
        """Values read from the worker's /metrics (vllm:num_requests_waiting, ...); None = unknown."""
        if kv_usage_frac is not None and not 0 <= kv_usage_frac <= 1:
            raise ValueError("kv_usage_frac must be in [0, 1]")
        load = self.get(worker_id)
        load.scraped_waiting_requests = waiting_requests
        load.scraped_running_requests = running_requests
        load.count_requests()
        load.kv_usage_frac = kv_usage_frac

    def _ewma(self, current: float, sample: float, samples_before: int) -> float:
        """The running mean over the first samples (the first replaces the prior, which may be far off:
        a CPU worker prefills ~30x slower than the GPU-class default), then an EWMA of ewma_alpha."""
        alpha = max(self.priors.ewma_alpha, 1.0 / (samples_before + 1))
        return (1 - alpha) * current + alpha * sample


def _move_kv_usage(load: WorkerLoad, running: int) -> None:
    """The scraped KV usage scaled from the running count it was last moved with to running (an
    equal share of the blocks in use per running request; unknown at 0 running, so left as is)."""
    before = load.scraped_running_requests
    if load.kv_usage_frac and before:
        load.kv_usage_frac = min(1.0, load.kv_usage_frac * running / before)
