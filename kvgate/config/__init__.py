"""kvgate's YAML configuration: the schema (frozen dataclasses) and its one loader."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvgate.config.admission import PoolAdmissionConfig, PricesConfig, TenantConfig
from kvgate.config.loader import ConfigError, build, load_yaml_file
from kvgate.config.policy_file import PolicyFileConfig, RuleConfig, RuleMatchConfig
from kvgate.config.schema import (
    ApiKeyConfig,
    AuthConfig,
    BreakerConfig,
    FallbackConfig,
    HealthConfig,
    KvgateConfig,
    LaunchConfig,
    LimitsConfig,
    LoggingConfig,
    OutlierConfig,
    PolicyConfig,
    PoolConfig,
    RedisConfig,
    RoutingConfig,
    ServerConfig,
    TracingConfig,
    UpstreamConfig,
    WorkerConfig,
)


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> KvgateConfig:
    """Load and validate a kvgate config file; raises ConfigError naming the YAML path."""
    return load_yaml_file(path, KvgateConfig, env=env)


def load_policy_file(path: str | Path, env: Mapping[str, str] | None = None) -> PolicyFileConfig:
    """Load a routing-policy file (routing.policies_file) with the same loader and messages."""
    return load_yaml_file(path, PolicyFileConfig, env=env)


__all__ = [
    "ApiKeyConfig", "AuthConfig", "BreakerConfig", "ConfigError", "FallbackConfig", "HealthConfig", "KvgateConfig", "LaunchConfig",
    "LimitsConfig", "LoggingConfig", "OutlierConfig", "PolicyConfig", "PolicyFileConfig", "PoolAdmissionConfig", "PoolConfig",
    "PricesConfig", "RedisConfig", "RoutingConfig", "RuleConfig", "RuleMatchConfig", "ServerConfig", "TenantConfig",
    "TracingConfig", "UpstreamConfig", "WorkerConfig",
    "build", "load_config", "load_policy_file",
]
