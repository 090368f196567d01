"""What the router refuses and how much it remembers: prompts over a pool's max_model_len are refused
before their blocks are hashed, JSON nested too deep is a ValueError (a 400), and the keys it keeps
stay within their byte budgets however long the prompts."""

from __future__ import annotations

import ctypes
import random
import resource
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType

import pytest

from router.block_keys import PrefixKeyCache
from router.errors import InputTooDeepError, PromptTooLongError, RouteInputError
from router.kv_index import PREDICTED_KEY_BYTES, KvIndex
from router.router import Router
from router.rules import RoutingRules, rule
from router.tokenization import MAX_JSON_DEPTH, RoutingTokenizer, check_depth
from router.types import RouteRequest, WorkerSpec
from tests.router.model_dirs import CHATML_TEMPLATE, write_model_dir

RULES = RoutingRules((rule("default", "main"),))
POOLS = {"main": [WorkerSpec(f"w{i}", "m", 16) for i in range(2)]}
MAX_MODEL_LEN = 1024


def make_router(clock, *, key_cache: PrefixKeyCache | None = None, index: KvIndex | None = None,
                tokenizers: dict[str, RoutingTokenizer] | None = None,
                max_model_lens: dict[str, int] | None = None) -> Router:
    return Router(POOLS, RULES, clock=clock, rng=random.Random(0), key_cache=key_cache,
                  index=index or KvIndex(clock=clock), tokenizers=tokenizers,
                  max_model_lens={"main": MAX_MODEL_LEN} if max_model_lens is None else max_model_lens)


@pytest.fixture(scope="module")
def exact_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_model_dir(tmp_path_factory.mktemp("model"), "byte_level", CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def exact_tokenizer(exact_tokenizer_dir) -> RoutingTokenizer:
    return RoutingTokenizer.from_dir(exact_tokenizer_dir)


def test_a_token_id_prompt_longer_than_max_model_len_is_refused_before_hashing(clock) -> None:
    key_cache = PrefixKeyCache()
    router = make_router(clock, key_cache=key_cache)
    with pytest.raises(PromptTooLongError) as refused:
        router.route(RouteRequest(model="m", prompt=list(range(MAX_MODEL_LEN + 1))))
    assert isinstance(refused.value, ValueError)  # the gateway's 400
    assert refused.value.num_tokens == MAX_MODEL_LEN + 1
    assert "maximum context length is 1024 tokens" in str(refused.value)
    assert key_cache.blocks_hashed == 0 and len(key_cache) == 0


def test_a_prompt_of_exactly_max_model_len_tokens_is_routed(clock) -> None:
    ticket = make_router(clock).route(RouteRequest(model="m", prompt=list(range(MAX_MODEL_LEN))))
    assert ticket.decision.num_prompt_tokens == MAX_MODEL_LEN


def test_a_pool_without_a_limit_routes_long_prompts(clock) -> None:
    ticket = make_router(clock, max_model_lens={}).route(RouteRequest(model="m", prompt=list(range(4 * MAX_MODEL_LEN))))
    assert ticket.decision.num_prompt_tokens == 4 * MAX_MODEL_LEN


class NoEncoding:
    """Stands in for the model's tokenizer where encoding must not happen."""

    def encode(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("tokenized a prompt that its length alone refuses")


def test_long_text_is_refused_from_its_length_before_it_is_tokenized(clock, exact_tokenizer, monkeypatch) -> None:
    text = "x" * (MAX_MODEL_LEN * exact_tokenizer.max_token_chars * 4 + 1)
    monkeypatch.setattr(exact_tokenizer, "_tokenizer", NoEncoding())
    router = make_router(clock, tokenizers={"m": exact_tokenizer})
    with pytest.raises(PromptTooLongError) as refused:
        router.route(RouteRequest(model="m", prompt=text))
    assert refused.value.num_tokens is None  # refused on the bound, untokenized
    with pytest.raises(PromptTooLongError):
        router.route(RouteRequest(model="m", messages=[{"role": "user", "content": text}]))


def test_text_within_the_bound_is_refused_on_its_exact_token_count(clock, exact_tokenizer) -> None:
    text = " ".join(["routers", "and", "gateways"] * MAX_MODEL_LEN)  # far more tokens than 1024
    assert exact_tokenizer.max_num_tokens_fit(text, MAX_MODEL_LEN)
    router = make_router(clock, tokenizers={"m": exact_tokenizer})
    chat = [{"role": "user", "content": text}]
    for req in (RouteRequest(model="m", prompt=text), RouteRequest(model="m", messages=chat)):
        with pytest.raises(PromptTooLongError) as refused:
            router.route(req)
        assert refused.value.num_tokens > MAX_MODEL_LEN


def test_without_the_models_tokenizer_only_token_ids_are_measured(clock) -> None:
    """Approximate "tokens" (4-byte chunks) are not the model's: long text is the worker's to refuse."""
    text = "y" * (8 * MAX_MODEL_LEN)
    ticket = make_router(clock).route(RouteRequest(model="m", prompt=text))
    assert ticket.decision.tokenizer_mode == "approximate"


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_a_980_deep_message_field_is_a_clear_value_error_not_a_recursion_error(clock, exact_tokenizer) -> None:
    message = {"role": "user", "content": "hi", "extra": nested(980)}  # json.loads reads this deep
    for tokenizers in ({}, {"m": exact_tokenizer}):
        with pytest.raises(InputTooDeepError) as refused:
            make_router(clock, tokenizers=tokenizers).route(RouteRequest(model="m", messages=[message]))
        assert isinstance(refused.value, RouteInputError) and isinstance(refused.value, ValueError)
        assert str(refused.value) == f"messages nests objects/arrays more than {MAX_JSON_DEPTH} levels deep"


def test_deep_tools_are_refused_and_reasonable_nesting_is_routed(clock) -> None:
    router = make_router(clock)
    with pytest.raises(InputTooDeepError, match="^tools nests"):
        router.route(RouteRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[nested(80)]))
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}], "meta": nested(MAX_JSON_DEPTH - 3)}]
    assert router.route(RouteRequest(model="m", messages=parts)).decision.worker_ids


def test_the_key_cache_keeps_within_its_byte_budget_evicting_the_oldest() -> None:
    cache = PrefixKeyCache(max_entries=256, max_bytes=200_000)
    prompts = [bytes([i]) * 4 * 16 * 256 for i in range(1, 20)]  # 256 blocks of 16 tokens each: ~27 KB an entry
    for packed in prompts:
        cache.keys(packed, 16, seed=1)
        assert cache.num_bytes <= cache.max_bytes
    assert 0 < len(cache) < len(prompts)
    hashed = cache.blocks_hashed
    cache.keys(prompts[-1], 16, seed=1)  # the newest is kept
    assert cache.blocks_hashed == hashed
    cache.keys(prompts[0], 16, seed=1)  # the oldest went
    assert cache.blocks_hashed == hashed + 256


def test_the_key_cache_does_not_keep_a_prompt_larger_than_its_budget() -> None:
    cache = PrefixKeyCache(max_bytes=100_000)
    cache.keys(b"\1" * 4 * 16 * 10, 16, seed=1)
    cache.keys(b"\2" * 4 * 16 * 10_000, 16, seed=1)  # ~1 MB of keys and tokens
    assert len(cache) == 1 and cache.num_bytes <= 100_000


def test_predictions_stay_within_their_budget_dropping_those_due_first(clock) -> None:
    index = KvIndex(clock=clock, max_predicted_bytes=1_000 * PREDICTED_KEY_BYTES)
    index.add_worker("w0", model_name="m")
    chains = [tuple(range(i * 1_000_000, i * 1_000_000 + 300)) for i in range(10)]
    for i, keys in enumerate(chains):
        index.record_prediction("w0", keys, ttl_s=10.0 + i)
    stats = index.stats()
    assert stats.predicted_per_worker["w0"] <= 1_000 and stats.num_keys <= 1_000
    assert index.counters.predictions_evicted == 7
    assert index.match(chains[-1]) == {"w0": (0, 300)}
    assert index.match(chains[0]) == {}
    long_chain = tuple(range(10**9, 10**9 + 5_000))  # longer than the whole budget: its head is kept
    index.record_prediction("w0", long_chain, ttl_s=100.0)
    assert index.match(long_chain) == {"w0": (0, 1_000)}
    assert index.predicted_bytes <= index.max_predicted_bytes


def test_a_prompt_predicted_again_costs_only_its_tuple_and_all_of_it_is_given_back(clock) -> None:
    """A shared system prompt predicted by every request takes entries once: many more of those fit."""
    index = KvIndex(clock=clock, max_predicted_bytes=1_000 * PREDICTED_KEY_BYTES)
    index.add_worker("w0", model_name="m")
    index.add_worker("w1", model_name="m")
    shared = tuple(range(100))
    for i in range(20):
        index.record_prediction("w0", shared, ttl_s=10.0, num_predicted=len(shared) if i else 0)
    assert index.counters.predictions_evicted == 0 and index.predicted_bytes < 20 * 100 * PREDICTED_KEY_BYTES
    expiry = index.record_prediction("w1", shared + (1000, 1001), ttl_s=5.0)
    assert index.withdraw_prediction("w1", shared + (1000, 1001), expiry) == 102
    clock.advance(10.0)
    assert index.match(shared) == {} and index.predicted_bytes == 0


def rss_bytes() -> int:
    """This process's resident set (Linux /proc), in bytes, after glibc returns the free memory it
    caches (malloc_trim), so what is counted is what is held."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.slow
def test_200_prompts_of_2m_token_ids_keep_the_routers_memory_bounded(clock) -> None:
    """The body limit lets ~2M token ids through (125k keys of 16 tokens). Without a known
    max_model_len each is routed, and what the router remembers stays within its default budgets
    (16 MiB of prompt keys, 32 MiB of predictions) instead of growing with every prompt."""
    key_cache = PrefixKeyCache()
    index = KvIndex(clock=clock)
    router = make_router(clock, key_cache=key_cache, index=index, max_model_lens={})
    prompt = [random.Random(1).randrange(50_000)] * 2_000_000
    before = rss_bytes()
    for i in range(200):
        prompt[0] = i  # a new first block: a new chain each time (the router keeps no token list)
        ticket = router.route(RouteRequest(model="m", prompt=prompt))
        ticket.dispatched(ticket.decision.worker_id)
        ticket.first_token()
        ticket.finished(None)
        clock.advance(0.01)  # predictions live 10 s: only the budget bounds them
    assert key_cache.num_bytes <= key_cache.max_bytes
    assert index.predicted_bytes <= index.max_predicted_bytes
    assert index.counters.predictions_evicted > 0
    grown_bytes = rss_bytes() - before
    assert grown_bytes < 100 * 2**20, f"RSS grew by {grown_bytes / 2**20:.0f} MiB"


def test_over_long_prompts_cost_nothing_to_refuse(clock) -> None:
    """The 2M-token body when the pool's limit is known: refused by its length, nothing kept."""
    key_cache = PrefixKeyCache()
    index = KvIndex(clock=clock)
    router = make_router(clock, key_cache=key_cache, index=index)
    for i in range(20):
        with pytest.raises(PromptTooLongError):
            router.route(RouteRequest(model="m", prompt=[i] * 2_000_000))
    assert (key_cache.blocks_hashed, key_cache.num_bytes, index.stats().num_keys) == (0, 0, 0)


def test_tokenizer_bound_never_refuses_what_fits(exact_tokenizer: RoutingTokenizer) -> None:
    """The character bound is a lower bound: text that tokenizes within the limit is never refused by it."""
    text = "The quick brown fox jumps over the lazy dog. " * 40
    num_tokens = len(exact_tokenizer.encode_prompt(text))
    assert exact_tokenizer.max_num_tokens_fit(text, num_tokens)
    assert exact_tokenizer.encode_prompt(text, max_num_tokens=num_tokens)


# -- tokenizing apart from routing (the gateway does it off its event loop for a large request) --------


def test_ids_tokenized_apart_route_like_a_request_the_router_tokenizes(clock, exact_tokenizer) -> None:
    messages = [{"role": "system", "content": "You route requests."}, {"role": "user", "content": "hello " * 300}]
    req = RouteRequest(model="m", messages=messages)
    router = make_router(clock, tokenizers={"m": exact_tokenizer})
    token_ids = router.tokenize(req, "main")
    assert token_ids == exact_tokenizer.encode_chat(messages)
    apart = router.route(req, token_ids).decision
    together = make_router(clock, tokenizers={"m": exact_tokenizer}).route(req).decision
    assert (apart.num_prompt_tokens, apart.worker_ids) == (together.num_prompt_tokens, together.worker_ids)


def test_tokenize_refuses_a_prompt_longer_than_the_pools_limit(clock) -> None:
    with pytest.raises(PromptTooLongError):
        make_router(clock).tokenize(RouteRequest(model="m", prompt=list(range(MAX_MODEL_LEN + 1))), "main")


def test_ids_tokenized_for_one_pool_are_checked_again_against_the_pool_routed_to(clock) -> None:
    """The pool may fall back to another, with a lower limit, between tokenizing and routing."""
    pools = {"main": [WorkerSpec("w0", "m", 16)], "spare": [WorkerSpec("s0", "m", 16)]}
    router = Router(pools, RoutingRules((rule("default", "main", fallback_pool="spare"),)), clock=clock,
                    max_model_lens={"main": 4096, "spare": 512})
    req = RouteRequest(model="m", prompt=list(range(1000)))
    token_ids = router.tokenize(req, "main")
    router.set_in_rotation("w0", False)
    with pytest.raises(PromptTooLongError):
        router.route(req, token_ids)


def test_the_routing_tokenizer_gives_the_same_ids_from_many_threads(exact_tokenizer_dir) -> None:
    """Its prefix cache is shared by the event loop and the gateway's offload thread."""
    shared = RoutingTokenizer.from_dir(exact_tokenizer_dir, prefix_cache_tokens=2_000)  # evictions race lookups
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    conversations = [[system, {"role": "user", "content": f"question {i} " * (i % 7 + 1)}] for i in range(200)]
    expected = [RoutingTokenizer.from_dir(exact_tokenizer_dir, prefix_cache_tokens=0).encode_chat(c)
                for c in conversations]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(shared.encode_chat, conversations * 3))
    assert got == expected * 3
    assert shared.prefix_cache.hits > 0


def test_depth_is_counted_through_any_mapping_or_sequence_not_only_dicts_and_lists() -> None:
    def wrapped(depth: int):  # read-only mappings and tuples, as a caller other than the gateway may build
        value: object = "leaf"
        for level in range(depth):
            value = MappingProxyType({"a": value}) if level % 2 else (value,)
        return value

    check_depth(wrapped(MAX_JSON_DEPTH), "messages")
    with pytest.raises(InputTooDeepError):
        check_depth(wrapped(MAX_JSON_DEPTH + 1), "messages")
    check_depth([1, 2.5, True, None, "text"], "messages")  # scalars are no level
    with pytest.raises(InputTooDeepError):
        check_depth([[]], "tools", max_depth=1)
