"""Routing policies, one per module, and the table of policy types the YAML loader accepts."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from router.policies.kv_aware import KvAware, KvAwareParams
from router.policies.least_load import LeastLoad, LeastLoadParams
from router.policies.power_of_two import PowerOfTwo, PowerOfTwoParams
from router.policies.prefix_approx import PrefixApprox, PrefixApproxParams
from router.policies.random_choice import RandomChoice, RandomParams
from router.policies.round_robin import RoundRobin, RoundRobinParams
from router.policies.session_affinity import SessionAffinity, SessionAffinityParams
from router.types import Policy

# type name -> (parameters dataclass, policy class); read-only.
POLICY_TYPES: Mapping[str, tuple[type, type]] = {
    "kv_aware": (KvAwareParams, KvAware),
    "least_load": (LeastLoadParams, LeastLoad),
    "power_of_two": (PowerOfTwoParams, PowerOfTwo),
    "prefix_approx": (PrefixApproxParams, PrefixApprox),
    "random": (RandomParams, RandomChoice),
    "round_robin": (RoundRobinParams, RoundRobin),
    "session_affinity": (SessionAffinityParams, SessionAffinity),
}


def build_params(policy_type: str, raw: Mapping[str, Any]) -> Any:
    """Validated parameters; ValueError('name: why') for unknown types, names or values."""
    if policy_type not in POLICY_TYPES:
        known = ", ".join(sorted(POLICY_TYPES))
        raise ValueError(f"type: unknown policy type {policy_type!r} (known: {known})")
    params_type = POLICY_TYPES[policy_type][0]
    known_names = {f.name for f in fields(params_type)}
    for name in raw:
        if name not in known_names:
            raise ValueError(f"parameters.{name}: unknown parameter")
    try:
        return params_type(**raw)
    except ValueError as exc:
        raise ValueError(f"parameters.{exc}") from None


def build_policy(policy_type: str, params: Any, rng: random.Random | None = None) -> Policy:
    """A fresh policy instance (policies may keep state, e.g. a round-robin counter)."""
    return POLICY_TYPES[policy_type][1](params, rng=rng)


__all__ = ["POLICY_TYPES", "build_params", "build_policy"]
