"""The load driver: streams a workload at an OpenAI-compatible URL, open or closed loop, timing each request.

Open loop sends each request at its arrival time whatever happens to the others (Poisson or gamma
arrivals at a rate, or the workload's own offsets); closed loop keeps `concurrency` requests in
flight. It stops issuing at duration_s or max_requests, and gives in-flight requests
drain_timeout_s more before recording them as `timeout`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

import httpx
from tqdm import tqdm

from loadtest.arrivals import ArrivalProcess
from loadtest.sse import StreamReader
from loadtest.types import RequestRecord, RequestSpec


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """Where to send, how fast (rate_rps for open loop or concurrency for closed loop), and when to stop."""

    base_url: str
    model: str
    api_key: str | None = None
    rate_rps: float | None = None
    concurrency: int | None = None
    arrival: Literal["poisson", "gamma"] = "poisson"
    arrival_cv: float = 1.0
    seed: int = 0
    duration_s: float = 60.0
    max_requests: int | None = None
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    header_prefix: str = "x-kvgate-"
    tenant_api_keys: Mapping[str, str] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.rate_rps is not None and self.concurrency is not None:
            raise ValueError("give a rate (open loop) or a concurrency (closed loop), not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.duration_s <= 0 or self.request_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("duration_s and request_timeout_s must be > 0, drain_timeout_s >= 0")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def api_url(self, kind: str) -> str:
        base = self.base_url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        return f"{base}/chat/completions" if kind == "chat" else f"{base}/completions"


@dataclass(frozen=True, slots=True)
class DriverRun:
    """The records of one run, when it started (unix s) and how long it lasted (s)."""

    records: tuple[RequestRecord, ...]
    started_at_unix_s: float
    duration_s: float


async def run_load(specs: Sequence[RequestSpec], config: DriverConfig, *, clock: Callable[[], float] = time.perf_counter,
                   transport: httpx.AsyncBaseTransport | None = None) -> DriverRun:
    """Run the workload against config.base_url and return one record per request sent."""
    specs = list(specs[:config.max_requests] if config.max_requests else specs)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    bar = tqdm(total=len(specs), file=sys.stderr, disable=not config.progress, unit="req", desc="requests")
    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:
        sender = _Sender(client, config, clock, bar)
        if config.mode == "closed":
            records = await _closed_loop(specs, config, sender)
        else:
            records = await _open_loop(specs, _offsets(specs, config), config, sender)
    bar.close()
    return DriverRun(tuple(sorted(records, key=lambda r: r.start_s)), sender.started_at_unix_s,
                     clock() - sender.t0)


def _offsets(specs: Sequence[RequestSpec], config: DriverConfig) -> list[float]:
    if config.rate_rps is not None:
        return ArrivalProcess(config.rate_rps, config.arrival, config.arrival_cv).offsets_s(len(specs), config.seed)
    if all(s.arrival_offset_s is not None for s in specs):
        return [s.arrival_offset_s for s in specs]  # type: ignore[misc]
    raise ValueError("this workload has no arrival times: give a rate (open loop) or a concurrency (closed loop)")


async def _open_loop(specs: Sequence[RequestSpec], offsets: Sequence[float], config: DriverConfig,
                     sender: "_Sender") -> list[RequestRecord]:
    tasks = []
    for spec, offset_s in sorted(zip(specs, offsets), key=lambda pair: pair[1]):
        if offset_s >= config.duration_s:
            break
        delay_s = sender.t0 + offset_s - sender.clock()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(sender.send(spec, offset_s)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(specs: Sequence[RequestSpec], config: DriverConfig, sender: "_Sender") -> list[RequestRecord]:
    pending = iter(specs)
    records: list[RequestRecord] = []

    async def user() -> None:
        for spec in pending:
            now_s = sender.clock() - sender.t0
            if now_s >= config.duration_s:
                return
            records.append(await sender.send(spec, now_s))

    await asyncio.gather(*(user() for _ in range(config.concurrency or 1)))
    return records


class _Sender:
    """Sends one request and turns what came back into a RequestRecord."""

    def __init__(self, client: httpx.AsyncClient, config: DriverConfig, clock: Callable[[], float], bar: tqdm) -> None:
        self.client, self.config, self.clock, self.bar = client, config, clock, bar
        self.t0 = clock()
        self.started_at_unix_s = time.time()
        self.hard_deadline = self.t0 + config.duration_s + config.drain_timeout_s

    async def send(self, spec: RequestSpec, scheduled_s: float) -> RequestRecord:
        start = self.clock()
        reader = StreamReader(self.clock)
        status, error, headers = None, None, {}
        budget_s = max(0.001, min(self.config.request_timeout_s, self.hard_deadline - start))
        try:
            async with asyncio.timeout(budget_s):
                status, error, headers = await self._stream(spec, reader)
        except TimeoutError:
            error = "timeout"
        except httpx.HTTPError as exc:
            error = type(exc).__name__
        end = self.clock()
        self.bar.update(1)
        return self._record(spec, scheduled_s, start, end, status, error or reader.error, headers, reader)

    async def _stream(self, spec: RequestSpec, reader: StreamReader) -> tuple[int, str | None, dict[str, str]]:
        url = self.config.api_url(spec.kind)
        async with self.client.stream("POST", url, json=spec.body(self.config.model), headers=self._headers(spec)) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith(self.config.header_prefix)}
            if resp.status_code != 200:
                await resp.aread()
                return resp.status_code, f"http_{resp.status_code}", headers
            async for line in resp.aiter_lines():
                reader.feed_line(line)
        return resp.status_code, None if reader.done else "incomplete_stream", headers

    def _headers(self, spec: RequestSpec) -> dict[str, str]:
        headers = {"accept": "text/event-stream"}
        key = self.config.tenant_api_keys.get(spec.tenant or "", self.config.api_key)
        if key:
            headers["authorization"] = f"Bearer {key}"
        if spec.session_id:
            headers["x-session-id"] = spec.session_id
        return headers

    def _record(self, spec: RequestSpec, scheduled_s: float, start: float, end: float, status: int | None,
                error: str | None, headers: dict[str, str], reader: StreamReader) -> RequestRecord:
        times = reader.content_times_s
        return RequestRecord(
            index=spec.index, scheduled_s=scheduled_s, start_s=start - self.t0, end_s=end - self.t0,
            status=status, error=error, ttft_ms=(times[0] - start) * 1000 if times else None,
            itl_ms=tuple((b - a) * 1000 for a, b in zip(times, times[1:])), e2e_ms=(end - start) * 1000,
            prompt_tokens=reader.usage_int("prompt_tokens"),
            output_tokens=reader.usage_int("completion_tokens") if reader.usage else len(times),
            cached_tokens=reader.usage_int("prompt_tokens_details", "cached_tokens"),
            session_id=spec.session_id, tenant=spec.tenant, headers=headers)
