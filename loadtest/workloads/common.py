"""Helpers every workload shares: interleaving sessions and numbering requests."""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence, TypeVar

from loadtest.types import RequestSpec

T = TypeVar("T")


def interleave(sessions: Sequence[Sequence[T]], rng: random.Random) -> list[T]:
    """A uniformly random merge of the sessions: the next item comes from a session picked by items left."""
    cursors = [0] * len(sessions)
    remaining = [len(s) for s in sessions]
    merged: list[T] = []
    while any(remaining):
        which = rng.choices(range(len(sessions)), weights=remaining)[0]
        merged.append(sessions[which][cursors[which]])
        cursors[which] += 1
        remaining[which] -= 1
    return merged


def numbered(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """The specs with index set to their position."""
    return [dataclasses.replace(spec, index=i) for i, spec in enumerate(specs)]
