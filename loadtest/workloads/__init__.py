"""Workload generators by name: each is a frozen config dataclass plus `generate(config, seed)`."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from loadtest.types import RequestSpec
from loadtest.workloads import agentic, low_reuse, multi_tenant_long_prefix, multi_turn_chat, trace_replay


@dataclass(frozen=True, slots=True)
class Workload:
    """A named generator and its config type."""

    name: str
    config_type: type
    generate: Callable[[Any, int], list[RequestSpec]]


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("multi_turn_chat", multi_turn_chat.MultiTurnChatConfig, multi_turn_chat.generate),
    Workload("agentic", agentic.AgenticConfig, agentic.generate),
    Workload("multi_tenant_long_prefix", multi_tenant_long_prefix.MultiTenantLongPrefixConfig,
             multi_tenant_long_prefix.generate),
    Workload("low_reuse", low_reuse.LowReuseConfig, low_reuse.generate),
    Workload("trace_replay", trace_replay.TraceReplayConfig, trace_replay.generate),
)}


def build_workload(name: str, seed: int, params: Mapping[str, str] | None = None) -> tuple[Any, list[RequestSpec]]:
    """The config (from string params such as the CLI's --param k=v) and the request list for `name`."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    workload = WORKLOADS[name]
    config = workload.config_type(**_coerce(workload.config_type, params or {}))
    return config, workload.generate(config, seed)


def _coerce(config_type: type, params: Mapping[str, str]) -> dict[str, Any]:
    hints = typing.get_type_hints(config_type)
    known = {f.name for f in dataclasses.fields(config_type)}
    values = {}
    for key, text in params.items():
        if key not in known:
            raise ValueError(f"unknown parameter {key!r} for this workload; known: {', '.join(sorted(known))}")
        values[key] = _parse(text, hints[key], key)
    return values


def _parse(text: str, hint: Any, key: str) -> Any:
    args = typing.get_args(hint)
    if text.lower() == "none" and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), hint)
    try:
        return base(text)
    except ValueError:
        raise ValueError(f"parameter {key}: expected {base.__name__}, got {text!r}") from None
