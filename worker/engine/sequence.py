"""One request's record inside the engine: its tokens, status, KV bookkeeping and finish reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from worker.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended, with OpenAI's / vLLM's finish_reason strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Sequence:
    """A request being served.

    token_ids is prompt + output. num_computed_tokens counts the leading tokens whose KV is in
    the blocks of block_table; num_cached_tokens is how many of those the prefix cache supplied
    when the request was first scheduled (what usage.cached_tokens reports). block_keys are the
    chained keys of token_ids' full blocks computed so far (kept across preemptions);
    num_registered_blocks counts the leading blocks the block manager has already offered to the
    prefix cache. priority: lower value = more urgent (as vLLM).
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float
    priority: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's stop_reason)
    queue_key: tuple[int, float, int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.token_ids = list(self.prompt_token_ids)
        self.queue_key = (self.priority, self.arrival_time_s, self.seq_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the tokens generated so far."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
