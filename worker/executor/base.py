"""The executor interface: what the engine hands an executor each step, and what comes back.

An executor owns the KV cache memory and the model math (or, for `sim`, a timing model). The
engine owns everything else: which sequences run, which blocks they use, stop conditions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from worker.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenLogprobs:
    """A sampled token's log-probability and the likeliest tokens' at its position, under the model's
    own distribution: the log-softmax of the raw logits, before temperature, top-k and top-p (what vLLM
    reports by default), so the figures do not depend on how the token was drawn."""

    logprob: float
    top_token_ids: list[int]  # the likeliest first, as many as the request asked
    top_logprobs: list[float]


@dataclass(slots=True)
class LogitsContext:
    """What a chunk's sampling needs from its sequence when its params adjust the logits (penalties,
    min_tokens, logit_bias): the sequence's tokens, prompt then output so far (the engine's own list,
    not changed during the step), and the tokens that may not be drawn yet."""

    token_ids: list[int]
    num_prompt_tokens: int
    banned_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step.

    token_ids are the tokens to run through the model now: a prefill chunk, or the single last
    token for a decode. Their positions are start_pos, start_pos+1, ...; the KV of positions
    [0, start_pos) is already in the cache blocks named by block_table, which also covers the
    new positions. sampling is None for a prefill chunk that does not reach the end of the
    prompt (nothing is sampled); otherwise one token is sampled from the last position's logits,
    and sample_index is the number of output tokens the sequence has produced so far (the seed's
    random stream is indexed by it).

    logits_context is set, by the engine, on a chunk whose sampling adjusts the logits. logprobs is
    the one field an executor writes: for a chunk whose sampling asks for logprobs, the sampled
    token's (an executor whose computes_logprobs is false is never asked).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: SamplingParams | None = None
    sample_index: int = 0
    logits_context: LogitsContext | None = None
    logprobs: TokenLogprobs | None = None


@dataclass(slots=True)
class StepBatch:
    chunks: list[SeqChunk]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Executor(Protocol):
    """Runs steps over a paged KV cache of num_blocks blocks of block_size tokens."""

    name: str  # "torch" or "sim": reported in responses and metrics
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int  # rows of the model's embedding: token ids it accepts are below this
    computes_logprobs: bool  # whether it has a distribution to report (the sim executor has none)

    def execute(self, batch: StepBatch) -> list[int]:
        """Run the batch; return one sampled token id per chunk whose sampling is set, in order."""
        ...


def validate_batch(batch: StepBatch, block_size: int, num_blocks: int, max_model_len: int) -> None:
    """Reject a malformed batch before any work: every executor checks the same things."""
    for chunk in batch.chunks:
        end = chunk.start_pos + len(chunk.token_ids)
        if not chunk.token_ids or chunk.start_pos < 0:
            raise ValueError(f"seq {chunk.seq_id}: a chunk needs >= 1 token and start_pos >= 0")
        if end > max_model_len:
            raise ValueError(f"seq {chunk.seq_id}: {end} tokens exceed max_model_len {max_model_len}")
        if len(chunk.block_table) * block_size < end:
            raise ValueError(f"seq {chunk.seq_id}: block_table covers fewer than {end} positions")
        if any(not 0 <= b < num_blocks for b in chunk.block_table):
            raise ValueError(f"seq {chunk.seq_id}: block id out of range [0, {num_blocks})")
