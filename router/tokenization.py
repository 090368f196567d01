"""Routing tokenizer: the served model's tokenizer.json + chat template, or an approximate mode.

It also refuses what it cannot or should not encode, before the work: messages or tools nested
deeper than MAX_JSON_DEPTH (InputTooDeepError), and prompts longer than a given max_num_tokens
(PromptTooLongError; text is measured against a cheap lower bound before it is tokenized).

Thread-safe: the gateway tokenizes a large prompt in a worker thread beside its event loop
(kvgate/offload.py); the tokenizer is called so that it lets go of the interpreter lock, and the
prefix cache (kvgate/text_prefix_cache.py) is locked.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from kvgate.chat_template import ChatTemplateError, compile_chat_template
from kvgate.offload import encode_releasing_gil
from kvgate.text_prefix_cache import DEFAULT_MAX_TOKENS, PrefixTokenizer
from router.block_keys import _U32_TYPECODE
from router.errors import InputTooDeepError, PromptTooLongError

_APPROX_TOKEN_BYTES = 4  # approximate mode: one "token" per 4 bytes of UTF-8
MAX_JSON_DEPTH = 64
"""How deep messages and tools may nest objects/arrays (a chat message's content parts are 4 deep)."""
# Unicode composition in a tokenizer's normalizer (NFC/NFKC) merges at most a few characters into
# one (Hangul jamo: 3): the character bound allows for 4 before it refuses text untokenized
_NORMALIZER_MERGE_CHARS = 4


class RoutingTokenizer:
    """Token ids for routing. mode is "exact" (the model's tokenizer) or "approximate".

    Chat: encode(render(messages, add_generation_prompt=True), add_special_tokens=False), as a
    vLLM-style worker does; completions: encode(prompt, add_special_tokens=True); token-id
    prompts pass through. A text (a chat's render, a completions prompt) that starts with one
    tokenized before (a conversation's earlier turns, a shared system prompt or context) reuses its
    tokens and is tokenized only from where it differs (prefix_cache: kvgate/text_prefix_cache.py;
    prefix_cache_tokens bounds it, 0 turns it off).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        chat_template: str | None,
        *,
        special_tokens: Mapping[str, str] | None = None,
        prefix_cache_tokens: int = DEFAULT_MAX_TOKENS,
        approx_chunk_bytes: int = 4,
    ) -> None:
        if prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        if approx_chunk_bytes != 4:
            raise ValueError("approx_chunk_bytes must be 4 (one u32 per chunk)")
        self.mode = "exact" if tokenizer is not None else "approximate"
        self._tokenizer = tokenizer
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._special_tokens = dict(special_tokens or {})
        self._max_token_chars: int | None = None  # the longest vocabulary entry, read on first use
        self._prefix_tokenizer = PrefixTokenizer(tokenizer, prefix_cache_tokens) if tokenizer is not None else None
        self.prefix_cache = self._prefix_tokenizer.cache if self._prefix_tokenizer is not None else None

    @classmethod
    def from_dir(cls, model_dir: str | Path, *,
                 prefix_cache_tokens: int = DEFAULT_MAX_TOKENS) -> RoutingTokenizer:
        """Load tokenizer.json and the chat template (chat_template.jinja, else tokenizer_config.json)."""
        folder = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        template = template_path.read_text(encoding="utf-8") if template_path.exists() else _config_template(config)
        specials = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(
            tokenizer,
            template,
            special_tokens={k: v for k, v in specials.items() if v is not None},
            prefix_cache_tokens=prefix_cache_tokens,
        )

    @classmethod
    def approximate(cls) -> RoutingTokenizer:
        """No tokenizer configured: 4-byte chunks of the UTF-8 text are the "tokens"."""
        return cls(None, None)

    # -- public ------------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """Plain text without special tokens (e.g. generated output, to count or continue it)."""
        if self._tokenizer is None:
            return _approximate_ids(text)
        return encode_releasing_gil(self._tokenizer, text, False).ids

    def encode_prompt(self, prompt: str | Sequence[int], *, max_num_tokens: int | None = None) -> list[int]:
        """A completions prompt: text with special tokens added, or token ids as given (a list is
        returned as is, not copied: callers only read it); a one-element batch is its element.

        max_num_tokens: PromptTooLongError for a longer prompt, found before encoding where the
        length is known (token ids) or bounded (text, see max_num_tokens_fit), else after."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one, as the worker reads it
        if not isinstance(prompt, str):
            check_num_tokens(len(prompt), max_num_tokens)
            return prompt if isinstance(prompt, list) else list(prompt)
        self._check_text_fits(prompt, max_num_tokens)
        if self._tokenizer is None:
            return _approximate_ids(prompt)
        token_ids = self._prefix_tokenizer.encode(prompt, add_special_tokens=True)
        check_num_tokens(len(token_ids), max_num_tokens)
        return token_ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of messages, normalised as the worker renders them (see chat_messages)."""
        check_depth(messages, "messages")
        check_depth(tools, "tools")
        return self._render(chat_messages(messages), tools, add_generation_prompt, template_kwargs)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_num_tokens: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation with the generation prompt, as the worker sees it.

        InputTooDeepError for messages or tools nested deeper than MAX_JSON_DEPTH; max_num_tokens:
        PromptTooLongError for a longer conversation (the rendered text's bound first, as in
        encode_prompt)."""
        check_depth(messages, "messages")
        check_depth(tools, "tools")
        messages = chat_messages(messages)
        text = self._render(messages, tools, True, template_kwargs)
        self._check_text_fits(text, max_num_tokens)
        if self._tokenizer is None:
            return _approximate_ids(text)
        token_ids = self._prefix_tokenizer.encode(text, add_special_tokens=False)
        check_num_tokens(len(token_ids), max_num_tokens)
        return token_ids

    def max_num_tokens_fit(self, text: str, max_num_tokens: int) -> bool:
        """False when text surely encodes to more than max_num_tokens, judged from its length alone.

        A token covers at most max_token_chars characters (the longest vocabulary entry; allowing
        for a normaliser's Unicode composition), so text has at least len(text) / that many
        tokens. Approximate mode has no such bound (its 4-byte chunks are not the model's tokens),
        so it never refuses text: the worker, which knows its tokenizer, does."""
        if self._tokenizer is None:
            return True
        return len(text) <= max_num_tokens * self.max_token_chars * _NORMALIZER_MERGE_CHARS

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry (exact mode)."""
        if self._max_token_chars is None:
            vocab = self._tokenizer.get_vocab(with_added_tokens=True) if self._tokenizer else {}
            self._max_token_chars = max(map(len, vocab), default=_APPROX_TOKEN_BYTES) or 1
        return self._max_token_chars

    def _check_text_fits(self, text: str, max_num_tokens: int | None) -> None:
        if max_num_tokens is not None and not self.max_num_tokens_fit(text, max_num_tokens):
            raise PromptTooLongError(max_num_tokens, None, num_chars=len(text))

    def _render(self, messages: list[Mapping[str, Any]], tools: Any, add_generation_prompt: bool,
                template_kwargs: Mapping[str, Any]) -> str:
        if self._template is None:
            text = "".join([f"{m['role']}: {m['content']}\n" for m in messages])
            return text + ("assistant: " if add_generation_prompt else "")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
                **template_kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def check_num_tokens(num_tokens: int, max_num_tokens: int | None) -> None:
    """PromptTooLongError when num_tokens exceeds max_num_tokens (None: no limit)."""
    if max_num_tokens is not None and num_tokens > max_num_tokens:
        raise PromptTooLongError(max_num_tokens, num_tokens)


def check_depth(value: Any, field: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """InputTooDeepError when value nests dicts/lists/tuples more than max_depth levels (a scalar
    is 0 levels, [] or {} one). Level by level, without recursion, so any depth is measured
    safely; json.dumps, the template and str() below recurse and would exhaust the stack."""
    level = [value] if _is_container(value) else []
    depth = 0
    while level:  # every request's messages pass here: a scalar (most items) costs no call
        depth += 1
        if depth > max_depth:
            raise InputTooDeepError(field, max_depth)
        deeper = []
        add = deeper.append
        for item in level:
            for child in item.values() if _is_mapping(item) else item:
                if type(child) not in _SCALARS and _is_container(child):
                    add(child)
        level = deeper


_CONTAINERS = (dict, list, tuple, Mapping)
_SCALARS = frozenset((str, int, float, bool, type(None)))  # what a JSON body holds besides dicts and lists


def _is_mapping(value: Any) -> bool:
    """isinstance(value, Mapping), without the ABC's slower check for a dict (what a JSON body holds)."""
    return type(value) is dict or isinstance(value, Mapping)


def _is_container(value: Any) -> bool:
    kind = type(value)
    return kind is dict or kind is list or (kind not in _SCALARS and isinstance(value, _CONTAINERS))


def _approximate_ids(text: str) -> list[int]:
    data = text.encode("utf-8")
    data += b"\0" * (-len(data) % 4)
    ids = array(_U32_TYPECODE)
    ids.frombytes(data)
    return ids.tolist()


def chat_messages(messages: Sequence[Any]) -> list[Mapping[str, Any]]:
    """Messages as the worker hands them to the template (worker/openai_api.py): null fields
    dropped, role developer as system, content as text. Leniently: what the worker rejects (no
    role, image parts, content of another type) still renders, so its 400 is what the client sees."""
    return [_chat_message(m) for m in messages if _is_mapping(m)]


def _chat_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    role, content = message.get("role"), message.get("content")
    if isinstance(content, str) and isinstance(role, str) and role != "developer" and None not in message.values():
        return message  # the common case: already as the worker renders it
    rendered = {k: v for k, v in message.items() if v is not None}
    rendered["role"] = _role(role)
    rendered["content"] = _content_text(content)
    return rendered


def _role(role: Any) -> str:
    """developer (OpenAI's newer name for system instructions) is system; no role renders as user."""
    if role == "developer":
        return "system"
    return role if isinstance(role, str) else "user"


def _content_text(content: Any) -> str:
    """A string; text parts joined by newlines, as vLLM joins them (other parts skipped); None is ""."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if _is_text_part(part))
    return "" if content is None else str(content)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _config_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None
