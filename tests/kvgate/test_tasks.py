"""stop_tasks: background tasks end even when a cancel is lost, as Python 3.11's asyncio.wait_for loses
one that arrives as its inner call completes (redis-py writes every command through it)."""

from __future__ import annotations

import asyncio
import gc

from admission.retry_budget import RetryBudgetConfig
from admission.shared_retry_budget import SharedRetryBudget
from kvgate.tasks import stop_tasks


async def loop_that_loses_one_cancel(cycles: list[int]) -> None:
    """A background loop whose call inside swallows the first cancel, as wait_for does on 3.11."""
    swallowed = False
    while True:
        cycles.append(1)
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True  # returned "the result" instead: the loop goes on


def test_a_task_that_loses_its_cancel_is_cancelled_again_until_it_ends():
    async def main() -> None:
        cycles: list[int] = []
        task = asyncio.create_task(loop_that_loses_one_cancel(cycles))
        await asyncio.sleep(0.03)
        task.cancel()  # one cancel, as a plain stop would send
        await asyncio.sleep(0.05)
        assert not task.done()  # the premise: it runs on after its cancel
        assert await stop_tasks([task], timeout_s=2) == set()
        assert task.cancelled()

    asyncio.run(asyncio.wait_for(main(), 5))


def test_tasks_that_never_end_are_returned_after_the_timeout():
    async def main() -> None:
        stop = asyncio.Event()

        async def stubborn() -> None:
            while not stop.is_set():
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    pass

        task = asyncio.create_task(stubborn())
        quick = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0.02)  # both started (a task cancelled before its first step never runs)
        assert await stop_tasks([task, None, quick], timeout_s=0.3) == {task}
        assert quick.cancelled()
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(main(), 5))


def test_what_a_stopped_task_raised_is_retrieved_not_reported_as_lost():
    reported: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))

        async def fails() -> None:
            raise RuntimeError("boom")

        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        assert await stop_tasks([task]) == set()
        del task
        gc.collect()  # an exception never retrieved is reported when its task is collected

    asyncio.run(main())
    assert reported == []


class CountsThatLoseOneCancel:
    """RedisRetryCounts' interface; its first call after a cancel completes as if the cancel had
    arrived as redis-py's wait_for finished writing the command."""

    def __init__(self) -> None:
        self.calls = 0
        self.lost = False

    async def add_and_sum(self, requests: int, retries: int) -> tuple[int, int]:
        self.calls += 1
        try:
            await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            if self.lost:
                raise
            self.lost = True
        return 0, 0

    async def ping(self) -> None:
        return None


def test_a_shared_retry_budget_stops_when_a_redis_call_loses_the_cancel():
    async def main() -> None:
        counts = CountsThatLoseOneCancel()
        budget = SharedRetryBudget(counts, RetryBudgetConfig(ratio=0.1, min_retries_per_s=1.0), 1,
                                   sync_interval_s=0.001)
        await budget.start()
        while not counts.calls:
            await asyncio.sleep(0.001)
        await asyncio.wait_for(budget.aclose(), 2)
        assert counts.lost

    asyncio.run(main())
