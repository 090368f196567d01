"""One watch per request for what ends it from outside: its client going away, or its total time
(upstream.total_timeout_s) running out. The request's own task is cancelled then, so whatever it
awaits upstream (admission, an attempt, the rest of an answer) is aborted at once and cleans up
after itself; `gone` or `expired` says which.

The watcher is a task, started only once the request has run for WATCH_AFTER_S, and the total's
timer with it: most answers that are over sooner (a short non-streaming completion, a refusal) never
pay for either, and a client that leaves in that time is still noticed, WATCH_AFTER_S late at most."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")

# a task per request cost 11-15% of the gateway's CPU on short answers (loadtest/bench_proxy.py); a disconnect noticed this much later
# costs at most this much of a worker's time
WATCH_AFTER_S = 0.05


class ClientWatch:
    """Started in the request's task once its body is read; after after_s, one task waits for
    http.disconnect for the rest of the request. `await watch.run(work)` awaits work in the request's
    task and answers None if the client goes away meanwhile (that task is cancelled then); between
    runs a disconnect cancels nothing. With total_s, the request's task is cancelled (while in a run)
    once that long has passed since the watch began, and `expired` is set: the caller ends the request
    with its timeout error. stop() once the response is complete (uvicorn's receive answers
    http.disconnect after the last body message too)."""

    __slots__ = ("gone", "expired", "_armed", "_task", "_timer", "_watcher", "_deadline", "_expiry")

    def __init__(self, receive: Receive, after_s: float = WATCH_AFTER_S, total_s: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.gone = False
        self.expired = False
        self._armed = False
        self._task = asyncio.current_task(loop)
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = None if total_s is None else loop.time() + total_s
        self._expiry: asyncio.TimerHandle | None = None
        if after_s > 0:
            self._timer = loop.call_later(after_s, self._start, receive)
        else:
            self._start(receive)

    async def run(self, work: Coroutine[Any, Any, T] | Awaitable[T], own_task: bool = False) -> T | None:
        """work's result; None if the client is gone before it ends (work, a coroutine, is then
        closed unstarted if the client was gone already).

        own_task: run work (a coroutine) as a task of its own, awaited here, for work that waits many
        times (a stream, token by token): each of its wake-ups then resumes its own frames only, not the
        request's whole chain of frames awaiting it (the server's, each middleware's, the endpoint's:
        ~15 frames a token). Cancelling the request's task cancels it too."""
        if self.gone:
            getattr(work, "close", _nothing)()
            return None
        if self.expired:
            getattr(work, "close", _nothing)()
            raise asyncio.CancelledError("the request's total time ran out")
        self._armed = True
        try:
            return await (asyncio.get_running_loop().create_task(work) if own_task else work)
        except asyncio.CancelledError:
            if not self.gone:
                raise
            self._task.uncancel()
            return None
        finally:
            self._armed = False

    def stop(self) -> None:
        self._armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._expiry is not None:
            self._expiry.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    def _start(self, receive: Receive) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        self._watcher = loop.create_task(self._watch(receive))
        if self._deadline is not None:
            self._expiry = loop.call_at(self._deadline, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self._armed:
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a broken receive counts as a client gone away
            pass
        self.gone = True
        if self._armed:
            self._task.cancel()


def _nothing() -> None:
    return None
