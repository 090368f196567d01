"""Requests the router refuses to route: ValueError subclasses, so the gateway answers them with a 400."""

from __future__ import annotations


class RouteInputError(ValueError):
    """A request the router cannot tokenize or key as sent; the message says what to change."""


class PromptTooLongError(RouteInputError):
    """The prompt has more tokens than the pool's max_model_len (OpenAI's code: context_length_exceeded).

    num_tokens is the exact count, or None when a cheap lower bound refused it before tokenizing.
    """

    def __init__(self, max_model_len: int, num_tokens: int | None, *, num_chars: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.num_tokens = num_tokens
        if num_tokens is not None:
            found = f"your prompt has {num_tokens} tokens"
        else:
            found = f"your prompt's {num_chars} characters cannot fit in it"
        super().__init__(f"This model's maximum context length is {max_model_len} tokens. However, {found}. "
                         "Please reduce the length of the prompt.")


class InputTooDeepError(RouteInputError):
    """A request field nests JSON objects/arrays deeper than the router reads (it would exhaust the stack)."""

    def __init__(self, field: str, max_depth: int) -> None:
        self.field = field
        self.max_depth = max_depth
        super().__init__(f"{field} nests objects/arrays more than {max_depth} levels deep")
