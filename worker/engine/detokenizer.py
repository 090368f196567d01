"""Incremental detokenization of one request's output, safe for UTF-8 and stop strings.

Each new token is decoded together with a short window of the tokens before it (vLLM's
prefix_offset / read_offset scheme), and only text that is complete is emitted: a decode ending
in U+FFFD (a UTF-8 character split across tokens) waits for the next token. With stop strings,
the tail that could still be the start of a stop string is held back until it cannot; output is
cut at the first stop string (which is kept only with include_stop_str_in_output).

Cost per token: the stop check searches only the held-back tail (shorter than the longest stop
string) plus the token's new text, never the output so far; emitted text is kept as pieces and
joined only when `text` is read.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (as vLLM)
_TRIM_AFTER_TOKENS = 64


class IncrementalDetokenizer:
    """Turns output token ids, one at a time, into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._emitted: list[str] = []  # text handed out so far, in pieces
        self._held = ""  # decoded text not yet emitted: a tail that may start a stop string
        self.max_search_window_chars = 0  # the longest text one stop check searched
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    def add_token(self, token_id: int, *, stops: bool = True) -> str:
        """Feed one output token; return the text that became safe to emit (maybe ""). stops=False:
        no stop string may match in this token's text (a request short of its min_tokens)."""
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        new_text = self._decode_new(allow_partial=False)
        if not new_text:
            return ""
        return self._emit_safe(new_text) if stops else self._emit(new_text)

    def flush(self) -> str:
        """At the end of the request: emit whatever is still held back or pending."""
        if self.stopped:
            return ""
        delta = self._held + self._decode_new(allow_partial=True)
        self._held = ""
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if delta:
            self._emitted.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, allow_partial: bool) -> str:
        """Text of tokens past read_offset, or "" while it ends in a split character."""
        tokens = self._tokens
        if self._read_offset >= len(tokens):
            return ""
        prefix_text = self._decode(tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not allow_partial:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(tokens)
        if self._prefix_offset > _TRIM_AFTER_TOKENS:
            del tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _emit_safe(self, new_text: str) -> str:
        """Emit what no stop string can still claim: up to a completed stop string, or all but the
        tail that may start one. Only held + new_text is searched (held is shorter than the
        longest stop string, and holds no complete one)."""
        if not self._stop:
            return self._emit(new_text)
        window = self._held + new_text
        self.max_search_window_chars = max(self.max_search_window_chars, len(window))
        cut = self._find_stop(window, len(self._held))
        if cut is not None:
            self._held = ""
            return self._emit(window[:cut])
        num_held = self._held_back_chars(window)
        self._held = window[len(window) - num_held :]
        return self._emit(window[: len(window) - num_held])

    def _find_stop(self, window: str, num_old_chars: int) -> int | None:
        """Where to cut the window at the earliest stop string that new text completed (sets
        matched_stop); None if none did. A new match ends past the first num_old_chars."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = window.find(stop, max(0, num_old_chars - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.matched_stop = stop
        return index + len(stop) if self._include_stop else index

    def _held_back_chars(self, window: str) -> int:
        """Length of the longest tail of window that is a proper prefix of a stop string.

        Only the last (longest stop - 1) characters are looked at, and only where a stop
        string's first character occurs in them."""
        longest = 0
        for stop in self._stop:
            longest = max(longest, _longest_tail_starting(window, stop, longest))
        return longest


def _longest_tail_starting(text: str, stop: str, at_least: int) -> int:
    """Length of the longest tail of text (longer than at_least) that is a proper prefix of stop; else at_least."""
    start = max(0, len(text) - len(stop) + 1)
    end = len(text) - at_least  # a tail starting at or past here is no longer than at_least
    index = text.find(stop[0], start, end)
    while index != -1:
        if stop.startswith(text[index:]):
            return len(text) - index
        index = text.find(stop[0], index + 1, end)
    return at_least
