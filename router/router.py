"""The facade the gateway calls: pools, rules, index, load view and tokenizers -> routing tickets.

route() answers with a RouteTicket (router/ticket.py), the request's one handle until it ends; the
gateway tells the router about its fleet (workers joining, leaving, failing, leaving rotation,
scraped load) and reads stats() for its metrics. The index and load view stay inside.

route() refuses, with a router.errors.RouteInputError (a ValueError), what it should not key: a
prompt longer than its pool's max_model_len (before tokenizing where the length is known or
bounded, always before hashing) and messages nested too deep. A tenant given a cache salt gets
block keys of its own (docs/architecture.md, "Cache isolation").
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from router.block_keys import PrefixKeyCache, model_seed, pack_tokens_u32le
from router.kv_index import IndexStats, KvIndex
from router.load_view import LoadView
from router.placements import Placements
from router.policies import build_policy
from router.rules import RoutingRule, RoutingRules
from router.slow_start import SlowStart
from router.subscriber import KvEventSubscriber
from router.ticket import ClosedLoopStats, Prediction, RouteTicket, TicketBooks
from router.tokenization import RoutingTokenizer, check_num_tokens
from router.types import Policy, RouteDecision, RouteRequest, WorkerSpec, WorkerView

log = logging.getLogger(__name__)


class NoRouteError(LookupError):
    """No rule matches the request, or neither its pool nor a fallback it may move to has a healthy worker."""


@dataclass(frozen=True, slots=True)
class PoolChoice:
    """A pool a request may be served by: its rule's own (reasons empty) or one of the rule's fallbacks, in
    order, with the reasons that may move the request there. model: the name its workers serve (the
    request's own in the rule's pool); available: it has a healthy worker for that model now."""

    pool: str
    model: str
    reasons: frozenset[str]
    available: bool


@dataclass(frozen=True, slots=True)
class RouterStats:
    """A snapshot for metrics: the closed loop per pool and the index's size."""

    closed_loop: Mapping[str, ClosedLoopStats]
    index: IndexStats
    in_flight: Mapping[str, int]  # this router's own requests in flight per worker (other replicas' left out)
    # per model with an exact tokenizer: prompts its prefix cache served from a text seen before, and
    # those tokenized whole (kvgate/text_prefix_cache.py; prompts too short to look up count in neither)
    tokenizer_prefix_cache: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # per worker: its share of new requests while it warms up after coming into rotation cold (1: warm)
    warm_up: Mapping[str, float] = field(default_factory=dict)

    @property
    def prediction_hit_ratio(self) -> float | None:
        """Over all pools: sum(min(predicted, reported)) / sum(predicted) cached tokens."""
        predicted = sum(s.predicted_cached_tokens for s in self.closed_loop.values())
        confirmed = sum(s.confirmed_cached_tokens for s in self.closed_loop.values())
        return confirmed / predicted if predicted else None


class Router:
    """route() ranks a pool's healthy workers and records the choice as predicted cache."""

    def __init__(
        self,
        pools: Mapping[str, Sequence[WorkerSpec]],
        rules: RoutingRules,
        *,
        tokenizers: Mapping[str, RoutingTokenizer] | None = None,
        index: KvIndex | None = None,
        load: LoadView | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        key_cache: PrefixKeyCache | None = None,
        max_model_lens: Mapping[str, int] | None = None,
        tenant_cache_salts: Mapping[str, str] | None = None,
        pool_models: Mapping[str, str] | None = None,
        slow_start_s: Mapping[str, float] | None = None,
    ) -> None:
        """key_cache: recent prompts whose block keys are kept, so the next turn of a conversation
        hashes only its new blocks (default: 256 prompts in 16 MiB). index, load, key_cache: given
        by tests and benchmarks that look inside; the gateway leaves them to the router.
        max_model_lens: pool -> the most prompt tokens its workers take (no limit for a pool not
        named). tenant_cache_salts: tenant -> cache salt, for tenants whose block keys are their own.
        pool_models: pool -> the model its workers serve, for a fallback pool (default: its workers' model).
        slow_start_s: pool -> how long a worker that comes into rotation cold takes to reach its full share
        (router/slow_start.py; start_warm_up() says it came in cold)."""
        self._index = index or KvIndex(clock=clock)
        self._load = load or LoadView(clock=clock)
        self._loads = self._load.loads  # the view's own dict (read per decision; the view changes it in place)
        self._key_cache = key_cache if key_cache is not None else PrefixKeyCache()
        self._placements = Placements()
        self._rules = rules
        self._tokenizers = dict(tokenizers or {})
        self._max_model_lens = dict(max_model_lens or {})
        self._cache_salts = dict(tenant_cache_salts or {})
        self._pool_models = dict(pool_models or {})
        self._approximate = RoutingTokenizer.approximate()
        self._rng = rng or random.Random()
        self._slow_start = SlowStart(slow_start_s, clock=clock, rng=self._rng)  # draws only while a worker warms
        self._pools: dict[str, list[WorkerSpec]] = {}
        self._specs: dict[str, WorkerSpec] = {}
        self._out_of_rotation: set[str] = set()
        # (pool, model) -> its healthy specs serving model, (rule, model) -> its pool choices; both cleared on
        # any fleet change (the choices on a rules change too)
        self._candidate_cache: dict[tuple[str, str], list[WorkerSpec]] = {}
        self._choice_cache: dict[tuple[str, str], tuple[PoolChoice, ...]] = {}
        self._instances: dict[tuple[str, str], Policy] = {}  # (rule, pool) -> its policy
        self._books = TicketBooks(self._load, self._index, self._pools, {})
        # told of every decision (worker, the prompt's block keys there, the prediction's TTL or None for
        # the index's): the gateway shares them with its peer replicas, which apply them with peer_routed()
        self.on_routed: Callable[[str, tuple[int, ...], float | None], None] | None = None
        for pool, specs in pools.items():
            self._pools.setdefault(pool, [])
            for spec in specs:
                self.worker_joined(pool, spec)
        # room for every block the workers say they hold, so the index does not grow under load
        self._index.reserve(sum(spec.num_blocks or 0 for spec in self._specs.values()))

    # -- fleet -----------------------------------------------------------------------------------

    def worker_joined(self, pool: str, spec: WorkerSpec) -> None:
        if spec.worker_id in self._specs:
            raise ValueError(f"worker {spec.worker_id!r} is already in a pool")
        self._pools.setdefault(pool, []).append(spec)
        self._specs[spec.worker_id] = spec
        self._candidate_cache.clear()
        self._choice_cache.clear()
        self._index.add_worker(spec.worker_id, model_name=spec.model, max_blocks=spec.num_blocks)
        self._load.add_worker(spec.worker_id)

    def worker_left(self, worker_id: str) -> None:
        """Forget a worker everywhere at once (index entries, load, rotation)."""
        self._specs.pop(worker_id)
        for specs in self._pools.values():
            specs[:] = [s for s in specs if s.worker_id != worker_id]
        self._index.remove_worker(worker_id)
        self._load.remove_worker(worker_id)
        self._placements.forget_worker(worker_id)
        self._out_of_rotation.discard(worker_id)
        self._slow_start.forget(worker_id)
        self._candidate_cache.clear()
        self._choice_cache.clear()

    def start_warm_up(self, worker_id: str) -> None:
        """worker_id came into rotation cold (new, restarted, back after failing): it ramps up to its full share."""
        spec = self._specs.get(worker_id)
        pool = next((name for name, specs in self._pools.items() if spec in specs), None)
        if pool is not None:
            self._slow_start.begin(worker_id, pool)

    def warm_up_shares(self) -> dict[str, float]:
        """Each warming worker's share of what the policy would give it now (1 once warm: left out)."""
        return self._slow_start.shares()

    def worker_failed(self, worker_id: str) -> None:
        """The worker failed (health checks or breaker): what its cache holds is unknown from now."""
        self._index.clear_worker(worker_id)

    def set_in_rotation(self, worker_id: str, in_rotation: bool) -> None:
        (self._out_of_rotation.discard if in_rotation else self._out_of_rotation.add)(worker_id)
        self._candidate_cache.clear()
        self._choice_cache.clear()

    def worker_cache_config(self, worker_id: str, *, num_blocks: int | None = None,
                            block_size: int | None = None) -> None:
        """What the worker says of its KV cache (e.g. vllm:cache_config_info), each None if unsaid.

        num_blocks is taken when the spec gave none: from then on the index models the worker's
        evictions (a configured capacity wins). block_size always wins over the spec's, which may
        be only the default: keys of another block size would never match the worker's events.
        Without a reported block size, the one its KV events carry is taken the same way."""
        spec = self._specs.get(worker_id)
        if spec is None:
            return
        block_size = block_size or self._index.event_block_size(worker_id)
        changes: dict[str, int] = {}
        if num_blocks is not None and num_blocks > 0 and spec.num_blocks is None:
            changes["num_blocks"] = num_blocks
        if block_size is not None and block_size > 0 and block_size != spec.block_size:
            log.warning("worker %s uses KV blocks of %d tokens, not %d as configured: routing keys follow the worker",
                        worker_id, block_size, spec.block_size)
            changes["block_size"] = block_size
        if not changes:
            return
        known = dataclasses.replace(spec, **changes)
        self._specs[worker_id] = known
        for specs in self._pools.values():
            specs[:] = [known if s.worker_id == worker_id else s for s in specs]
        self._candidate_cache.clear()
        self._choice_cache.clear()
        if "num_blocks" in changes:
            self._index.set_capacity(worker_id, num_blocks)

    def worker_load_scraped(self, worker_id: str, *, waiting_requests: int | None = None,
                            running_requests: int | None = None, kv_usage_frac: float | None = None) -> None:
        """Values read from the worker's /metrics (vllm:num_requests_waiting, ...); None = unknown."""
        self._load.set_scraped(worker_id, waiting_requests=waiting_requests, running_requests=running_requests,
                               kv_usage_frac=kv_usage_frac)

    def kv_event_subscriber(self, worker_id: str, endpoint: str, replay_endpoint: str | None) -> KvEventSubscriber:
        """A subscriber that applies worker_id's KV events to this router's index (start() it in a loop)."""
        return KvEventSubscriber(worker_id, self._index, endpoint, replay_endpoint=replay_endpoint)

    def set_rules(self, rules: RoutingRules) -> None:
        """New routing rules (a reloaded policy file); policies are built afresh for them."""
        self._rules = rules
        self._instances = {}
        self._choice_cache.clear()

    def stats(self) -> RouterStats:
        closed_loop = {pool: ClosedLoopStats(s.outcomes, s.predicted_cached_tokens, s.reported_cached_tokens,
                                             s.confirmed_cached_tokens)
                       for pool, s in self._books.closed_loop.items()}
        in_flight = {worker: own[0] for worker, own in self._load.own_load().items()}
        prefix_caches = {model: (t.prefix_cache.hits, t.prefix_cache.misses)
                         for model, t in self._tokenizers.items() if t.prefix_cache is not None}
        shares = self._slow_start.shares()
        warm_up = {worker: shares.get(worker, 1.0) for worker in self._specs}
        return RouterStats(closed_loop, self._index.stats(), in_flight, prefix_caches, warm_up)

    # -- routing ---------------------------------------------------------------------------------

    def pool_for(self, req: RouteRequest) -> str:
        """The pool route() would send req to now without a pool named: its rule's pool, or the first
        fallback that takes it when that pool is unavailable; NoRouteError when none has a healthy worker."""
        for choice in self.pool_choices(req):
            if choice.available and (not choice.reasons or "unavailable" in choice.reasons):
                return choice.pool
        raise self._unavailable(self._rule_for(req), req.model)

    def pool_choices(self, req: RouteRequest) -> tuple[PoolChoice, ...]:
        """req's rule's pool, then each of its fallbacks in order (without tokenizing): the gateway picks
        one at arrival (gateway/fallbacks.py). NoRouteError when no rule matches."""
        rule = self._rule_for(req)
        cache_key = (rule.name, req.model)
        cached = self._choice_cache.get(cache_key)
        if cached is not None:
            return cached
        choices = [PoolChoice(rule.pool, req.model, frozenset(), bool(self._candidates(rule.pool, req.model)))]
        for fallback in rule.fallbacks:
            model = self.pool_model(fallback.pool) or req.model
            choices.append(PoolChoice(fallback.pool, model, fallback.when, bool(self._candidates(fallback.pool, model))))
        self._choice_cache[cache_key] = found = tuple(choices)
        return found

    def pool_model(self, pool: str) -> str | None:
        """The model pool's workers serve (None for a pool unknown here with no worker yet)."""
        model = self._pool_models.get(pool)
        if model is None and self._pools.get(pool):
            model = self._pools[pool][0].model
        return model

    def tokenize(self, req: RouteRequest, pool: str) -> list[int]:
        """req's prompt as token ids, checked against pool's max_model_len (PromptTooLongError,
        InputTooDeepError): what route() does first, for a caller that runs it off its event loop.
        Safe beside route() in another thread: it reads only the model's tokenizer and the limit."""
        tokenizer = self._tokenizers.get(req.model, self._approximate)
        return self._tokenize(tokenizer, req, self._max_model_lens.get(pool))

    def route(self, req: RouteRequest, token_ids: list[int] | None = None, pool: str | None = None) -> RouteTicket:
        """Tokenize (unless token_ids, from tokenize(), are given), key, match, score: a ticket with
        the ranked candidates, the first recorded as predicted. pool: where the gateway placed req (its
        rule's pool or a fallback, req.model the model served there); default: pool_for(req)."""
        rule = self._rule_for(req)
        if pool is None:
            pool = self.pool_for(req)
        specs = self._candidates(pool, req.model)
        if not specs:
            raise self._unavailable(rule, req.model, pool)
        tokenizer = self._tokenizers.get(req.model, self._approximate)
        if token_ids is None:
            token_ids = self._tokenize(tokenizer, req, self._max_model_lens.get(pool))
        else:  # tokenized for the pool the request was meant for; it may have fallen back since
            check_num_tokens(len(token_ids), self._max_model_lens.get(pool))
        num_prompt_tokens = len(token_ids)
        seed = model_seed(req.model, self._cache_salts.get(req.tenant) if req.tenant else None)
        keys_by_size = self._keys_by_block_size(token_ids, seed, {s.block_size for s in specs})
        horizon = self._eviction_horizon
        matches = {size: self._index.match(keys, horizon) for size, keys in keys_by_size.items()}
        views = self._views(specs, matches)
        policy = self._policy(rule, pool)
        placed_keys = keys_by_size[specs[0].block_size]
        # a conversation's first turn has no home: where the last conversation sharing its system prompt
        # went says nothing of where this one (and its later turns) should go
        home = None if req.starts_session else self._placements.home(placed_keys, req.session_id)
        decision = policy.choose(_with_prompt(req, num_prompt_tokens, placed_keys, home,
                                              self._placements.prefixes_per_worker()), views)
        ranked_ids, held_back = self._slow_start.rank(decision.worker_ids, lambda w: self._held_blocks(w, matches))
        chosen = ranked_ids[0]
        self._placements.record(placed_keys, chosen, req.session_id)
        block_size = self._specs[chosen].block_size
        confirmed, predicted = matches[block_size].get(chosen, _NOTHING_HELD)
        # what the request will find cached: a predicted prefix counts once its request has computed it
        landed = (self._index.landed_prefix(chosen, keys_by_size[block_size], predicted)
                  if predicted > confirmed else 0)
        # a tuple of ints: the index keeps it until the prediction expires (seconds), and unlike a
        # list the collector stops tracking it, so these don't pile up as long-lived GC objects
        keys = tuple(keys_by_size[block_size])
        ttl_s = getattr(policy, "prediction_ttl_s", None)
        expiry = self._index.record_prediction(chosen, keys, ttl_s, num_predicted=predicted)
        specs_by_id = self._specs

        def cached_tokens_at(worker_id: str) -> int:
            spec = specs_by_id.get(worker_id)
            held = matches.get(spec.block_size, {}).get(worker_id) if spec is not None else None
            return _cacheable_tokens(max(held), spec.block_size, num_prompt_tokens) if held else 0

        ranked = RouteDecision(
            decision.policy,
            tuple(ranked_ids),
            decision.explanation,
            rule=rule.name,
            pool=pool,
            num_prompt_tokens=num_prompt_tokens,
            predicted_cached_tokens=_cacheable_tokens(max(confirmed, landed), block_size, num_prompt_tokens),
            tokenizer_mode=tokenizer.mode,
            held_back=held_back,
        )
        prediction = Prediction(chosen, keys, max(confirmed, predicted), expiry)
        if self.on_routed is not None:
            self.on_routed(chosen, keys, ttl_s)
        return RouteTicket(ranked, self._books, cached_tokens_at, prediction)

    def own_load(self) -> dict[str, tuple[int, int, int]]:
        """This router's own requests per worker (in flight, uncached prefill tokens queued, decodes
        running), for the other replicas' peer_load()."""
        return self._load.own_load()

    def peer_load(self, replica: str, report: Mapping[str, tuple[int, int, int]]) -> None:
        """Another replica's own requests per worker (its own_load()): counted in each worker's load
        until it reports again or expire_peer_loads() finds it silent too long."""
        self._load.set_peer_load(replica, report)

    def expire_peer_loads(self, max_age_s: float) -> None:
        self._load.expire_peers(max_age_s)

    def peer_routed(self, worker_id: str, keys: Sequence[int], ttl_s: float | None = None) -> None:
        """Another gateway replica just sent a prompt with these block keys to worker_id: remember
        it as this router's own decision would be (predicted cache there until its TTL or the
        worker's KV events say more, and the prefix's home), so replicas keep a prefix together."""
        if worker_id not in self._specs or not keys:
            return
        keys = tuple(keys)
        self._placements.record(keys, worker_id)
        self._index.record_prediction(worker_id, keys, ttl_s, pin=False)

    def _rule_for(self, req: RouteRequest) -> RoutingRule:
        rule = self._rules.select(req)
        if rule is None:
            raise NoRouteError(f"no routing rule matches model={req.model!r} path={req.path!r}")
        return rule

    def _policy(self, rule: RoutingRule, pool: str) -> Policy:
        """The rule's policy over one of its pools (its own, or a fallback): an instance each."""
        policy = self._instances.get((rule.name, pool))
        if policy is None:
            policy = self._instances[(rule.name, pool)] = build_policy(rule.policy_type, rule.policy_params, self._rng)
        return policy

    def _held_blocks(self, worker_id: str, matches: Mapping[int, Mapping[str, tuple[int, int]]]) -> int:
        """How many of the prompt's blocks worker_id holds (confirmed, or predicted)."""
        spec = self._specs.get(worker_id)
        held = matches.get(spec.block_size, {}).get(worker_id) if spec is not None else None
        return max(held) if held else 0

    def _candidates(self, pool: str, model: str) -> list[WorkerSpec]:
        """pool's workers in rotation that serve model (empty: the pool is unavailable for it)."""
        cache_key = (pool, model)
        specs = self._candidate_cache.get(cache_key)
        if specs is None:
            specs = self._candidate_cache[cache_key] = [
                s for s in self._pools.get(pool, ()) if s.model == model and s.worker_id not in self._out_of_rotation
            ]
        return specs

    @staticmethod
    def _unavailable(rule: RoutingRule, model: str, pool: str | None = None) -> NoRouteError:
        fallbacks = [f.pool for f in rule.fallbacks if "unavailable" in f.when]
        where = f"pool {pool or rule.pool!r}" + (f" or fallback {', '.join(map(repr, fallbacks))}"
                                                  if fallbacks and pool in (None, rule.pool) else "")
        return NoRouteError(f"rule {rule.name!r}: no healthy worker for model {model!r} in {where}")

    @staticmethod
    def _tokenize(tokenizer: RoutingTokenizer, req: RouteRequest, max_num_tokens: int | None) -> list[int]:
        """The prompt's token ids; PromptTooLongError beyond max_num_tokens, InputTooDeepError."""
        if req.messages is not None:
            return tokenizer.encode_chat(req.messages, tools=req.tools, max_num_tokens=max_num_tokens)
        return tokenizer.encode_prompt(req.prompt, max_num_tokens=max_num_tokens)  # type: ignore[arg-type]

    def _keys_by_block_size(self, token_ids: list[int], seed: int, sizes: set[int]) -> dict[int, list[int]]:
        packed = pack_tokens_u32le(token_ids)
        return {size: self._key_cache.keys(packed, size, seed) for size in sizes}

    def _eviction_horizon(self, worker_id: str, pinned_blocks: int) -> int | None:
        """A worker's eviction horizon, for KvIndex.match: for a worker of known capacity, the blocks
        it can still allocate before evicting one it holds now: its free blocks less the uncached
        prompts dispatched to it ahead (match counts keys freed longer ago as evicted). Blocks in
        use: the scraped KV usage, or if more, the prompt blocks of the requests routed there plus a
        partly filled block each (the scrape is up to an interval old; pinned_blocks: the index's
        blocks_in_use). None where the capacity is unknown. Asked of every worker holding a prompt's
        first block, each decision."""
        spec, load = self._specs.get(worker_id), self._loads.get(worker_id)
        if spec is None or load is None or (num_blocks := spec.num_blocks) is None:
            return None
        scraped = num_blocks * (load.kv_usage_frac or 0.0)
        routed = pinned_blocks + load.in_flight_requests
        queued_blocks = load.prefill_tokens_queued // spec.block_size
        return int(num_blocks - (scraped if scraped > routed else routed)) - queued_blocks

    def _views(self, specs: list[WorkerSpec], matches: dict[int, dict[str, tuple[int, int]]]) -> list[WorkerView]:
        # every candidate was added to the load view with its spec; WorkerView(...) runs a Python __new__
        loads, new = self._load.loads, tuple.__new__
        return [new(WorkerView, (s.worker_id, loads[s.worker_id], s.block_size,
                                 *matches[s.block_size].get(s.worker_id, _NOTHING_HELD),
                                 _free_blocks(s.num_blocks, loads[s.worker_id].kv_usage_frac)))
                for s in specs]


def _free_blocks(num_blocks: int | None, kv_usage_frac: float | None) -> int | None:
    """The blocks a worker of num_blocks can allocate without waiting for a running request to end:
    those its running requests do not hold (the scraped KV usage, moved on with our own requests
    since the scrape: router/load_view.py); cached blocks no request holds are evictable, so free.
    None where either is unknown."""
    if num_blocks is None or kv_usage_frac is None:
        return None
    return num_blocks - math.ceil(num_blocks * kv_usage_frac)


_NOTHING_HELD = (0, 0)


def _with_prompt(req: RouteRequest, num_prompt_tokens: int, block_keys: Sequence[int], home_worker: str | None,
                 prefixes_per_worker: Mapping[str, int]) -> RouteRequest:
    """req with the router's prompt facts (dataclasses.replace costs more than this per decision)."""
    return RouteRequest(req.model, req.messages, req.prompt, req.tools, req.request_id, req.tenant, req.priority,
                        req.session_id, req.headers, req.path, num_prompt_tokens, block_keys, home_worker,
                        prefixes_per_worker)


def _cacheable_tokens(cached_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Cached tokens a worker can report: full blocks, never the last prompt token (it is recomputed)."""
    if num_prompt_tokens < 1:
        return 0
    return min(cached_blocks * block_size, (num_prompt_tokens - 1) // block_size * block_size)
