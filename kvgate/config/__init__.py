"""kvgate's YAML configuration: the schema (frozen dataclasses) and its loader."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from kvgate.config.loader import ConfigError, build, load_yaml_file
from kvgate.config.schema import (
    ApiKeyConfig,
    AuthConfig,
    KvgateConfig,
    LaunchConfig,
    LimitsConfig,
    PolicyConfig,
    PoolConfig,
    RedisConfig,
    ServerConfig,
    UpstreamConfig,
    WorkerConfig,
)


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> KvgateConfig:
    """Load and validate a kvgate config file; raises ConfigError naming the YAML path."""
    return load_yaml_file(path, KvgateConfig, env=env)


__all__ = [
    "ApiKeyConfig", "AuthConfig", "ConfigError", "KvgateConfig", "LaunchConfig", "LimitsConfig",
    "PolicyConfig", "PoolConfig", "RedisConfig", "ServerConfig", "UpstreamConfig", "WorkerConfig",
    "build", "load_config",
]
