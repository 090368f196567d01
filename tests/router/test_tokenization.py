"""Routing tokenizer: chat template rendering, prefix cache == full encode, approximate mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.chat_template import ChatTemplateError
from router.tokenization import RoutingTokenizer
from tests.router.model_dirs import CHATML_TEMPLATE, LLAMA_LIKE_TEMPLATE, write_model_dir

TURNS = [
    ("user", "Hello there, how can I help you today?"),
    ("assistant", "I would like to know about caching.  KV caches store keys."),
    ("user", "  tell me a story about routers\n\nand gateways "),
    ("assistant", "def route(request): return min(workers)"),
    ("user", "The quick brown fox jumps over the lazy dog."),
    ("assistant", " prefixes are not recomputed"),
    ("user", "12345 67890"),
]


@pytest.fixture(
    params=[("byte_level", CHATML_TEMPLATE), ("metaspace", CHATML_TEMPLATE), ("byte_level", LLAMA_LIKE_TEMPLATE)],
    ids=["bytelevel-chatml", "metaspace-chatml", "bytelevel-llama-like"],
)
def model_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    kind, template = request.param
    return write_model_dir(tmp_path / "model", kind, template)


def conversation(num_messages: int, repeat: int = 1) -> list[dict[str, str]]:
    return [{"role": role, "content": text * repeat} for role, text in TURNS[:num_messages]]


def test_multi_turn_prefix_cache_equals_a_full_encode(model_dir: Path) -> None:
    cached = RoutingTokenizer.from_dir(model_dir)
    uncached = RoutingTokenizer.from_dir(model_dir, prefix_cache_tokens=0)
    for turn in range(1, len(TURNS) + 1, 2):
        messages = conversation(turn, repeat=8)  # long enough to cache (kvgate/text_prefix_cache.py's chunks)
        assert cached.encode_chat(messages) == uncached.encode_chat(messages), f"turn {turn}"
    assert cached.prefix_cache.hits >= 2


def test_chat_encode_is_the_rendered_text_without_added_special_tokens(model_dir: Path) -> None:
    tok = RoutingTokenizer.from_dir(model_dir)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = tok.render_chat(conversation(1))
    assert tok.encode_chat(conversation(1)) == raw.encode(text, add_special_tokens=False).ids


def test_completion_prompt_adds_special_tokens_and_id_lists_pass_through(model_dir: Path) -> None:
    tok = RoutingTokenizer.from_dir(model_dir)
    ids = tok.encode_prompt("Hello there")
    assert ids[0] == 0  # <s> from the post-processor
    assert tok.encode_prompt([5, 6, 7]) == [5, 6, 7]
    assert tok.mode == "exact"


def test_template_file_takes_precedence_and_gets_bos_and_eos(tmp_path: Path) -> None:
    folder = write_model_dir(tmp_path / "m", "byte_level", LLAMA_LIKE_TEMPLATE, template_file=True)
    text = RoutingTokenizer.from_dir(folder).render_chat([{"role": "user", "content": "hi "}])
    assert text == "<s>[user] hi </s>[assistant]"


def test_raise_exception_in_the_template_is_a_chat_template_error(tmp_path: Path) -> None:
    tok = RoutingTokenizer.from_dir(write_model_dir(tmp_path / "m", "byte_level", LLAMA_LIKE_TEMPLATE))
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.encode_chat([{"role": "tool", "content": "x"}])


def test_changed_history_is_not_served_from_the_cache(tmp_path: Path) -> None:
    folder = write_model_dir(tmp_path / "m", "byte_level", CHATML_TEMPLATE)
    tok = RoutingTokenizer.from_dir(folder)
    full = RoutingTokenizer.from_dir(folder, prefix_cache_tokens=0)
    tok.encode_chat(conversation(3))
    edited = conversation(5)
    edited[0] = {"role": "user", "content": "something else entirely"}
    assert tok.encode_chat(edited) == full.encode_chat(edited)


def test_approximate_mode_chunks_bytes_and_says_so() -> None:
    tok = RoutingTokenizer.approximate()
    assert tok.mode == "approximate"
    ids = tok.encode_prompt("abcdefgh!")
    assert len(ids) == 3
    assert ids[0] == int.from_bytes(b"abcd", "little")
    assert tok.encode_chat(conversation(2))[:1] == [int.from_bytes(b"user", "little")]


def test_matches_transformers_apply_chat_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = write_model_dir(tmp_path / "m", "byte_level", CHATML_TEMPLATE)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    reference.chat_template = CHATML_TEMPLATE
    messages = conversation(3)
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert RoutingTokenizer.from_dir(folder).render_chat(messages) == expected



def test_requests_sharing_only_a_system_prompt_reuse_its_tokens(model_dir: Path) -> None:
    cached = RoutingTokenizer.from_dir(model_dir)
    uncached = RoutingTokenizer.from_dir(model_dir, prefix_cache_tokens=0)
    system = {"role": "system", "content": "You are a careful assistant. " * 50}
    for question in ["first question?", "a second, different question", "12345 67890"]:
        messages = [system, {"role": "user", "content": question}]
        assert cached.encode_chat(messages) == uncached.encode_chat(messages), question
    assert cached.prefix_cache.hits == 2
