"""The tokenizers' prefix cache (kvgate/text_prefix_cache.py): every encode equals a full encode,
prefixes are reused where the junction holds, a junction that does not hold falls back, memory is
bounded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvgate.text_prefix_cache import CHUNK_CHARS, TextPrefixCache
from router.tokenization import RoutingTokenizer
from tests.router.model_dirs import CHATML_TEMPLATE, write_model_dir

# words, runs of spaces and newlines, digits, punctuation, multi-byte characters and contractions:
# the places a pre-tokenizer splits differently
PIECES = [*"abcdefghij klmnop  qrstuv\n\n\twxyz.,;:!?'\"0123456789", "é", "ü", "中", "文", "🙂", "  ", "\r\n",
          "'s", "'ll", " the", " cache", " router"]


@pytest.fixture(params=["byte_level", "metaspace"])
def model_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "model", request.param, CHATML_TEMPLATE)


def salad(rng: random.Random, size: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(size))


def test_prompts_sharing_prefixes_encode_as_a_full_encode_does(model_dir: Path) -> None:
    cached = RoutingTokenizer.from_dir(model_dir)
    full = RoutingTokenizer.from_dir(model_dir, prefix_cache_tokens=0)
    assert cached.prefix_cache is not None and full.prefix_cache is None
    rng = random.Random(0)
    prefixes = [salad(rng, rng.randrange(100, 1500)) for _ in range(8)]
    for i in range(300):
        prefix = rng.choice(prefixes)
        if i % 3 == 0:  # a prompt sharing only part of a prefix, cut anywhere (mid-word, mid-character run)
            prefix = prefix[:rng.randrange(len(prefix) + 1)]
        prompt = prefix + salad(rng, rng.randrange(0, 300))
        assert cached.encode_prompt(prompt) == full.encode_prompt(prompt), repr(prompt[-80:])
    cache = cached.prefix_cache
    assert cache.hits > 150, (cache.hits, cache.misses)


def test_a_long_shared_prefix_is_reused_and_only_the_rest_encoded(model_dir: Path) -> None:
    tokenizer = RoutingTokenizer.from_dir(model_dir)
    full = RoutingTokenizer.from_dir(model_dir, prefix_cache_tokens=0)
    encoded: list[str] = []
    cache = tokenizer.prefix_cache
    assert cache is not None
    plain = cache._encode
    cache._encode = lambda text: (encoded.append(text), plain(text))[1]
    context = "Answer from this context only. " * 100
    first, second = context + "What is cached?", context + "Where does a prefix go?"
    assert tokenizer.encode_prompt(first) == full.encode_prompt(first)
    assert tokenizer.encode_prompt(second) == full.encode_prompt(second)
    assert (cache.hits, cache.misses) == (1, 1)
    assert len(encoded[1]) < CHUNK_CHARS + 200  # the second prompt's encode started near its end


def test_a_junction_that_does_not_hold_falls_back_to_a_full_encode() -> None:
    """An encode that tokenizes a text's start differently (as a tokenizer marking its input's first
    word would, everywhere) never lets the cache splice: each text is encoded whole."""

    def encode(text: str) -> tuple[list[int], list[int]]:
        ids = [ord(c) for c in text]
        if ids:
            ids[0] += 1_000_000  # the input's first token is marked
        return ids, list(range(len(text)))

    cache = TextPrefixCache(encode)
    shared = "word " * 200
    for suffix in ("one", "two", "three"):
        assert cache.encode(shared + suffix) == encode(shared + suffix)[0]
    assert cache.hits == 0 and cache.misses == 3


def test_short_texts_are_neither_looked_up_nor_kept() -> None:
    cache = TextPrefixCache(lambda text: ([ord(c) for c in text], list(range(len(text)))))
    assert cache.encode("x" * (CHUNK_CHARS - 1)) == [ord("x")] * (CHUNK_CHARS - 1)
    assert len(cache) == 0 and cache.hits == cache.misses == 0


def test_memory_is_bounded_by_tokens_and_evicted_texts_are_not_found() -> None:
    cache = TextPrefixCache(lambda text: ([ord(c) for c in text], list(range(len(text)))), max_tokens=4 * CHUNK_CHARS)
    texts = [f"{i:04d} " + "z " * CHUNK_CHARS for i in range(20)]
    for text in texts:
        cache.encode(text)
    assert cache._num_tokens <= 4 * CHUNK_CHARS and len(cache) <= 4
    assert all(found in cache._texts.values() for found, _ in cache._by_digest.values())
    cache.encode(texts[-1] + " again")  # still cached: its tokens reused
    assert cache.hits == 1
    misses = cache.misses
    cache.encode(texts[0] + " again")  # evicted long ago: encoded whole
    assert (cache.hits, cache.misses) == (1, misses + 1)


def test_the_default_models_tokenizer_with_its_added_tokens(tmp_path: Path) -> None:
    """A tokenizer whose post-processor adds a BOS: the cached prompt still starts with it."""
    folder = write_model_dir(tmp_path / "model", "byte_level", CHATML_TEMPLATE)
    tokenizer, full = RoutingTokenizer.from_dir(folder), RoutingTokenizer.from_dir(folder, prefix_cache_tokens=0)
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    for suffix in ("", " and then?", " 12345"):
        assert tokenizer.encode_prompt(prompt + suffix) == full.encode_prompt(prompt + suffix)
        assert tokenizer.encode_prompt(prompt + suffix)[0] == 0  # <s>
    assert tokenizer.prefix_cache is not None and tokenizer.prefix_cache.hits == 5


def test_a_whitespace_split_tokenizer_whose_tokens_drop_the_space_reuses_prefixes_too() -> None:
    """WordLevel on WhitespaceSplit: no token starts with its space; the window starts just after one."""
    from kvgate.text_prefix_cache import PrefixTokenizer
    from tests.tiny_models import build_word_tokenizer

    whole = build_word_tokenizer()
    tokenizer = PrefixTokenizer(whole)
    context = "Hello world, this is a tiny tokenizer for kvgate tests.  The quick brown fox\n" * 12
    for question in ("jumps over", "Paris is the capital of France?", "\n\nw3 w4"):
        assert tokenizer.encode(context + question, True) == whole.encode(context + question).ids
    assert tokenizer.cache is not None and tokenizer.cache.hits == 2
