"""ModelTokenizer: the folder's tokenizer.json, its special token ids and its chat template; TokenBytes:
the bytes each token stands for (no torch). A prompt that starts with a text tokenized before (a
conversation's earlier turns, a shared system prompt or context) is tokenized only from where it
differs (kvgate/text_prefix_cache.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders

from kvgate.text_prefix_cache import PrefixTokenizer
from worker.model.chat_template import render_chat_template
from worker.model.errors import ModelFileNotFoundError

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """Encodes and decodes text; renders chats with the model's template."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    chat_template: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text), e.g. ("eos_token", "</s>")
    _prefix: PrefixTokenizer = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if any(i < 0 for i in self.eos_token_ids):
            raise ValueError("eos_token_ids must be >= 0")
        object.__setattr__(self, "_prefix", PrefixTokenizer(self.tokenizer))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, reusing those of a text seen before that it starts with (the interpreter
        lock is released while it tokenizes: kvgate.offload)."""
        return self._prefix.encode(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **variables: Any,
    ) -> str:
        """Render messages to prompt text (tokenize it with add_special_tokens=False)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **{**dict(self.special_tokens), **variables},
        )


class TokenBytes:
    """The bytes one token stands for, alone: all of a character, or part of one that the next tokens
    finish (what OpenAI's logprobs list as `bytes`, so that a client can join a reply's tokens back into
    its text). Byte-level BPE (GPT-2's scheme, SmolLM2's) maps each byte to a printable character in the
    vocabulary; byte-fallback vocabularies (SentencePiece's `<0xE2>`) name the byte; an added token, or a
    token of any other scheme, is its decoded text. Kept per token id once asked."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._added = frozenset(tokenizer.get_added_tokens_decoder())
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        if (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's bytes_to_unicode), as char -> byte: printable
    Latin-1 bytes stand for themselves, the other 68 for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + i): byte for i, byte in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def load_tokenizer(model_dir: str | Path) -> ModelTokenizer:
    """Read tokenizer.json, tokenizer_config.json, chat_template.jinja, config and generation_config."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelFileNotFoundError(f"tokenizer not found: {path}")
    tokenizer = Tokenizer.from_file(str(path))
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    special = tuple((name, text) for name in _SPECIAL_TOKEN_NAMES
                    if (text := _token_text(tok_config.get(name))) is not None)
    special_map = dict(special)
    model_config = _read_json(model_dir / "config.json")
    generation_config = _read_json(model_dir / "generation_config.json")
    eos_ids = _eos_ids(tokenizer, special_map.get("eos_token"), model_config, generation_config)
    bos_id = _token_id(tokenizer, special_map.get("bos_token"))
    if bos_id is None:
        bos_id = generation_config.get("bos_token_id", model_config.get("bos_token_id"))
    return ModelTokenizer(tokenizer, eos_ids, bos_id, _chat_template(model_dir, tok_config), special)


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _eos_ids(tokenizer: Tokenizer, eos_text: str | None, model_config: dict[str, Any],
             generation_config: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    candidates = [_token_id(tokenizer, eos_text)]
    for source in (model_config, generation_config):
        value = source.get("eos_token_id")
        candidates.extend(value if isinstance(value, list) else [value])
    for token_id in candidates:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return tuple(ids)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


def _token_id(tokenizer: Tokenizer, text: str | None) -> int | None:
    return None if text is None else tokenizer.token_to_id(text)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)
