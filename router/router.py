"""The facade the gateway calls: pools, index, load view and tokenizers -> ranked decisions."""

from __future__ import annotations

import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from router.block_keys import PrefixKeyCache, model_seed, pack_tokens_u32le
from router.kv_index import KvIndex
from router.load_view import LoadView
from router.policies import build_policy
from router.policy_config import PolicyStore, RoutingPolicies, RoutingRule
from router.tokenization import RoutingTokenizer
from router.types import Policy, RouteDecision, RouteRequest, WorkerView


class NoRouteError(LookupError):
    """No rule matches the request, or neither its pool nor its fallback has a healthy worker."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker as configured: the model it serves, its KV block size and block count."""

    worker_id: str
    model: str
    block_size: int
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"workers.{self.worker_id}.block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"workers.{self.worker_id}.num_blocks must be >= 1")


@dataclass(slots=True)
class ClosedLoopStats:
    """Predicted vs reported cached tokens; prediction_hit_ratio = sum(min(p, r)) / sum(p)."""

    outcomes: int = 0
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    confirmed_cached_tokens: int = 0

    @property
    def prediction_hit_ratio(self) -> float | None:
        if not self.predicted_cached_tokens:
            return None
        return self.confirmed_cached_tokens / self.predicted_cached_tokens


class Router:
    """route() ranks a pool's healthy workers and remembers the choice as predicted cache."""

    def __init__(
        self,
        pools: Mapping[str, Sequence[WorkerSpec]],
        policies: PolicyStore | RoutingPolicies,
        *,
        tokenizers: Mapping[str, RoutingTokenizer] | None = None,
        index: KvIndex | None = None,
        load: LoadView | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        key_cache_entries: int = 256,
    ) -> None:
        """key_cache_entries: recent prompts whose block keys are kept, so the next turn of a
        conversation hashes only its new blocks (0 turns the cache off)."""
        self.index = index or KvIndex(clock=clock)
        self.key_cache = PrefixKeyCache(key_cache_entries)
        self.load = load or LoadView(clock=clock)
        self.closed_loop = ClosedLoopStats()
        self._policies = policies
        self._tokenizers = dict(tokenizers or {})
        self._approximate = RoutingTokenizer.approximate()
        self._rng = rng or random.Random()
        self._pools: dict[str, list[WorkerSpec]] = {}
        self._specs: dict[str, WorkerSpec] = {}
        self._pool_of: dict[str, str] = {}
        self._unhealthy: set[str] = set()
        # (pool, fallback, model) -> (pool chosen, its healthy specs); cleared on any fleet change
        self._candidate_cache: dict[tuple[str, str | None, str], tuple[str, list[WorkerSpec]]] = {}
        self._instances: dict[str, Policy] = {}
        self._instances_for: RoutingPolicies | None = None
        # request id -> (expected cached tokens per candidate, the prediction recorded for it)
        self._routes: OrderedDict[str, tuple[dict[str, int], tuple[str, tuple[int, ...], int, float | None]]] = OrderedDict()
        for pool, specs in pools.items():
            self._pools.setdefault(pool, [])
            for spec in specs:
                self.add_worker(pool, spec)

    # -- fleet -----------------------------------------------------------------------------------

    def add_worker(self, pool: str, spec: WorkerSpec) -> None:
        if spec.worker_id in self._specs:
            raise ValueError(f"worker {spec.worker_id!r} is already in a pool")
        self._pools.setdefault(pool, []).append(spec)
        self._specs[spec.worker_id] = spec
        self._pool_of[spec.worker_id] = pool
        self._candidate_cache.clear()
        self.index.add_worker(spec.worker_id, model_name=spec.model, max_blocks=spec.num_blocks)
        self.load.add_worker(spec.worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker everywhere at once (index entries, load, health)."""
        self._specs.pop(worker_id)
        self._pool_of.pop(worker_id)
        for specs in self._pools.values():
            specs[:] = [s for s in specs if s.worker_id != worker_id]
        self.index.remove_worker(worker_id)
        self.load.remove_worker(worker_id)
        self._unhealthy.discard(worker_id)
        self._candidate_cache.clear()

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        (self._unhealthy.discard if healthy else self._unhealthy.add)(worker_id)
        self._candidate_cache.clear()

    # -- routing ---------------------------------------------------------------------------------

    def route(self, req: RouteRequest) -> RouteDecision:
        """Tokenize, key, match, score: the ranked candidates, with the first recorded as predicted."""
        policies = self._current_policies()
        rule = policies.select(req)
        if rule is None:
            raise NoRouteError(f"no routing rule matches model={req.model!r} path={req.path!r}")
        pool, specs = self._candidates(rule, req.model)
        tokenizer = self._tokenizers.get(req.model, self._approximate)
        token_ids = self._tokenize(tokenizer, req)
        keys_by_size = self._keys_by_block_size(token_ids, req.model, {s.block_size for s in specs})
        matches = {size: self.index.match(keys) for size, keys in keys_by_size.items()}
        views = self._views(specs, matches)
        routed = _with_prompt(req, len(token_ids), keys_by_size[specs[0].block_size])
        policy = self._policy(rule)
        decision = policy.choose(routed, views)
        chosen = decision.worker_id
        block_size = self._specs[chosen].block_size
        confirmed, predicted = matches[block_size].get(chosen, _NOTHING_HELD)
        # a tuple of ints: the index keeps it until the prediction expires (seconds), and unlike a
        # list the collector stops tracking it, so these don't pile up as long-lived GC objects
        keys = tuple(keys_by_size[block_size])
        expiry = self.index.record_prediction(chosen, keys, getattr(policy, "prediction_ttl_s", None),
                                              num_predicted=predicted)
        self._remember_route(req.request_id, decision.worker_ids, matches, len(token_ids),
                             (chosen, keys, max(confirmed, predicted), expiry))
        return RouteDecision(
            decision.policy,
            decision.worker_ids,
            decision.explanation,
            rule=rule.name,
            pool=pool,
            num_prompt_tokens=len(token_ids),
            predicted_cached_tokens=_cacheable_tokens(max(confirmed, predicted), block_size, len(token_ids)),
            tokenizer_mode=tokenizer.mode,
        )

    def _current_policies(self) -> RoutingPolicies:
        source = self._policies
        return source.policies if isinstance(source, PolicyStore) else source

    def _policy(self, rule: RoutingRule) -> Policy:
        policies = self._current_policies()
        if self._instances_for is not policies:
            self._instances, self._instances_for = {}, policies
        policy = self._instances.get(rule.name)
        if policy is None:
            policy = self._instances[rule.name] = build_policy(rule.policy_type, rule.policy_params, self._rng)
        return policy

    def _candidates(self, rule: RoutingRule, model: str) -> tuple[str, list[WorkerSpec]]:
        cache_key = (rule.pool, rule.fallback_pool, model)
        cached = self._candidate_cache.get(cache_key)
        if cached is not None:
            return cached
        for pool in (rule.pool, rule.fallback_pool):
            if pool is None:
                continue
            specs = [
                s for s in self._pools.get(pool, ()) if s.model == model and s.worker_id not in self._unhealthy
            ]
            if specs:
                self._candidate_cache[cache_key] = (pool, specs)
                return pool, specs
        raise NoRouteError(f"rule {rule.name!r}: no healthy worker for model {model!r} in pool {rule.pool!r}"
                           + (f" or fallback {rule.fallback_pool!r}" if rule.fallback_pool else ""))

    @staticmethod
    def _tokenize(tokenizer: RoutingTokenizer, req: RouteRequest) -> list[int]:
        if req.messages is not None:
            return tokenizer.encode_chat(req.messages, tools=req.tools)
        return tokenizer.encode_prompt(req.prompt)  # type: ignore[arg-type]

    def _keys_by_block_size(self, token_ids: list[int], model: str, sizes: set[int]) -> dict[int, list[int]]:
        packed = pack_tokens_u32le(token_ids)
        seed = model_seed(model)
        return {size: self.key_cache.keys(packed, size, seed) for size in sizes}

    def _views(self, specs: list[WorkerSpec], matches: dict[int, dict[str, tuple[int, int]]]) -> list[WorkerView]:
        # every candidate was added to the load view with its spec; WorkerView(...) runs a Python __new__
        loads, new = self.load.loads, tuple.__new__
        return [new(WorkerView, (s.worker_id, loads[s.worker_id], s.block_size,
                                 *matches[s.block_size].get(s.worker_id, _NOTHING_HELD)))
                for s in specs]

    def _remember_route(
        self,
        request_id: str | None,
        ranked: Sequence[str],
        matches: dict[int, dict[str, tuple[int, int]]],
        num_prompt_tokens: int,
        prediction: tuple[str, tuple[int, ...], int, float | None],
    ) -> None:
        """Keep, until the request is dispatched (bounded LRU), the expected cached tokens of the first
        ranked candidates (those the gateway will try; any other worker counts as holding none) and
        the prediction recorded for it (worker, keys, how many it found held already, expiry)."""
        if not request_id:
            return
        cached = {}
        for worker_id in ranked[:_REMEMBERED_CANDIDATES]:
            block_size = self._specs[worker_id].block_size
            blocks = max(matches[block_size].get(worker_id, _NOTHING_HELD))
            if blocks:
                cached[worker_id] = _cacheable_tokens(blocks, block_size, num_prompt_tokens)
        self._routes[request_id] = (cached, prediction)
        while len(self._routes) > _MAX_REMEMBERED_ROUTES:
            self._routes.popitem(last=False)

    # -- load and outcome ------------------------------------------------------------------------

    def on_dispatch(self, worker_id: str, request_id: str, prefill_tokens: int) -> None:
        """The gateway sent request_id (the routed id, or `ID#attempt`) to worker_id with a prompt of prefill_tokens.

        The prefix the router expected worker_id to hold when it routed the request is taken off, so
        the load view queues only the tokens the worker must compute (the gateway passes the whole
        prompt; if it ever passes the uncached count itself, drop this subtraction).
        """
        route = self._routes.get(request_id) or self._routes.get(request_id.rpartition("#")[0])
        expected_cached = route[0].get(worker_id, 0) if route else 0
        self.load.on_dispatch(worker_id, request_id, max(0, prefill_tokens - expected_cached))

    def on_first_token(self, request_id: str) -> float | None:
        """Prefill done. Returns the seconds it was expected to take: the prefill work it waited for
        (queued ahead at dispatch plus its own uncached tokens) at the median measured prefill rate
        of its worker's pool. A worker busy with long prompts meets that; a sick one falls behind
        it, so the gateway's slow-worker ejection compares workers on latency relative to it. None
        for an unknown request."""
        pool = self._pool_of.get(self.load.worker_of(request_id) or "")
        loads = self.load.loads
        rates = [loads[spec.worker_id].prefill_tokens_per_s for spec in self._pools.get(pool or "", ())
                 if spec.worker_id in loads]
        work_tokens = self.load.on_first_token(request_id)  # samples this worker's rate: after the expectation
        if work_tokens is None or not rates:
            return None
        return work_tokens / statistics.median(rates)

    def on_finish(self, request_id: str, output_tokens: int = 0) -> None:
        self.load.on_finish(request_id, output_tokens)

    def withdraw_prediction(self, request_id: str, worker_id: str) -> None:
        """worker_id did not serve request_id (refused or failed it before the first token, or the
        client left): the blocks its routing predicted there are not coming."""
        route = self._routes.get(request_id)
        if route is None:
            return
        predicted_worker, keys, already_held, expiry = route[1]
        if predicted_worker == worker_id and expiry is not None:
            self.index.withdraw_prediction(worker_id, keys[already_held:], expiry)

    def record_outcome(self, predicted_cached_tokens: int, reported_cached_tokens: int) -> None:
        """Closed loop: what the router expected cached vs usage.prompt_tokens_details.cached_tokens."""
        stats = self.closed_loop
        stats.outcomes += 1
        stats.predicted_cached_tokens += predicted_cached_tokens
        stats.reported_cached_tokens += reported_cached_tokens
        stats.confirmed_cached_tokens += min(predicted_cached_tokens, reported_cached_tokens)


_MAX_REMEMBERED_ROUTES = 16_384
_REMEMBERED_CANDIDATES = 4  # the first attempt, its two retries and one mid-stream failover
_NOTHING_HELD = (0, 0)


def _with_prompt(req: RouteRequest, num_prompt_tokens: int, block_keys: Sequence[int]) -> RouteRequest:
    """req with the router's prompt facts (dataclasses.replace costs more than this per decision)."""
    return RouteRequest(req.model, req.messages, req.prompt, req.tools, req.request_id, req.tenant, req.priority,
                        req.session_id, req.headers, req.path, num_prompt_tokens, block_keys)


def _cacheable_tokens(cached_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Cached tokens a worker can report: full blocks, never the last prompt token (it is recomputed)."""
    if num_prompt_tokens < 1:
        return 0
    return min(cached_blocks * block_size, (num_prompt_tokens - 1) // block_size * block_size)
