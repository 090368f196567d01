"""Routing tokenizer: the served model's tokenizer.json + chat template, or an approximate mode.

It also refuses what it cannot or should not encode, before the work: messages or tools nested
deeper than MAX_JSON_DEPTH (InputTooDeepError), and prompts longer than a given max_num_tokens
(PromptTooLongError; text is measured against a cheap lower bound before it is tokenized).

Thread-safe: the gateway tokenizes a large prompt in a worker thread beside its event loop
(kvgate/offload.py); the tokenizer is called so that it lets go of the interpreter lock, and the
prefix cache is locked.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import xxhash
from tokenizers import Tokenizer

from kvgate.chat_template import ChatTemplateError, compile_chat_template
from kvgate.offload import encode_releasing_gil
from router.block_keys import _U32_TYPECODE
from router.errors import InputTooDeepError, PromptTooLongError

_h128 = xxhash.xxh3_128_intdigest
_SENTINEL = "a"  # any plain text: a first segment to drop again
_APPROX_TOKEN_BYTES = 4  # approximate mode: one "token" per 4 bytes of UTF-8
MAX_JSON_DEPTH = 64
"""How deep messages and tools may nest objects/arrays (a chat message's content parts are 4 deep)."""
# Unicode composition in a tokenizer's normalizer (NFC/NFKC) merges at most a few characters into
# one (Hangul jamo: 3): the character bound allows for 4 before it refuses text untokenized
_NORMALIZER_MERGE_CHARS = 4


@dataclass(frozen=True, slots=True)
class _CachedRender:
    """A rendered conversation: where to cut it (just before its last special token) and its tokens."""

    text_len: int
    text_hash: int
    cut_char: int
    cut_token: int
    token_ids: array


class RoutingTokenizer:
    """Token ids for routing. mode is "exact" (the model's tokenizer) or "approximate".

    Chat: encode(render(messages, add_generation_prompt=True), add_special_tokens=False), as a
    vLLM-style worker does; completions: encode(prompt, add_special_tokens=True); token-id
    prompts pass through. Earlier turns of a conversation are reused from an LRU when the new
    render extends a cached one, cut just before a special token (a safe boundary).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        chat_template: str | None,
        *,
        special_tokens: Mapping[str, str] | None = None,
        prefix_cache_entries: int = 256,
        approx_chunk_bytes: int = 4,
    ) -> None:
        if prefix_cache_entries < 0:
            raise ValueError("prefix_cache_entries must be >= 0")
        if approx_chunk_bytes != 4:
            raise ValueError("approx_chunk_bytes must be 4 (one u32 per chunk)")
        self.mode = "exact" if tokenizer is not None else "approximate"
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        self._tokenizer = tokenizer
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._special_tokens = dict(special_tokens or {})
        self._special_ids = frozenset(
            i for i, t in (tokenizer.get_added_tokens_decoder().items() if tokenizer else ()) if t.special
        )
        self._cache: OrderedDict[int, _CachedRender] = OrderedDict()
        self._cache_lock = threading.Lock()  # the gateway tokenizes large prompts in a thread (kvgate.offload)
        self._cache_entries = prefix_cache_entries
        self._max_token_chars: int | None = None  # the longest vocabulary entry, read on first use

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, prefix_cache_entries: int = 256) -> RoutingTokenizer:
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
            prefix_cache_entries=prefix_cache_entries,
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
        token_ids = encode_releasing_gil(self._tokenizer, prompt, True).ids
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
        hashes = _message_hashes(messages, tools, template_kwargs)
        token_ids = self._from_cache(text, hashes) if self._cache_entries else None
        if token_ids is None:
            with self._cache_lock:
                self.prefix_cache_misses += 1
            encoding = encode_releasing_gil(self._tokenizer, text, False)
            token_ids = encoding.ids
            self._store(hashes[-1], text, token_ids, encoding.offsets, 0, 0, None)
            if len(messages) > 1 and self._cache_entries:
                self._store_shared_head(messages[:-1], hashes[-2], text, encoding, tools, template_kwargs)
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

    def _store_shared_head(self, head: list[Mapping[str, Any]], key: int, text: str, encoding: Any,
                           tools: Any, template_kwargs: Mapping[str, Any]) -> None:
        """Also cache the conversation minus its last message (e.g. a long system prompt), so a
        request that shares only that head (same system prompt, new question) reuses its tokens."""
        try:
            head_text = self._render(head, tools, False, template_kwargs)
        except ChatTemplateError:
            return
        if not head_text or not text.startswith(head_text):
            return
        cut = None
        for j, (token_id, (start, _)) in enumerate(zip(encoding.ids, encoding.offsets)):
            if start > len(head_text):
                break
            if token_id in self._special_ids:
                cut = j
        if cut is None or cut == 0:
            return
        cut_char = encoding.offsets[cut][0]
        ids = array(_U32_TYPECODE, encoding.ids[:cut])
        self._put(key, _CachedRender(len(head_text), _h128(head_text.encode()), cut_char, cut, ids))

    # -- prefix cache ----------------------------------------------------------------------------

    def _from_cache(self, text: str, hashes: list[int]) -> list[int] | None:
        for key in reversed(hashes[:-1]):
            with self._cache_lock:
                entry = self._cache.get(key)
            if entry is None:
                continue
            if len(text) < entry.text_len or _h128(text[: entry.text_len].encode()) != entry.text_hash:
                continue
            with self._cache_lock:
                if key in self._cache:  # another thread may have evicted it meanwhile
                    self._cache.move_to_end(key)
                self.prefix_cache_hits += 1
            suffix_ids, suffix_offsets = self._encode_suffix(text[entry.cut_char :])
            token_ids = entry.token_ids[: entry.cut_token].tolist() + suffix_ids
            base_char = entry.cut_char - len(_SENTINEL)
            self._store(hashes[-1], text, suffix_ids, suffix_offsets, base_char, entry.cut_token, entry, token_ids)
            return token_ids
        return None

    def _encode_suffix(self, suffix: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokens of suffix (which starts with a special token) as they are inside the full text.

        A sentinel segment goes first so the text after the special token is not the input's first
        segment (pre-tokenizers such as Metaspace prepend_scheme="first" treat that one apart);
        the sentinel's tokens are dropped again.
        """
        encoding = encode_releasing_gil(self._tokenizer, _SENTINEL + suffix, False)
        ids, offsets = encoding.ids, encoding.offsets
        start = next(i for i, token_id in enumerate(ids) if token_id in self._special_ids)
        return ids[start:], offsets[start:]  # offsets still count the sentinel

    def _store(
        self,
        key: int,
        text: str,
        new_ids: list[int],
        new_offsets: list[tuple[int, int]],
        base_char: int,
        base_token: int,
        previous: _CachedRender | None,
        all_ids: list[int] | None = None,
    ) -> None:
        """Cache text's tokens with its last cut: just before the last special token."""
        cut = next((j for j in range(len(new_ids) - 1, -1, -1) if new_ids[j] in self._special_ids), None)
        if cut is not None:
            cut_char, cut_token = base_char + new_offsets[cut][0], base_token + cut
        elif previous is not None:
            cut_char, cut_token = previous.cut_char, previous.cut_token
        else:
            return
        ids = array(_U32_TYPECODE, all_ids if all_ids is not None else new_ids)
        self._put(key, _CachedRender(len(text), _h128(text.encode()), cut_char, cut_token, ids))

    def _put(self, key: int, entry: _CachedRender) -> None:
        with self._cache_lock:
            self._cache[key] = entry
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)


def _message_hashes(messages: Sequence[Mapping[str, Any]], tools: Any, template_kwargs: Mapping[str, Any]) -> list[int]:
    """h_0 = hash(tools, kwargs); h_k = xxh3_128(h_{k-1} || json(messages[k-1])): one per prefix."""
    digest = _h128(_canonical({"tools": tools, "kwargs": template_kwargs}))
    hashes = [digest]
    for message in messages:
        digest = _h128(digest.to_bytes(16, "little") + _canonical(message))
        hashes.append(digest)
    return hashes


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


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()


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
