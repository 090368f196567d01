"""Incremental detokenization of one request's output, safe for UTF-8 and stop strings.

Each new token is decoded together with a short window of the tokens before it (vLLM's
prefix_offset / read_offset scheme), and only text that is complete is emitted: a decode ending
in U+FFFD (a UTF-8 character split across tokens) waits for the next token. With stop strings,
the tail that could still be the start of a stop string is held back until it cannot; output is
cut at the first stop string (which is kept only with include_stop_str_in_output).
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
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._text = ""  # decoded output text so far (complete characters only)
        self._num_emitted_chars = 0
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """The output text emitted so far."""
        return self._text[: self._num_emitted_chars]

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    def add_token(self, token_id: int) -> str:
        """Feed one output token; return the text that became safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self._tokens.append(token_id)
        new_text = self._decode_new(allow_partial=False)
        if not new_text:
            return ""
        return self._append_and_emit(new_text)

    def flush(self) -> str:
        """At the end of the request: emit whatever is still held back or pending."""
        if self.stopped:
            return ""
        self._text += self._decode_new(allow_partial=True)
        delta = self._text[self._num_emitted_chars :]
        self._num_emitted_chars = len(self._text)
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

    def _append_and_emit(self, new_text: str) -> str:
        old_len = len(self._text)
        self._text += new_text
        if self._stop and self._find_stop(old_len):
            emit_to = len(self._text)
        else:
            emit_to = max(self._num_emitted_chars, len(self._text) - self._held_back_chars())
        delta = self._text[self._num_emitted_chars : emit_to]
        self._num_emitted_chars = emit_to
        return delta

    def _find_stop(self, old_len: int) -> bool:
        """Cut the text at the earliest stop string that new text completed; True if one did."""
        text = self._text
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self._text = text[: index + len(stop) if self._include_stop else index]
        self.matched_stop = stop
        return True

    def _held_back_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._text
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
