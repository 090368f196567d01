"""Trace replay: Mooncake-format JSONL, with synthesized text so that equal hash ids give equal text.

Each line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`; each
hash id stands for a block of `block_tokens` (512) tokens. The prompt is the hash ids' block texts
in order, cut to input_length tokens (approximate: see loadtest.text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadtest.text import seeded_text, words_for_tokens
from loadtest.types import RequestSpec


@dataclass(frozen=True, slots=True)
class TraceReplayConfig:
    """Where the trace is, how long a hash block is, and how to scale its clock (0.5 = twice as fast)."""

    path: str = ""
    block_tokens: int = 512
    time_scale: float = 1.0
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("trace_replay.path is required (a Mooncake-format JSONL file)")
        if self.block_tokens < 1:
            raise ValueError("trace_replay.block_tokens must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("trace_replay.time_scale must be > 0")


def generate(config: TraceReplayConfig, seed: int) -> list[RequestSpec]:
    """One completion per trace line, arriving at its timestamp (relative to the first) x time_scale."""
    rows = _read_rows(Path(config.path), config.max_requests)
    blocks: dict[int, list[str]] = {}
    first_ms = rows[0]["timestamp"] if rows else 0
    specs = []
    for i, row in enumerate(rows):
        words = _prompt_words(row, config.block_tokens, seed, blocks, i)
        specs.append(RequestSpec(index=i, kind="completion", max_tokens=max(1, int(row["output_length"])),
                                 prompt=" ".join(words),
                                 arrival_offset_s=max(0.0, (row["timestamp"] - first_ms) / 1000 * config.time_scale),
                                 prefix_ids=tuple(str(h) for h in row["hash_ids"])))
    return specs


def _read_rows(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"timestamp", "input_length", "output_length", "hash_ids"} - row.keys()
            if missing:
                raise ValueError(f"{path}:{number}: missing {', '.join(sorted(missing))}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _prompt_words(row: dict, block_tokens: int, seed: int, blocks: dict[int, list[str]], index: int) -> list[str]:
    words: list[str] = []
    for h in row["hash_ids"]:
        if h not in blocks:
            blocks[h] = seeded_text(f"{seed}:block:{h}", block_tokens).split()
        words += blocks[h]
    wanted = words_for_tokens(int(row["input_length"]))
    if len(words) < wanted:
        words += seeded_text(f"{seed}:tail:{index}", wanted - len(words)).split()
    return words[:wanted]
