"""KV-cache events the block manager reports, mirroring vLLM's BlockStored / BlockRemoved /
AllBlocksCleared (the worker service publishes them in vLLM's wire format)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence were computed and are now cached.

    block_hashes are their chained block keys, in order; parent_block_hash is the key of the block
    before the first one (None when the first one starts the sequence); token_ids are the tokens
    of all the blocks, len(block_hashes) * block_size of them.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError("BlockStored.token_ids must hold block_size tokens per block hash")


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted (their memory reused); the worker no longer holds these keys."""

    block_hashes: list[int]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVEvent], None]
