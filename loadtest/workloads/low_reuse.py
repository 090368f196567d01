"""Low reuse: a unique long document per request behind a one-line instruction; short JSON outputs."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.text import word_salad
from loadtest.types import RequestSpec

INSTRUCTION = "Return a JSON object with the keys title, date and people for the document below.\n\n"


@dataclass(frozen=True, slots=True)
class LowReuseConfig:
    """Sizes of the low-reuse workload (tokens approximate)."""

    num_requests: int = 100
    document_tokens: int = 3000
    output_tokens: int = 48

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"low_reuse.{name} must be >= 1")


def generate(config: LowReuseConfig, seed: int) -> list[RequestSpec]:
    """num_requests completions, each over its own document (only the instruction is shared)."""
    rng = random.Random(f"{seed}:low_reuse")
    return [RequestSpec(index=i, kind="completion", max_tokens=config.output_tokens,
                        prompt=INSTRUCTION + word_salad(rng, config.document_tokens),
                        prefix_group="instruction", prefix_ids=("instruction", f"document-{i}"))
            for i in range(config.num_requests)]
