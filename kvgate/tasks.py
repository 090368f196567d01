"""Stopping background tasks: cancel, and cancel again until they end.

One cancel is not always enough on Python 3.11: asyncio.wait_for returns the inner result when the
cancel arrives just as the inner call completes, and the cancel is lost (fixed in 3.12). redis-py
writes every command through wait_for when the client has a socket timeout, so a loop around a Redis
call can swallow its cancel and run on, and a shutdown that awaited it would hang. stop_tasks()
repeats the cancel until each task has ended; every stop of background work goes through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_INTERVAL_S = 0.1


async def stop_tasks(tasks: Iterable[asyncio.Task | None], timeout_s: float | None = None) -> set[asyncio.Task]:
    """Cancel the tasks (None entries are skipped) and wait until each has ended, cancelling again
    every RECANCEL_INTERVAL_S those still running; returns those left running after timeout_s
    (None: wait as long as it takes). What a task raised is retrieved and dropped: a stopping task's
    error is its own to log."""
    pending = {task for task in tasks if task is not None}
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        wait_s = RECANCEL_INTERVAL_S if deadline is None else min(RECANCEL_INTERVAL_S, deadline - loop.time())
        if wait_s <= 0:
            break
        done, pending = await asyncio.wait(pending, timeout=wait_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # marks it retrieved
    return pending
