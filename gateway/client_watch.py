"""One watcher per request for its client going away: the request's own task is cancelled then, so
whatever it awaits upstream (admission, an attempt, the rest of an answer) is aborted at once and
cleans up after itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientWatch:
    """Started in the request's task once its body is read; one task waits for http.disconnect
    for the rest of the request. `await watch.run(work)` awaits work in the request's task and
    answers None if the client goes away meanwhile (that task is cancelled then); between runs a
    disconnect cancels nothing. stop() once the response is complete (uvicorn's receive answers
    http.disconnect after the last body message too)."""

    __slots__ = ("gone", "_armed", "_task", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._armed = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def run(self, work: Awaitable[T]) -> T | None:
        """work's result; None if the client is gone before it ends (work, a coroutine, is then
        closed unstarted if the client was gone already)."""
        if self.gone:
            getattr(work, "close", _nothing)()
            return None
        self._armed = True
        try:
            return await work
        except asyncio.CancelledError:
            if not self.gone:
                raise
            self._task.uncancel()
            return None
        finally:
            self._armed = False

    def stop(self) -> None:
        self._armed = False
        self._watcher.cancel()

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
