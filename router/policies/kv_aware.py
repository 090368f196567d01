"""kv_aware (default): minimise predicted time to first token, with a hot-spot guard."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from router.policies.base import check_number, load_bound
from router.types import Candidate, RouteDecision, RouteRequest, WorkerView


@dataclass(frozen=True, slots=True)
class KvAwareParams:
    """Weights of the TTFT model and the hot-spot guard; see KvAware for the formula."""

    slack: float = 0.5
    session_slack: float = 1.0
    recompute_weight: float = 1.0
    home_weight: float = 1.0
    evicted_home_weight: float = 10.0
    placement_slack: float = 1.0
    hot_min_requests: int = 8
    pool_prefill_rate: bool = True
    max_requests_per_worker: int | None = None
    predicted_weight: float = 1.0
    kv_pressure_penalty_s: float = 1.0
    queue_penalty_s: float = 0.05
    decode_penalty_s: float = 0.002
    tie_tolerance_s: float = 0.001
    prediction_ttl_s: float = 10.0
    explain_top_k: int = 4

    def __post_init__(self) -> None:
        check_number("slack", self.slack, minimum=0)
        check_number("session_slack", self.session_slack, minimum=0)
        check_number("recompute_weight", self.recompute_weight, minimum=0)
        check_number("home_weight", self.home_weight, minimum=0)
        check_number("evicted_home_weight", self.evicted_home_weight, minimum=0)
        check_number("placement_slack", self.placement_slack, minimum=0)
        check_number("hot_min_requests", self.hot_min_requests, minimum=1, integer=True)
        if not isinstance(self.pool_prefill_rate, bool):
            raise ValueError(f"pool_prefill_rate: must be true or false, got {self.pool_prefill_rate!r}")
        check_number("max_requests_per_worker", self.max_requests_per_worker, minimum=1, integer=True, optional=True)
        check_number("predicted_weight", self.predicted_weight, minimum=0, maximum=1)
        check_number("kv_pressure_penalty_s", self.kv_pressure_penalty_s, minimum=0)
        check_number("queue_penalty_s", self.queue_penalty_s, minimum=0)
        check_number("decode_penalty_s", self.decode_penalty_s, minimum=0)
        check_number("tie_tolerance_s", self.tie_tolerance_s, minimum=0)
        check_number("prediction_ttl_s", self.prediction_ttl_s, above=0)
        check_number("explain_top_k", self.explain_top_k, minimum=0, integer=True)


class KvAware:
    """score_s = (prefill_tokens_queued + uncached_tokens) / prefill_tokens_per_s
               + recompute_weight * uncached_tokens / prefill_tokens_per_s
               + home_weight * uncached_tokens / prefill_tokens_per_s   (not the prompt's home; where no
                 candidate holds any of the prompt, evicted_home_weight instead)
               + kv_pressure_penalty_s * min(1, max(0, new_blocks - free_blocks) / new_blocks)
               + queue_penalty_s * waiting_requests + decode_penalty_s * decode_seqs_running

    cached = max(confirmed_blocks, predicted_weight * predicted_blocks) * block_size, capped at
    the prompt; uncached_tokens = prompt - cached. The first term is the request's own predicted
    TTFT; the second charges the prefill it adds to the fleet (it delays every later request on
    that worker and duplicates a prefix another worker may hold), so a worker already computing
    or holding the prefix keeps winning until its queue is longer than another's by more than
    (1 + recompute_weight) times the recompute. The third keeps a prefix on its home, the worker a
    prompt sharing it went to last (router/placements.py: remembered after the caches and the
    index have forgotten it), when the home is a candidate: without it, a prefix evicted everywhere
    would be placed by load alone, and over time each worker's cache would hold copies of every
    warm prefix, which a fleet whose caches cannot hold them all pays for in evictions. A prefix
    evicted everywhere is held home the hardest (evicted_home_weight): nothing cached anywhere favours
    another worker, and where it lands now decides which cache holds it, and what it evicts, for its
    next prompts; a queue is gone in a few requests' time. The default sends it home unless the queue
    there is longer by about ten times its prefill (the hot-spot guard still spreads a hot worker's).
    The fourth charges a request whose blocks do not fit: new_blocks = its uncached prompt in
    blocks plus one for its output; free_blocks = what the worker can allocate without waiting
    (WorkerView.free_blocks: capacity less the blocks its running requests hold, by the scraped
    KV usage; no charge where the capacity is unknown). An engine holds such a request
    back until running requests free blocks, or preempts one; a worker whose cache is nearly full
    but which holds the prompt's prefix (few new blocks) is not charged: a full cache is the usual
    state of a busy fleet, and charging by usage alone pushed prompts off the worker that held them.
    A new prefix (no candidate holds or is predicted to hold any of the prompt, and it has no home
    among them), and a conversation's first turn (RouteRequest.starts_session: it has no home, even
    where a worker holds its system prompt), goes, among the workers whose score is within
    placement_slack times the prompt's own prefill of the best, to the one fewest recent prefixes and
    conversations call home (RouteRequest.prefixes_per_worker): where it lands, its later prompts
    follow, so a load snapshot (or the worker that holds the shared system prompt) would split the
    prefixes and conversations (and with them the caches' contents and the load) by chance.
    Hot-spot guard: a worker with requests + 1 > max(ceil((1 + slack) * (total + 1) / n),
    hot_min_requests), or >= max_requests_per_worker (the floor keeps a lightly loaded fleet from
    scattering prefixes), ranks after every other worker whatever it holds, so a hot prefix spreads.
    A conversation is the exception: for a request with a session id, a hot worker holding more of
    its prompt than every worker under the bound (its history lives only there) is held to the wider
    bound of session_slack instead, since moving it would recompute the whole history elsewhere and
    move the load rather than spread a shared prefix; its queue still counts in the score. Among
    workers within tie_tolerance_s of the best score, two are sampled and the less loaded wins
    (power of two).

    prefill_tokens_per_s is each worker's measured rate, or with pool_prefill_rate (default) the
    median over the candidates: one noisy sample then can't make a worker of an identical pool look
    fast (and attract everything) or slow (and never be sampled again).

    The chosen worker's prompt keys are remembered as predicted for prediction_ttl_s: long enough
    to cover a queued prefill, after which the worker's KV events confirm (or remove) them.
    """

    name = "kv_aware"

    def __init__(self, params: KvAwareParams = KvAwareParams(), *, rng: random.Random | None = None) -> None:
        self.params = params
        self.prediction_ttl_s = params.prediction_ttl_s
        self._rng = rng or random.Random()

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision:
        scores, ttfts, cached, loads = self._scores(req, workers)
        hot, kept = self._hot(req, loads, cached)
        order = _rank(scores, hot)
        placed = self._place_new_prefix(req, workers, order, scores, hot, cached)
        placed_note = None
        if placed is None:
            order = self._break_tie(order, loads, scores, hot)
        else:
            order = [placed, *(i for i in order if i != placed)]
            placed_note = f"new {'session' if req.starts_session else 'prefix'}: fewest placed here"
        ranked_ids = tuple([workers[i].worker_id for i in order])
        explanation = tuple(
            Candidate(
                workers[i].worker_id,
                cached[i],
                loads[i],
                ttfts[i] * 1000.0,
                "hot: over load bound" if hot[i] else "session: holds its history" if kept[i]
                else placed_note if i == placed else None,
            )
            for i in order[: self.params.explain_top_k]
        )
        return RouteDecision(self.name, ranked_ids, explanation)

    def _place_new_prefix(self, req: RouteRequest, workers: Sequence[WorkerView], order: list[int],
                          scores: list[float], hot: list[bool], cached: list[int]) -> int | None:
        """For a new prefix or a conversation's first turn: the worker, among those scoring within
        placement_slack x its own prefill of the best, that the fewest recent prefixes call home
        (ties: the better score); None for any other request, or when no other worker is that close."""
        p, counts = self.params, req.prefixes_per_worker
        if not p.placement_slack or counts is None or not req.block_keys:
            return None
        if any(cached) and not req.starts_session:
            return None
        if req.home_worker is not None and any(w.worker_id == req.home_worker for w in workers):
            return None
        best = order[0]
        rate = statistics.median([w.load.prefill_tokens_per_s for w in workers])
        limit = scores[best] + p.placement_slack * (req.num_prompt_tokens or 0) / rate
        close = [i for i in order if hot[i] == hot[best] and scores[i] <= limit]
        if len(close) < 2:
            return None
        return min(close, key=lambda i: counts.get(workers[i].worker_id, 0))  # close is in score order

    def _scores(
        self, req: RouteRequest, workers: Sequence[WorkerView]
    ) -> tuple[list[float], list[float], list[int], list[int]]:
        """Per worker: the score, the predicted TTFT alone (first term, for the explanation), cached
        blocks and requests (WorkerLoad.num_requests): one pass over the candidates for the first
        three (the hot loop of a decision: WorkerView unpacked, appends bound), one for requests."""
        p = self.params
        prompt_tokens = req.num_prompt_tokens or 0
        kv_pressure_penalty_s = p.kv_pressure_penalty_s
        recompute_weight, predicted_weight = p.recompute_weight, p.predicted_weight
        home = req.home_worker if p.home_weight or p.evicted_home_weight else None
        if home is not None and not any(worker.worker_id == home for worker in workers):
            home = None  # gone, failed or out of rotation: no candidate is favoured
        away_weight = recompute_weight + (p.home_weight if home is None or _held_anywhere(workers, predicted_weight)
                                          else p.evicted_home_weight)
        queue_penalty_s, decode_penalty_s = p.queue_penalty_s, p.decode_penalty_s
        shared_rate = statistics.median([w.load.prefill_tokens_per_s for w in workers]) if p.pool_prefill_rate else None
        scores: list[float] = []
        ttfts: list[float] = []
        cached_blocks: list[int] = []
        requests = [worker.load.num_requests for worker in workers]
        add_score, add_ttft, add_cached = scores.append, ttfts.append, cached_blocks.append
        for worker_id, load, block_size, blocks, predicted, free_blocks in workers:  # WorkerView's fields, unpacked
            if predicted:
                predicted = int(predicted_weight * predicted)
                if predicted > blocks:
                    blocks = predicted
            cached_tokens = blocks * block_size
            uncached = prompt_tokens - cached_tokens if cached_tokens < prompt_tokens else 0
            rate = shared_rate or load.prefill_tokens_per_s
            ttft = (load.prefill_tokens_queued + uncached) / rate
            away = home is not None and worker_id != home
            score = ttft + (away_weight if away else recompute_weight) * uncached / rate
            if free_blocks is not None:
                new_blocks = -(-uncached // block_size) + 1
                if new_blocks > free_blocks:
                    score += kv_pressure_penalty_s * min(1.0, (new_blocks - free_blocks) / new_blocks)
            if load.scraped_waiting_requests:
                score += queue_penalty_s * load.scraped_waiting_requests
            if load.decode_seqs_running:
                score += decode_penalty_s * load.decode_seqs_running
            add_score(score)
            add_ttft(ttft)
            add_cached(blocks)
        return scores, ttfts, cached_blocks, requests

    def _hot(self, req: RouteRequest, loads: list[int], cached: list[int]) -> tuple[list[bool], list[bool]]:
        """Per worker: over the load bound (ranks last); kept under the wider session bound instead."""
        p = self.params
        bound = self._bound(loads, p.slack)
        hot = [load + 1 > bound for load in loads]
        kept = [False] * len(loads)
        if req.session_id and any(hot) and p.session_slack > p.slack:
            wide = self._bound(loads, p.session_slack)
            best_cool = max((c for c, h in zip(cached, hot) if not h), default=0)
            for i, load in enumerate(loads):
                if hot[i] and cached[i] > best_cool and load + 1 <= wide:
                    hot[i], kept[i] = False, True
        return hot, kept

    def _bound(self, loads: list[int], slack: float) -> int:
        bound = max(load_bound(sum(loads), len(loads), slack), self.params.hot_min_requests)
        cap = self.params.max_requests_per_worker
        return bound if cap is None else min(bound, cap)

    def _break_tie(self, order: list[int], loads: list[int], scores: list[float], hot: list[bool]) -> list[int]:
        """order is sorted by (hot, score): the tied workers are a prefix of it."""
        best = order[0]
        limit, best_hot = scores[best] + self.params.tie_tolerance_s, hot[best]
        tied = []
        for i in order:
            if hot[i] != best_hot or scores[i] > limit:
                break
            tied.append(i)
        if len(tied) < 2:
            return order
        a, b = self._rng.sample(tied, 2)
        winner = b if loads[b] < loads[a] else a
        return [winner, *(i for i in order if i != winner)]


def _held_anywhere(workers: Sequence[WorkerView], predicted_weight: float) -> bool:
    """Whether some candidate holds, or is predicted to hold, a block of the prompt (as _scores counts it)."""
    return any(view.confirmed_blocks or int(predicted_weight * view.predicted_blocks) for view in workers)


def _rank(scores: list[float], hot: list[bool]) -> list[int]:
    """Indices sorted by (hot, score): every worker under the bound first."""
    by_score = scores.__getitem__
    if not any(hot):
        return sorted(range(len(scores)), key=by_score)
    return sorted((i for i, h in enumerate(hot) if not h), key=by_score) + sorted(
        (i for i, h in enumerate(hot) if h), key=by_score
    )

