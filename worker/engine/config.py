"""EngineConfig: the engine's sizes and limits, validated once at startup."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and KV-cache limits of one worker engine.

    num_blocks None lets the executor decide (from the memory it has); max_model_len None takes
    the model's. model_name seeds the block keys (docs/architecture.md), so it must be the name
    the router uses for this model.
    """

    model_name: str = ""
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require_positive("engine.block_size", self.block_size)
        _require_positive("engine.max_num_seqs", self.max_num_seqs)
        _require_positive("engine.max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_blocks is not None:
            _require_positive("engine.num_blocks", self.num_blocks)
        if self.max_model_len is not None:
            _require_positive("engine.max_model_len", self.max_model_len)
        if not isinstance(self.model_name, str):
            raise ValueError("engine.model_name must be a string")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("engine.enable_prefix_caching must be true or false")


def _require_positive(path: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path} must be a positive integer, got {value!r}")
