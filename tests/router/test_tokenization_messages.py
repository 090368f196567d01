"""Routing tokenizer: messages are normalised as the worker renders them, and leniently."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.tokenization import RoutingTokenizer
from tests.router.model_dirs import CHATML_TEMPLATE, write_model_dir

QUESTION = "What is 2+2?"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> RoutingTokenizer:
    return RoutingTokenizer.from_dir(write_model_dir(tmp_path_factory.mktemp("m"), "byte_level", CHATML_TEMPLATE))


def user(content) -> dict:
    return {"role": "user", "content": content}


def test_a_list_of_one_text_part_renders_as_its_text(tok: RoutingTokenizer) -> None:
    parts = [user([{"type": "text", "text": QUESTION}])]
    assert tok.render_chat(parts) == tok.render_chat([user(QUESTION)])
    assert tok.encode_chat(parts) == tok.encode_chat([user(QUESTION)])


def test_text_parts_are_joined_with_newlines_as_vllm_does(tok: RoutingTokenizer) -> None:
    parts = user([{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}])
    assert tok.render_chat([parts]) == "<|im_start|>user\nWhat is\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_developer_role_renders_as_system(tok: RoutingTokenizer) -> None:
    developer = [{"role": "developer", "content": "Be brief."}, user(QUESTION)]
    system = [{"role": "system", "content": "Be brief."}, user(QUESTION)]
    assert tok.render_chat(developer).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tok.encode_chat(developer) == tok.encode_chat(system)


def test_null_content_and_null_fields_render_like_the_worker(tok: RoutingTokenizer) -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [user(QUESTION), {"role": "assistant", "content": None, "tool_calls": calls, "name": None}]
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("<|im_start|>assistant\n<|im_end|>\n")


LENIENT = [
    ("image-part-is-skipped", [user([{"type": "text", "text": QUESTION},
                                     {"type": "image_url", "image_url": {"url": "http://x/a.png"}}])],
     f"<|im_start|>user\n{QUESTION}<|im_end|>\n"),
    ("number-content", [user(123)], "<|im_start|>user\n123<|im_end|>\n"),
    ("missing-content", [{"role": "user"}], "<|im_start|>user\n<|im_end|>\n"),
    ("missing-role", [{"content": QUESTION}], f"<|im_start|>user\n{QUESTION}<|im_end|>\n"),
    ("part-without-text", [user([{"type": "text"}, "stray", {"type": "text", "text": QUESTION}])],
     f"<|im_start|>user\n{QUESTION}<|im_end|>\n"),
]


@pytest.mark.parametrize(("messages", "expected"), [c[1:] for c in LENIENT], ids=[c[0] for c in LENIENT])
def test_messages_the_worker_rejects_still_render_for_routing(tok: RoutingTokenizer, messages, expected) -> None:
    """The worker answers these with a precise 400; the router must not fail first with a vaguer one."""
    assert tok.render_chat(messages, add_generation_prompt=False) == expected
    assert tok.encode_chat(messages)


def test_prefix_cache_serves_a_conversation_with_parts_like_a_full_encode(tmp_path: Path) -> None:
    folder = write_model_dir(tmp_path / "m", "byte_level", CHATML_TEMPLATE)
    cached, full = RoutingTokenizer.from_dir(folder), RoutingTokenizer.from_dir(folder, prefix_cache_tokens=0)
    history = [{"role": "developer", "content": [{"type": "text", "text": "Be brief. " * 20}]}, user(QUESTION)]
    cached.encode_chat(history)
    longer = [*history, {"role": "assistant", "content": "4"}, user([{"type": "text", "text": "and 3+3?"}])]
    assert cached.encode_chat(longer) == full.encode_chat(longer)
    assert cached.prefix_cache.hits == 1


def test_approximate_mode_renders_the_normalised_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    text = RoutingTokenizer.approximate().render_chat([{"role": "developer", "content": parts}])
    assert text == "system: a\nb\nassistant: "
