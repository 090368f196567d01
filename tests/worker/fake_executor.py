"""A paged fake executor for engine tests: no model, but every KV slot matters to its output."""

from __future__ import annotations

from worker.executor.base import SeqChunk, StepBatch

VOCAB_SIZE = 50


def next_token(context: list[int]) -> int:
    """Depends on every token of the context, so a corrupted KV slot changes the result."""
    return (context[-1] * 7 + sum(context) + len(context)) % VOCAB_SIZE


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class PagedFakeExecutor:
    """Keeps a paged KV store (the token per block slot) and every batch it ran."""

    name = "fake"

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256):
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.vocab_size = VOCAB_SIZE
        self.kv: dict[tuple[int, int], int] = {}
        self.batches: list[StepBatch] = []

    def execute(self, batch: StepBatch) -> list[int]:
        self.batches.append(batch)
        size = self.block_size
        sampled = []
        for chunk in batch.chunks:
            for pos, token in enumerate(chunk.token_ids, start=chunk.start_pos):
                self.kv[(chunk.block_table[pos // size], pos % size)] = token
            if chunk.sampling is not None:
                end = chunk.start_pos + len(chunk.token_ids)
                context = [self.kv[(chunk.block_table[p // size], p % size)] for p in range(end)]
                sampled.append(next_token(context))
        return sampled

    def chunks_of(self, seq_id: int) -> list[SeqChunk]:
        return [c for b in self.batches for c in b.chunks if c.seq_id == seq_id]


class FailingExecutor:
    """Wraps an executor; its next num_failures steps raise (a device error), later ones run normally."""

    def __init__(self, inner, num_failures: int = 0) -> None:
        self.inner = inner
        self.name, self.block_size, self.num_blocks = inner.name, inner.block_size, inner.num_blocks
        self.max_model_len, self.vocab_size = inner.max_model_len, inner.vocab_size
        self.num_failures = num_failures
        self.num_failed_steps = 0

    def fail_next_steps(self, num_failures: int) -> None:
        self.num_failures = num_failures

    def execute(self, batch: StepBatch) -> list[int]:
        if self.num_failures > 0:
            self.num_failures -= 1
            self.num_failed_steps += 1
            raise RuntimeError("injected device error")
        return self.inner.execute(batch)
