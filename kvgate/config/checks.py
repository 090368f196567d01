"""Checks the config sections share; each raises ConfigError naming the key at fault."""

from __future__ import annotations

import re
from urllib.parse import ParseResult, urlparse

from kvgate.config.loader import ConfigError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def has_bad_port(parsed: ParseResult) -> bool:
    """True for a port that is not a number in 0..65535 (urlparse checks only when .port is read)."""
    try:
        parsed.port
    except ValueError:
        return True
    return False


def check_http_url(url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or has_bad_port(parsed):
        raise ConfigError("url", "not an http(s) URL")


def check_origin(origin: str, key: str) -> None:
    """A web origin as a browser sends it in Origin (scheme://host[:port], nothing after), or "*"."""
    if origin == "*":
        return
    parsed = urlparse(origin)
    if (not parsed.scheme or not parsed.hostname or parsed.path or parsed.query or parsed.fragment
            or parsed.username is not None or has_bad_port(parsed)):
        raise ConfigError(key, f"{origin!r} is not an origin like https://app.example.com[:port], or \"*\"")


def check_zmq_endpoint(endpoint: str, key: str) -> None:
    parsed = urlparse(endpoint)
    bad_tcp = parsed.scheme == "tcp" and (has_bad_port(parsed) or not parsed.port)
    if parsed.scheme not in ("tcp", "ipc") or bad_tcp:
        raise ConfigError(key, "not a ZMQ endpoint like tcp://HOST:PORT")


def check_positive(value: float | None, key: str) -> None:
    if value is not None and value <= 0:
        raise ConfigError(key, "must be > 0")
