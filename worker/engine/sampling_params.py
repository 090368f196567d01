"""Per-request sampling settings, validated once when the request is added."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # how many of the likeliest tokens a request may ask for at each position (OpenAI's bound)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's bounds)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's bounds)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k None means no top-k cut; top_p 1.0 means no nucleus cut; min_p
    0 means no cut of the tokens less likely than min_p times the likeliest one (vLLM's min_p).
    seed makes sampling reproducible per request: the random draw for output token i depends
    only on (seed, i), so a preempted or failed-over request samples the same tokens again.
    logprobs: report each sampled token's log-probability and those of the `logprobs` likeliest
    tokens at its position (0: its own only); None: report none.

    What changes the logits before a token is drawn, in vLLM's order and with its meanings:
    allowed_token_ids, when given, are the only tokens that may be drawn; logit_bias adds to given
    tokens' logits; min_tokens keeps the stop tokens (EOS unless ignore_eos,
    stop_token_ids) from being drawn, and stop strings from matching, until that many tokens are out;
    repetition_penalty divides the positive logits (multiplies the negative ones) of every token in
    the prompt or the output so far; frequency_penalty subtracts itself once per time a token is in the
    output so far, presence_penalty once if it is there at all.
    skip_special_tokens: leave special tokens (EOS, chat markers) out of the text (vLLM's default).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    allowed_token_ids: tuple[int, ...] = ()  # () allows every token
    skip_special_tokens: bool = True
    # whether anything above changes the logits before a token is drawn (set once: read every step)
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1 or None")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if any(token < 0 for token in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None")
        if not (-MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY
                and -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY):
            raise ValueError(f"presence_penalty and frequency_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if any(token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for token, bias in self.logit_bias):
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "adjusts_logits", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.min_tokens
            or self.logit_bias or self.allowed_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
