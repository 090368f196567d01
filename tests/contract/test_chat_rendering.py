"""Chat rendering, checked from both sides: the router's prompt tokens for a conversation equal the
worker's (its prefix-cache block keys are computed from them), for the same tokenizer folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.tokenization import RoutingTokenizer
from tests.tiny_models import CHAT_TEMPLATE, build_tokenizer
from worker.model.tokenizer import ModelTokenizer, load_tokenizer
from worker.openai_api import parse_chat

CALLS = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]


def text(*parts: str) -> list[dict]:
    return [{"type": "text", "text": part} for part in parts]


CONVERSATIONS = [
    ("strings", [{"role": "user", "content": "What is 2+2?"}]),
    ("one-text-part", [{"role": "user", "content": text("What is 2+2?")}]),
    ("text-parts", [{"role": "user", "content": text("What is", "2+2?\n", " Answer briefly.")}]),
    ("developer", [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]),
    ("developer-parts", [{"role": "developer", "content": text("Be brief.", "Use digits.")},
                         {"role": "user", "content": text("What is 2+2?")}]),
    ("multi-turn", [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": text("2+2?")},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": text("And", "3+3?")}]),
    ("assistant-tool-calls", [{"role": "user", "content": "2+2?"},
                              {"role": "assistant", "content": None, "tool_calls": CALLS, "name": None},
                              {"role": "user", "content": "thanks"}]),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat-rendering")
    build_tokenizer().save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def worker_prompt(tokenizer: ModelTokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """What worker/server.py tokenizes for a chat request: the parsed messages, rendered."""
    req = parse_chat({"messages": messages})
    rendered = tokenizer.apply_chat_template(list(req.messages), add_generation_prompt=req.add_generation_prompt)
    return rendered, tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("messages", [c[1] for c in CONVERSATIONS], ids=[c[0] for c in CONVERSATIONS])
def test_router_and_worker_render_the_same_prompt(model_dir: Path, messages: list[dict]) -> None:
    router = RoutingTokenizer.from_dir(model_dir)
    rendered, token_ids = worker_prompt(load_tokenizer(model_dir), messages)
    assert router.render_chat(messages) == rendered
    assert router.encode_chat(messages) == token_ids


def test_developer_role_gets_no_default_system_prompt_on_either_side(model_dir: Path) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered, _ = worker_prompt(load_tokenizer(model_dir), messages)
    assert rendered == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert RoutingTokenizer.from_dir(model_dir).render_chat(messages) == rendered
