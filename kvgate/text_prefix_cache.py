"""Token ids of texts seen before, reused for a new text that starts with one: a conversation's
next turn (its render starts with the last one's), a chat or completions prompt sharing a long
system prompt or context (a RAG context, an agent's instructions, vLLM's prefix_repetition
benchmark) is tokenized only from where it differs, not from its start, on every request. The
gateway's routing tokenizer and the worker's tokenizer both encode through PrefixTokenizer.

A text is found by its prefix: digests of its first CHUNK_CHARS, 2 x CHUNK_CHARS, ... characters
(one xxh3 stream over the text), each mapped to the latest cached text that starts with those
characters. The deepest shared chunk gives the cut: the last token of the cached text that starts
at least MARGIN_CHARS before the chunk's end (a pre-tokenizer may look a character or two ahead).

Tokenizing from the middle of a text is not always what a full encode gives (a cut inside a
pre-token; a Metaspace tokenizer marks its input's first word), so the new text is encoded from a
word's start (a token beginning with a space or just after one, where pre-tokenizers split and
where the Metaspace mark is the word's own) at least JUNCTION_TOKENS tokens before the cut, and the cached tokens are
reused only if that encode has a token starting exactly at the cut and the cached tokens before it,
from the word on. Otherwise the text is encoded whole (tests compare both ways over texts made to
split awkwardly: runs of spaces, multi-byte characters, digits, contractions). Bounded by max_tokens
(the cached texts' tokens, least recently used out first).

Thread-safe: the gateway tokenizes a large prompt in a worker thread beside its event loop; the
tables are locked, the encodes run outside the lock.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash
from tokenizers import Tokenizer

from kvgate.offload import encode_releasing_gil

CHUNK_CHARS = 256  # prefix granularity: a shared prefix is reused up to its last whole chunk
MARGIN_CHARS = 8  # a cut this far before the shared chunk's end: the pre-tokenizer's lookahead stays inside it
JUNCTION_TOKENS = 4  # tokens before the cut, at least, that the new encode must reproduce
MAX_WINDOW_TOKENS = 64  # how far before that the new encode may start, looking for a word's start
DEFAULT_MAX_TOKENS = 1 << 20  # ~10 MiB: the ids, their offsets and the prefix digests (4 characters a token)

# plain text -> (token ids, each token's start character): the tokenizer's encode without special tokens
Encode = Callable[[str], tuple[list[int], list[int]]]
_TYPECODE = "I" if array("I").itemsize == 4 else "L"


@dataclass(slots=True)
class _Text:
    """A cached text's tokens (plain: no special tokens added) and the digests that lead to it."""

    ids: array
    starts: array
    digests: list[int]


class TextPrefixCache:
    """encode(text) -> token ids equal to encode_plain(text), reusing the tokens of a cached text
    that shares its first chunks. hits / misses count the texts long enough to look up."""

    def __init__(self, encode_plain: Encode, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self.hits = 0
        self.misses = 0
        self._encode = encode_plain
        self._lock = threading.Lock()
        self._texts: OrderedDict[int, _Text] = OrderedDict()  # by id(), least recently used first
        self._by_digest: dict[int, tuple[_Text, int]] = {}  # prefix digest -> (cached text, chunks)
        self._num_tokens = 0

    def encode(self, text: str) -> list[int]:
        digests = _prefix_digests(text)
        if not digests:
            return self._encode(text)[0]
        reused = self._reuse(text, digests)
        if reused is None:
            ids, starts = self._encode(text)
            self._store(_Text(array(_TYPECODE, ids), array(_TYPECODE, starts), digests))
            return ids
        self._store(reused)
        return reused.ids.tolist()

    def __len__(self) -> int:
        return len(self._texts)

    def _reuse(self, text: str, digests: list[int]) -> _Text | None:
        """The tokens of text from a cached text sharing its deepest chunk, if the junction holds."""
        with self._lock:
            found = None
            for chunks in range(len(digests), 0, -1):
                found = self._by_digest.get(digests[chunks - 1])
                if found is not None:
                    self._texts.move_to_end(id(found[0]))
                    break
            if found is None:
                self.misses += 1
                return None
        cached, chunks = found
        starts = cached.starts
        cut = _token_start_at_or_before(starts, bisect_right(starts, chunks * CHUNK_CHARS - MARGIN_CHARS) - 1)
        window = _word_start_at_or_before(text, starts, cut - JUNCTION_TOKENS)
        if window < 0:
            return self._missed()
        window_char, cut_char = starts[window], starts[cut]
        new_ids, new_starts = self._encode(text[window_char:])
        at = bisect_left(new_starts, cut_char - window_char)  # the new encode's first token at the cut
        if (at == len(new_starts) or new_starts[at] != cut_char - window_char
                or new_ids[:at] != cached.ids[window:cut].tolist()):
            return self._missed()
        with self._lock:
            self.hits += 1
        ids, starts = cached.ids[:cut], starts[:cut]
        ids.extend(new_ids[at:])
        starts.extend([start + window_char for start in new_starts[at:]])
        return _Text(ids, starts, digests)

    def _missed(self) -> None:
        with self._lock:
            self.misses += 1
        return None

    def _store(self, entry: _Text) -> None:
        with self._lock:
            self._texts[id(entry)] = entry
            self._num_tokens += len(entry.ids)
            for chunks, digest in enumerate(entry.digests, 1):
                self._by_digest[digest] = (entry, chunks)
            while self._num_tokens > self.max_tokens and len(self._texts) > 1:
                _, gone = self._texts.popitem(last=False)
                self._num_tokens -= len(gone.ids)
                for digest in gone.digests:
                    if self._by_digest.get(digest, (None,))[0] is gone:  # not since taken by a later text
                        del self._by_digest[digest]


def _token_start_at_or_before(starts: array, index: int) -> int:
    """index, or the token before it whose start character differs from its predecessor's: tokens of
    one character (byte-level pieces of a multi-byte character) share a start, and a cut between
    them is no boundary. -1 when there is none."""
    while index > 0 and starts[index - 1] == starts[index]:
        index -= 1
    return index


def _word_start_at_or_before(text: str, starts: array, index: int) -> int:
    """The last token at or before index (within MAX_WINDOW_TOKENS) that starts a word: with its
    space (byte-level BPE's and Metaspace's tokens carry the space before a word: where a
    pre-tokenizer splits, and where a Metaspace tokenizer's mark of its input's first word is the
    word's own); failing that, just after a space (a whitespace pre-tokenizer's tokens, which drop
    it). -1 when there is none."""
    lowest = max(-1, index - MAX_WINDOW_TOKENS)
    for after_space in (False, True):
        for i in range(index, lowest, -1):
            start = starts[i]
            if i and starts[i - 1] == start:
                continue  # a piece of one character's bytes
            if (start and text[start - 1] == " ") if after_space else text[start] == " ":
                return i
    return -1


def _prefix_digests(text: str) -> list[int]:
    """The digest of each whole chunk prefix of text: its first CHUNK_CHARS characters, then 2 x, ..."""
    if len(text) < CHUNK_CHARS:
        return []
    stream = xxhash.xxh3_128()
    digests = []
    for end in range(CHUNK_CHARS, len(text) + 1, CHUNK_CHARS):
        stream.update(text[end - CHUNK_CHARS:end].encode("utf-8", "surrogatepass"))
        digests.append(stream.intdigest())
    return digests


class PrefixTokenizer:
    """A tokenizers.Tokenizer's encode(text, add_special_tokens) through a TextPrefixCache
    (max_tokens=0: straight through). The cache keeps texts' own tokens; what add_special_tokens
    puts around them (a BOS, say) is read off a sample once and added here, or, for a tokenizer
    whose additions are not simply around the text, such text is encoded whole. The interpreter
    lock is let go while it tokenizes (kvgate.offload)."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self._tokenizer = tokenizer
        self.cache = TextPrefixCache(self._encode_plain, max_tokens) if max_tokens else None
        self._added_around = _added_special_tokens(tokenizer)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        around = self._added_around if add_special_tokens else ([], [])
        if self.cache is None or around is None:
            return encode_releasing_gil(self._tokenizer, text, add_special_tokens).ids
        before, after = around
        token_ids = self.cache.encode(text)
        return [*before, *token_ids, *after] if before or after else token_ids

    def _encode_plain(self, text: str) -> tuple[list[int], list[int]]:
        encoding = encode_releasing_gil(self._tokenizer, text, False)
        return encoding.ids, [start for start, _ in encoding.offsets]


def _added_special_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids encode(..., add_special_tokens=True) puts before and after a text's own, read off a
    sample; None when they are not simply around it."""
    sample = "Hello world, 12 tokens."
    plain, full = tokenizer.encode(sample, add_special_tokens=False).ids, tokenizer.encode(sample).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], full[start + len(plain):]
    return None
