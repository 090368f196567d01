"""API keys: generation and the one-way hash that is all kvgate ever stores."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "kvg-"
REDIS_KEYS_HASH = "kvgate:api_keys"  # Redis hash: sha256(key) -> tenant


def generate_key() -> str:
    """A new random API key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key; configs and Redis hold only this."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def store_in_redis(redis_url: str, key_sha256: str, tenant: str) -> None:
    """Register a key hash for a tenant in Redis, where every gateway replica looks it up."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        client.hset(REDIS_KEYS_HASH, key_sha256, tenant)
    finally:
        client.close()
