"""API keys: generation and the one-way hash that is all kvgate ever stores."""

from __future__ import annotations

import hashlib
import re
import secrets
import urllib.parse
from typing import Any, Callable, TypeVar

KEY_PREFIX = "kvg-"
REDIS_KEYS_HASH = "kvgate:api_keys"  # Redis hash: sha256(key) -> tenant
T = TypeVar("T")


def generate_key() -> str:
    """A new random API key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key; configs and Redis hold only this."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def store_in_redis(redis_url: str, key_sha256: str, tenant: str) -> None:
    """Register a key hash for a tenant in Redis, where every gateway replica looks it up.

    Raises KeyStoreError with a one-line reason when the URL is not a Redis URL or Redis fails.
    """
    _with_redis(redis_url, "refused the key", lambda client: client.hset(REDIS_KEYS_HASH, key_sha256, tenant))


def revoke_in_redis(redis_url: str, key_sha256: str) -> str | None:
    """Remove a key hash from Redis; returns the tenant it belonged to, None if Redis did not hold it.
    Gateways cache what they looked up for up to 30 s, so the key stops working within that (while Redis
    is unreachable, a gateway serves a key it had looked up for at most 60 s more: gateway/auth.py
    STALE_GRACE_S)."""

    def revoke(client) -> str | None:
        tenant = client.hget(REDIS_KEYS_HASH, key_sha256)
        if tenant is None:
            return None
        client.hdel(REDIS_KEYS_HASH, key_sha256)
        return tenant.decode("utf-8", "replace")

    return _with_redis(redis_url, "refused the revocation", revoke)


def _with_redis(redis_url: str, refused: str, action: Callable[[Any], T]) -> T:
    """action(client) on a short-lived client; KeyStoreError with a one-line reason on any failure."""
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    except ValueError:
        raise KeyStoreError(f"--redis {redacted_url(redis_url)}: not a Redis URL "
                            "(redis://, rediss:// or unix://)") from None
    try:
        return action(client)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise KeyStoreError(f"cannot reach Redis at {redacted_url(redis_url)}: {_reason(exc)}") from None
    except redis.RedisError as exc:
        raise KeyStoreError(f"Redis at {redacted_url(redis_url)} {refused}: {exc}") from None
    finally:
        client.close()


class KeyStoreError(RuntimeError):
    """The key could not be stored; the message is one line for the operator."""


def _reason(exc: Exception) -> str:
    """redis-py's `Error 111 connecting to HOST:PORT. Connection refused.` -> `Connection refused`."""
    text = str(exc).strip()
    match = re.match(r"Error -?\d+ connecting to \S+?\. (.+?)\.?$", text)
    return match.group(1) if match else (text.rstrip(".") or type(exc).__name__)


def redacted_url(redis_url: str) -> str:
    """The URL with any password replaced by ***, fit for messages and logs."""
    parts = urllib.parse.urlsplit(redis_url)
    if parts.password is None:
        return redis_url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
