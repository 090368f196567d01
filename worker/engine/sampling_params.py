"""Per-request sampling settings, validated once when the request is added."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # how many of the likeliest tokens a request may ask for at each position (OpenAI's bound)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k None means no top-k cut; top_p 1.0 means no nucleus cut.
    seed makes sampling reproducible per request: the random draw for output token i depends
    only on (seed, i), so a preempted or failed-over request samples the same tokens again.
    logprobs: report each sampled token's log-probability and those of the `logprobs` likeliest
    tokens at its position (0: its own only); None: report none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1 or None")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
