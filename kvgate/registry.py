"""The worker registry in Redis: workers announce themselves with a heartbeat TTL, gateways read it.

A registered worker is one Redis string per worker, `kvgate:registry:worker:<name>`, holding a JSON
record (name, pool, url, model, KV-event endpoint), written with a TTL at every heartbeat, plus its
name in the set `kvgate:registry:workers` (so a gateway lists the registry without SCAN). A worker
whose heartbeats stop (killed, hung, partitioned) vanishes when its key expires; a gateway that
finds a name in the set without a key removes the name. A worker that stops cleanly deletes both
at once.

The heartbeat (`Heartbeat`) refreshes the record only while the worker's own /health answers 200:
a worker that is still loading its model, or whose engine has died, is not announced. It learns
the served model name from the worker's /v1/models when none is given, so the same code serves
`kvgate worker --register` (a thread beside the bundled worker) and `kvgate register` (a sidecar
beside any OpenAI-compatible engine, e.g. vLLM). Gateways read the registry with `read_registry`
(gateway/registry_watch.py turns it into pool membership).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("kvgate.registry")

WORKERS_SET = "kvgate:registry:workers"
RECORD_PREFIX = "kvgate:registry:worker:"
DEFAULT_TTL_S = 6.0
DEFAULT_HEARTBEAT_S = 2.0
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a worker announces: enough for a gateway to route to it and follow its KV events."""

    name: str
    pool: str
    url: str
    model: str
    kv_events_endpoint: str | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> WorkerRecord:
        """Raises ValueError for a record that is not this shape (written by something else)."""
        try:
            fields = json.loads(raw)
            record = cls(name=str(fields["name"]), pool=str(fields["pool"]), url=str(fields["url"]).rstrip("/"),
                         model=str(fields["model"]), kv_events_endpoint=fields.get("kv_events_endpoint") or None)
        except (TypeError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a worker record: {exc}") from None
        return record


def record_key(name: str) -> str:
    return RECORD_PREFIX + name


async def read_registry(client: Any) -> dict[str, WorkerRecord]:
    """The live records by worker name (a redis.asyncio client; Redis errors reach the caller).
    Names whose key has expired are removed from the set; a malformed record is logged and skipped."""
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in await client.smembers(WORKERS_SET))
    if not names:
        return {}
    raws = await client.mget([record_key(n) for n in names])
    records, expired = {}, []
    for name, raw in zip(names, raws):
        if raw is None:
            expired.append(name)
            continue
        try:
            records[name] = WorkerRecord.decode(raw)
        except ValueError as exc:
            log.warning("registry entry %s skipped: %s", name, exc)
    if expired:
        await client.srem(WORKERS_SET, *expired)
    return records


class Heartbeat:
    """Announces one worker while its /health answers, every interval_s, with a TTL of ttl_s.

    run() loops until stop() (for a sidecar's main thread); start() runs it in a daemon thread
    (beside a worker in the same process). Redis errors are logged once per outage and retried at
    the next beat; the worker keeps serving whatever the registry does."""

    def __init__(self, redis_url: str, name: str, pool: str, url: str, *, model: str | None = None,
                 kv_events_endpoint: str | None = None, ttl_s: float = DEFAULT_TTL_S,
                 interval_s: float = DEFAULT_HEARTBEAT_S) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"the heartbeat interval ({interval_s} s) must be positive and below the TTL ({ttl_s} s)")
        import redis

        self._client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.name, self.pool, self.url = name, pool, url.rstrip("/")
        self._model = model
        self._kv_events_endpoint = kv_events_endpoint
        self.ttl_s, self.interval_s = ttl_s, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._redis_down = False
        self._announced = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"registry-heartbeat-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and withdraw the record at once (the next gateway poll drops the worker)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + HEALTH_TIMEOUT_S + 1)

    def run(self) -> None:
        try:
            while True:
                self.beat()
                if self._stop.wait(self.interval_s):
                    break
        finally:
            self._withdraw()

    def beat(self) -> bool:
        """One heartbeat: announce the worker if it is healthy; returns whether it was announced."""
        record = self._record() if self._healthy() else None
        if record is None:
            if self._announced:
                log.warning("worker %s is not healthy: its registration lapses in %.0f s unless it recovers",
                            self.name, self.ttl_s)
                self._announced = False
            return False
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.set(record_key(self.name), record.encode(), px=int(self.ttl_s * 1000))
                pipe.sadd(WORKERS_SET, self.name)
                pipe.execute()
        except Exception as exc:  # any Redis failure: keep serving, try again at the next beat
            if not self._redis_down:
                log.warning("registry at Redis unreachable (%s): worker %s keeps serving, retrying every %.0f s",
                            exc, self.name, self.interval_s)
                self._redis_down = True
            return False
        if self._redis_down or not self._announced:
            log.info("worker %s registered in pool %s as %s (model %s)", self.name, self.pool, self.url, record.model)
        self._redis_down = False
        self._announced = True
        return True

    def _record(self) -> WorkerRecord | None:
        if self._model is None:
            self._model = self._served_model()
            if self._model is None:
                return None
        return WorkerRecord(self.name, self.pool, self.url, self._model, self._kv_events_endpoint)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _served_model(self) -> str | None:
        """The first model id in the worker's /v1/models (None if it does not say)."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=HEALTH_TIMEOUT_S) as response:
                models = json.loads(response.read()).get("data") or []
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return None
        return str(models[0]["id"]) if models and isinstance(models[0], dict) and "id" in models[0] else None

    def _withdraw(self) -> None:
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(record_key(self.name))
                pipe.srem(WORKERS_SET, self.name)
                pipe.execute()
            if self._announced:
                log.info("worker %s left the registry", self.name)
        except Exception as exc:  # the record expires on its own within its TTL
            log.warning("could not withdraw worker %s from the registry (%s): it expires within %.0f s",
                        self.name, exc, self.ttl_s)
        finally:
            self._client.close()



_ANY_ADDRESS = ("0.0.0.0", "::", "*", "")


def advertised_urls(host: str, port: int, kv_events_endpoint: str | None,
                    advertise_host: str | None) -> tuple[str, str | None]:
    """The HTTP URL and KV-event endpoint gateways should use for a worker that listens on host:port
    and publishes on kv_events_endpoint (a bare PORT or tcp://HOST:PORT, as `kvgate worker` takes it):
    advertise_host where given, else the listen address, else (a wildcard) this machine's name."""
    import socket

    def reachable(bound: str) -> str:
        name = advertise_host or (socket.getfqdn() if bound in _ANY_ADDRESS else bound)
        return f"[{name}]" if ":" in name and not name.startswith("[") else name

    url = f"http://{reachable(host)}:{port}"
    if not kv_events_endpoint:
        return url, None
    if kv_events_endpoint.isdigit():
        return url, f"tcp://{reachable('127.0.0.1')}:{kv_events_endpoint}"
    scheme, _, rest = kv_events_endpoint.partition("://")
    if scheme != "tcp":
        return url, kv_events_endpoint  # ipc://: only a gateway on this machine can follow it
    bound, _, kv_port = rest.rpartition(":")
    return url, f"tcp://{reachable(bound.strip('[]'))}:{kv_port}"
