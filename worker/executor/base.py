"""The executor interface: what the engine hands an executor each step, and what comes back.

An executor owns the KV cache memory and the model math (or, for `sim`, a timing model). The
engine owns everything else: which sequences run, which blocks they use, stop conditions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from worker.engine.sampling_params import SamplingParams


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
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling: SamplingParams | None = None
    sample_index: int = 0


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

    def execute(self, batch: StepBatch) -> list[int]:
        """Run the batch; return one sampled token id per chunk whose sampling is set, in order."""
        ...
