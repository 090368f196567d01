"""The clients of a run: the real `openai` SDK with its default retries (max_retries=2, which honour
Retry-After), one AsyncOpenAI per tenant over one shared HTTP client whose request hook counts the requests
sent for each logical call (each carries CALL_HEADER). Calls start at their arrival times (open loop)
whatever is still in flight; each ends as a CallRecord."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import openai

from loadtest.cascade.records import CallRecord
from loadtest.cascade.workload import Arrival

CALL_HEADER = "x-bench-call"


class AttemptCounter:
    """An event hook on the SDK's HTTP client: counts the requests sent per call (CALL_HEADER's value)."""

    def __init__(self) -> None:
        self.attempts: Counter[int] = Counter()

    async def on_request(self, request: Any) -> None:
        call = request.headers.get(CALL_HEADER)
        if call is not None:
            self.attempts[int(call)] += 1


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """Where the calls go and how: base_url ends in /v1; api_keys maps tenant -> key (routers without auth
    ignore them); timeout_s bounds each attempt, call_timeout_s the whole call, retries included."""

    base_url: str
    model: str
    api_keys: Mapping[str, str]
    max_tokens: int = 8
    max_retries: int = 2  # the SDK's default
    timeout_s: float = 30.0
    call_timeout_s: float = 60.0


class Clients:
    """The tenants' SDK clients over one HTTP client; use as `async with Clients(settings) as clients:`."""

    def __init__(self, settings: ClientSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock, self.counter = settings, clock, AttemptCounter()
        self.http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self.counter.on_request]})
        self.sdk = {tenant: openai.AsyncOpenAI(api_key=key, base_url=settings.base_url, http_client=self.http,
                                               max_retries=settings.max_retries, timeout=settings.timeout_s)
                    for tenant, key in settings.api_keys.items()}

    async def __aenter__(self) -> "Clients":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def open_loop(self, arrivals: Sequence[Arrival], t0: float) -> list[CallRecord]:
        """Each arrival's call at t0 + its offset; every record once all have ended."""
        tasks = []
        for arrival in arrivals:
            delay = t0 + arrival.offset_s - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.call(arrival, t0)))
        return list(await asyncio.gather(*tasks))

    async def closed_loop(self, make: Callable[[int], Arrival], concurrency: int, duration_s: float,
                          t0: float) -> list[CallRecord]:
        """`concurrency` callers, each sending its next call as the last one ends, until duration_s."""
        numbers = iter(range(10**9))

        async def caller() -> list[CallRecord]:
            done = []
            while self.clock() - t0 < duration_s:
                done.append(await self.call(make(next(numbers)), t0))
            return done
        return [r for batch in await asyncio.gather(*(caller() for _ in range(concurrency))) for r in batch]

    async def call(self, arrival: Arrival, t0: float) -> CallRecord:
        """One streamed chat call through the SDK; what it saw."""
        start = self.clock()
        seen: dict[str, Any] = {"ttft_ms": None, "worker": None, "pool": None, "model": None, "status": None}
        try:
            error = await asyncio.wait_for(self._stream(arrival, start, seen), self.settings.call_timeout_s)
        except asyncio.TimeoutError:
            error = "timeout"
        end = self.clock()
        return CallRecord(arrival.index, arrival.tenant, arrival.offset_s, start - t0, end - t0,
                          self.counter.attempts.get(arrival.index, 0), error, **seen)

    async def _stream(self, arrival: Arrival, start: float, seen: dict[str, Any]) -> str | None:
        """Stream the answer, filling `seen`; the error class, None for a success."""
        sdk = self.sdk[arrival.tenant]
        try:
            raw = await sdk.chat.completions.with_raw_response.create(
                model=self.settings.model, messages=list(arrival.messages), max_tokens=self.settings.max_tokens,
                stream=True, stream_options={"include_usage": True}, extra_headers={CALL_HEADER: str(arrival.index)})
            seen.update(status=raw.status_code, worker=raw.headers.get("x-kvgate-worker"),
                        pool=raw.headers.get("x-kvgate-pool"))
            async for chunk in raw.parse():
                seen["model"] = seen["model"] or chunk.model
                if seen["ttft_ms"] is None and chunk.choices and chunk.choices[0].delta.content:
                    seen["ttft_ms"] = (self.clock() - start) * 1000
        except openai.APIStatusError as exc:
            seen["status"] = exc.status_code
            return f"http_{exc.status_code}"
        except openai.APITimeoutError:
            return "timeout"
        except openai.APIConnectionError:
            return "connection"
        except openai.APIError:
            return "stream_error"
        return None if seen["ttft_ms"] is not None else "no_tokens"
