"""Request work whose cost grows with the request's size (parsing its JSON, tokenizing its
prompt, encoding it for a worker), run in a worker thread once the request is large, so one
large request does not stall every other stream on the event loop.

Below `min_bytes` the work runs inline: a thread hop costs ~0.1 ms, more than a small body's
parse or tokenizing. Tokenizing is the costliest per byte (~0.4 us a byte of text, ~30x a parse),
so it sets the default. Above it, the work must also let go of the interpreter lock while it
runs, or the loop waits for the thread instead: kvgate.json_body parses and encodes with
`yielding=True`, tokenizers encode through `encode_releasing_gil`. The gateway also shortens
the interpreter's switch interval (gateway/server.py), so the loop waits less for the lock.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

DEFAULT_MIN_BYTES = 8 * 1024  # ~2k tokens of text: ~3 ms to tokenize, ~0.1 ms to parse
THREADS = 1  # large requests queue for it; the event loop and the small requests keep the other core
OFFLOAD_NICE = 10  # added to the thread's nice value: the loop gets ~10x its CPU share when both want the core


class Offloader:
    """`await offloader.run(size, fn, *args)`: fn(*args) inline when size < min_bytes, else in
    the worker thread (fn must be safe to run beside the event loop). A caller that is cancelled
    stops waiting; the thread finishes the piece of work it started."""

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, threads: int = THREADS) -> None:
        self.min_bytes = min_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgate-offload", initializer=_yield_cpu)

    def is_large(self, size: int) -> bool:
        return size >= self.min_bytes

    async def run(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not self.is_large(size):
            return fn(*args, **kwargs)
        return await self._in_thread(functools.partial(fn, *args, **kwargs))

    async def run_yielding(self, size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """run() for work that takes `yielding` (kvgate.json_body): True when it runs in the thread."""
        if not self.is_large(size):  # every small request, twice: inline, without awaiting run()
            return fn(*args, yielding=False, **kwargs)
        return await self._in_thread(functools.partial(fn, *args, yielding=True, **kwargs))

    def _in_thread(self, work: Callable[[], T]) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _yield_cpu() -> None:
    """Run the offload thread at a lower CPU priority than the event loop (Linux: nice applies per
    thread), so that on a busy core the loop runs first when both can: a large request's work
    takes the time the small ones leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), OFFLOAD_NICE)
    except (AttributeError, OSError):  # no per-thread priority here: the work still runs, beside the loop
        pass


def encode_releasing_gil(tokenizer: Any, text: str, add_special_tokens: bool) -> Any:
    """A `tokenizers.Tokenizer`'s Encoding of text. encode_batch releases the interpreter lock
    while it tokenizes (encode does not), so from a worker thread it runs beside the event loop;
    one text costs the same either way."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
