"""Scheduling through the real engine: chunked prefill, mixed steps, limits, priority,
preemption, abort."""

from __future__ import annotations

import itertools
import random

import pytest

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, RequestOutput
from worker.engine.sampling_params import SamplingParams
from tests.worker.fake_executor import VOCAB_SIZE, PagedFakeExecutor, reference_output





def make_engine(executor: PagedFakeExecutor, **config) -> Engine:
    ticks = itertools.count()
    return Engine(
        executor, None, EngineConfig(block_size=executor.block_size, **config),
        clock=lambda: float(next(ticks)),
    )


def run_to_completion(engine: Engine) -> list[RequestOutput]:
    finished = []
    for _ in range(10_000):
        if not engine.has_unfinished():
            return finished
        finished += [o for o in engine.step() if o.finished]
    raise AssertionError("engine did not finish")


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    executor = PagedFakeExecutor()
    engine = make_engine(executor, max_num_batched_tokens=16)
    engine.add_request("r", list(range(50)), SamplingParams(max_tokens=2))

    run_to_completion(engine)

    chunks = executor.chunks_of(0)
    assert [len(c.token_ids) for c in chunks] == [16, 16, 16, 2, 1]
    assert [c.start_pos for c in chunks] == [0, 16, 32, 48, 50]
    assert [c.sampling is not None for c in chunks] == [False, False, False, True, True]


def test_decodes_run_first_and_a_prefill_chunk_takes_the_remaining_budget() -> None:
    executor = PagedFakeExecutor()
    engine = make_engine(executor, max_num_batched_tokens=16)
    engine.add_request("decoding", [1, 2, 3], SamplingParams(max_tokens=10))
    engine.step()
    engine.add_request("prefilling", list(range(40)), SamplingParams(max_tokens=1))

    engine.step()

    chunks = executor.batches[-1].chunks
    assert [(c.seq_id, len(c.token_ids)) for c in chunks] == [(0, 1), (1, 15)]
    assert chunks[1].sampling is None


def test_no_step_exceeds_the_token_budget_or_the_sequence_limit() -> None:
    rng = random.Random(3)
    executor = PagedFakeExecutor(num_blocks=40)
    engine = make_engine(executor, max_num_batched_tokens=12, max_num_seqs=3)
    prompts = {
        f"r{i}": [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 30))] for i in range(12)
    }
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=5))

    finished = run_to_completion(engine)

    assert all(b.num_tokens <= 12 and len(b.chunks) <= 3 for b in executor.batches)
    assert {o.request_id: o.output_token_ids for o in finished} == {
        r: reference_output(p, 5) for r, p in prompts.items()
    }


@pytest.mark.parametrize(
    ("requests", "expected_order"),
    [
        ([("a", 0), ("b", 0), ("c", 0)], ["a", "b", "c"]),
        ([("low", 5), ("high", 0), ("mid", 1)], ["high", "mid", "low"]),
        (
            [("late-urgent", 0), ("x", 2), ("y", 2), ("urgent", 0)],
            ["late-urgent", "urgent", "x", "y"],
        ),
    ],
    ids=["fifo-within-priority", "lower-value-first", "priority-then-arrival"],
)
def test_waiting_requests_start_by_priority_then_arrival(requests, expected_order) -> None:
    engine = make_engine(PagedFakeExecutor(), max_num_seqs=1)
    for request_id, priority in requests:
        engine.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=2), priority=priority)

    assert [o.request_id for o in run_to_completion(engine)] == expected_order


def preemption_scenario() -> tuple[PagedFakeExecutor, Engine]:
    """Six blocks of 4 tokens; two requests that each grow to 5 blocks cannot both fit."""
    executor = PagedFakeExecutor(num_blocks=6)
    engine = make_engine(executor)
    engine.add_request("lax", list(range(10, 18)), SamplingParams(max_tokens=12), priority=1)
    engine.add_request("urgent", list(range(20, 28)), SamplingParams(max_tokens=12), priority=0)
    return executor, engine


def test_least_urgent_request_is_preempted_and_still_completes_with_the_same_output() -> None:
    _, engine = preemption_scenario()

    finished = run_to_completion(engine)

    assert [o.request_id for o in finished] == ["urgent", "lax"]
    assert engine.stats().num_preemptions == 1
    assert finished[1].output_token_ids == reference_output(list(range(10, 18)), 12)
    assert finished[0].output_token_ids == reference_output(list(range(20, 28)), 12)


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    executor, engine = preemption_scenario()

    run_to_completion(engine)

    lax_chunks = executor.chunks_of(0)
    resumed = next(c for c in lax_chunks[1:] if len(c.token_ids) > 1)  # the recompute chunk
    assert resumed.start_pos > 0 and resumed.start_pos % 4 == 0
    assert engine.stats().prefix_cache_hits_tokens == resumed.start_pos


def test_abort_frees_blocks_so_a_waiting_request_starts_next_step() -> None:
    executor = PagedFakeExecutor(num_blocks=4)
    engine = make_engine(executor)
    engine.add_request("hog", list(range(12)), SamplingParams(max_tokens=4))
    engine.add_request("next", list(range(20, 32)), SamplingParams(max_tokens=1))
    engine.step()
    assert engine.stats().num_waiting == 1

    engine.abort("hog")
    assert engine.block_manager.num_used_blocks == 0
    engine.step()

    assert [c.seq_id for c in executor.batches[-1].chunks] == [1]
