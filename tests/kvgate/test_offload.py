"""kvgate/offload.py: small work runs inline on the event loop, large work in the worker thread;
errors reach the caller either way, and the tokenizer encode it recommends gives the same ids."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kvgate.offload import Offloader, encode_releasing_gil


def current_thread_name() -> str:
    return threading.current_thread().name


def test_work_below_the_threshold_runs_on_the_loop_and_above_it_in_the_worker_thread():
    offloader = Offloader(min_bytes=1000)

    async def run() -> tuple[str, str, str]:
        return (await offloader.run(999, current_thread_name), await offloader.run(1000, current_thread_name),
                threading.current_thread().name)

    try:
        small, large, loop = asyncio.run(run())
    finally:
        offloader.close()
    assert small == loop
    assert large.startswith("kvgate-offload") and large != loop


@pytest.mark.parametrize("size", [10, 10_000], ids=["inline", "offloaded"])
def test_an_error_in_the_work_reaches_the_caller(size):
    offloader = Offloader(min_bytes=1000)

    def fail(message: str) -> None:
        raise ValueError(message)

    try:
        with pytest.raises(ValueError, match="bad input"):
            asyncio.run(offloader.run(size, fail, "bad input"))
    finally:
        offloader.close()


def test_encode_releasing_gil_gives_what_encode_gives():
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    text = "hello world again unknown " * 100
    assert encode_releasing_gil(tokenizer, text, True).ids == tokenizer.encode(text).ids


def test_run_yielding_tells_the_work_where_it_runs():
    offloader = Offloader(min_bytes=1000)

    def where(*, yielding: bool) -> bool:
        return yielding

    async def run() -> tuple[bool, bool]:
        return await offloader.run_yielding(10, where), await offloader.run_yielding(10_000, where)

    try:
        assert asyncio.run(run()) == (False, True)
    finally:
        offloader.close()
