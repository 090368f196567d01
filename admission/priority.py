"""Priority classes: critical, standard, batch. A tenant's class is its ceiling: a client may
lower its own requests' class (`x-priority: batch`), never raise it."""

from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    """Lower is more urgent (as vLLM's `priority`): the value is what workers are sent."""

    CRITICAL = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str) -> Priority:
        """`critical`, `standard` or `batch` (any case); ValueError otherwise."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            raise ValueError(f"priority must be one of: {', '.join(PRIORITY_NAMES)} (got {name!r})") from None


PRIORITY_NAMES = tuple(p.label for p in Priority)


def admitted_priority(ceiling: Priority, requested: Priority | None) -> Priority:
    """The class a request is admitted at: the client's own choice when it is no more urgent than
    the tenant's ceiling, else the ceiling."""
    return ceiling if requested is None else max(ceiling, requested)
