"""The sim executor: step time from the timing model (fake sleep), stand-in tokens, --sim-timing parsing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker.engine.sampling_params import SamplingParams
from worker.executor.base import SeqChunk, StepBatch
from worker.executor.sim_executor import DEFAULT_SIM_TIMING, SimExecutor, SimTiming

TIMING = SimTiming(name="test", step_overhead_s=1e-3, prefill_token_s=1e-4, decode_seq_s=1e-5, kv_token_s=1e-7)
GREEDY = SamplingParams(temperature=0.0)
VOCAB = 384
EOS = 1


def make_executor(sleeps: list[float] | None = None, **options) -> SimExecutor:
    recorder = sleeps.append if sleeps is not None else (lambda _s: None)
    options = {"block_size": 16, "num_blocks": 64, "max_model_len": 1024, "vocab_size": VOCAB, "eos_token_id": EOS,
               "sleep": recorder, "clock": lambda: 0.0} | options
    return SimExecutor(TIMING, **options)


def chunk(num_tokens: int, start_pos: int = 0, sampling: SamplingParams | None = GREEDY, seq_id: int = 0,
          last_token: int = 100, sample_index: int = 0) -> SeqChunk:
    end = start_pos + num_tokens
    return SeqChunk(seq_id=seq_id, token_ids=[7] * (num_tokens - 1) + [last_token], start_pos=start_pos,
                    block_table=list(range(-(-end // 16))), sampling=sampling, sample_index=sample_index)


@pytest.mark.parametrize(
    ("chunks", "expected_s"),
    [
        ([chunk(100)], 1e-3 + 100 * 1e-4 + 100 * 1e-7),
        ([chunk(32, start_pos=64, sampling=None)], 1e-3 + 32 * 1e-4 + 96 * 1e-7),
        ([chunk(1, start_pos=99), chunk(1, start_pos=49, seq_id=1)], 1e-3 + 2 * 1e-5 + 150 * 1e-7),
        ([chunk(1, start_pos=99), chunk(40, start_pos=10, seq_id=1)], 1e-3 + 1e-5 + 40 * 1e-4 + 150 * 1e-7),
    ],
    ids=["prefill-only", "prefill-chunk-after-cached-prefix", "decode-only", "mixed"],
)
def test_step_sleeps_overhead_plus_prefill_decode_and_kv_costs(chunks, expected_s):
    sleeps: list[float] = []

    make_executor(sleeps).execute(StepBatch(chunks))

    assert sleeps == [pytest.approx(expected_s, rel=1e-12)]


def test_time_already_spent_in_the_step_is_not_slept_again():
    sleeps: list[float] = []
    ticks = iter([10.0, 10.0005, 10.0015])

    executor = make_executor(sleeps, clock=lambda: next(ticks))
    executor.execute(StepBatch([chunk(1, start_pos=9)]))

    assert sleeps == [pytest.approx(1e-3 + 1e-5 + 10 * 1e-7 - 0.0005)]
    assert executor.busy_s == pytest.approx(0.0015)


def test_empty_batch_returns_nothing_and_does_not_sleep():
    sleeps: list[float] = []

    assert make_executor(sleeps).execute(StepBatch([])) == []
    assert sleeps == []


def test_returns_one_token_per_sampling_chunk_in_order():
    first, silent, last = chunk(5, last_token=10), chunk(5, sampling=None, seq_id=1), chunk(1, start_pos=3, seq_id=2)
    executor = make_executor()

    tokens = executor.execute(StepBatch([first, silent, last]))

    assert tokens == executor.execute(StepBatch([first])) + executor.execute(StepBatch([last]))


def test_same_inputs_give_the_same_tokens_on_another_executor():
    batch = StepBatch([chunk(8, last_token=t, seq_id=t) for t in range(10, 30)])

    assert make_executor().execute(batch) == make_executor(num_blocks=999).execute(batch)


def test_sampled_tokens_depend_on_seed_and_sample_index():
    def tokens(seed: int | None, sample_index: int = 0) -> list[int]:
        params = SamplingParams(temperature=0.8, seed=seed)
        batch = StepBatch([chunk(1, last_token=t, seq_id=t, sampling=params, sample_index=sample_index)
                           for t in range(10, 30)])
        return make_executor().execute(batch)

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert tokens(1, sample_index=0) != tokens(1, sample_index=1)
    assert tokens(None) == tokens(0)


def test_greedy_output_continues_the_same_way_from_prompt_plus_partial_output():
    executor = make_executor()

    def generate(last_token: int, num_tokens: int) -> list[int]:
        out = []
        for index in range(num_tokens):
            [last_token] = executor.execute(StepBatch([chunk(1, start_pos=10 + index, last_token=last_token,
                                                             sample_index=index)]))
            out.append(last_token)
        return out

    full = generate(100, 8)
    assert full[:3] + generate(full[2], 5) == full


def test_tokens_stay_in_the_ordinary_range_and_are_never_eos_or_the_fed_token():
    ordinary = range(4, 300)
    executor = make_executor(ordinary_token_ids=ordinary, eos_token_id=5)
    sampled = SamplingParams(temperature=1.0, seed=3)
    batch = StepBatch([chunk(1, last_token=t % VOCAB, seq_id=t, sampling=sampled if t % 2 else GREEDY,
                             sample_index=t) for t in range(2_000)])

    tokens = executor.execute(batch)

    assert all(t in ordinary and t != 5 for t in tokens)
    assert all(token != c.token_ids[-1] for token, c in zip(tokens, batch.chunks))


def test_a_chunk_past_max_model_len_is_rejected():
    with pytest.raises(ValueError, match="exceed max_model_len 64"):
        make_executor(max_model_len=64).execute(StepBatch([chunk(1, start_pos=64)]))


def test_max_model_len_is_capped_by_kv_capacity():
    assert make_executor(num_blocks=4, max_model_len=1024).max_model_len == 64


def test_scaled_multiplies_every_coefficient_and_says_so_in_the_name():
    fast = TIMING.scaled(0.01)

    assert (fast.step_overhead_s, fast.prefill_token_s, fast.decode_seq_s, fast.kv_token_s) == pytest.approx(
        (1e-5, 1e-6, 1e-7, 1e-9))
    assert fast.name == "test x0.01"


def test_default_timing_is_named_for_its_model_and_gpu():
    assert "Llama-3.1-8B" in DEFAULT_SIM_TIMING.name and "H100" in DEFAULT_SIM_TIMING.name


def test_parse_overrides_only_the_given_keys():
    timing = SimTiming.parse(" prefill_token_s=5e-5 , decode_seq_s=0.00003", base=TIMING)

    assert timing == SimTiming(name="test with prefill_token_s=5e-5 , decode_seq_s=0.00003", step_overhead_s=1e-3,
                               prefill_token_s=5e-5, decode_seq_s=3e-5, kv_token_s=1e-7)


def test_parse_takes_a_name():
    timing = SimTiming.parse("name=Qwen3-32B on A100,kv_token_s=0")

    assert (timing.name, timing.kv_token_s) == ("Qwen3-32B on A100", 0.0)
    assert timing.step_overhead_s == DEFAULT_SIM_TIMING.step_overhead_s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "sim_timing: expected key=value pairs such as prefill_token_s=6e-05, got nothing"),
        ("prefill_token_s", "sim_timing: 'prefill_token_s' is not key=value"),
        ("=1", "sim_timing: '=1' is not key=value"),
        ("prefil_token_s=1", "sim_timing: unknown key 'prefil_token_s' (known: name, step_overhead_s, "
                             "prefill_token_s, decode_seq_s, kv_token_s)"),
        ("kv_token_s=1,kv_token_s=2", "sim_timing: key 'kv_token_s' given twice"),
        ("decode_seq_s=fast", "sim_timing.decode_seq_s must be a number of seconds, got 'fast'"),
        ("step_overhead_s=-1", "sim_timing.step_overhead_s must be a finite number of seconds >= 0, got -1.0"),
        ("kv_token_s=nan", "sim_timing.kv_token_s must be a finite number of seconds >= 0, got nan"),
        ("name= ", "sim_timing.name must not be empty"),
    ],
    ids=["empty", "no-equals", "no-key", "unknown-key", "duplicate", "not-a-number", "negative", "nan", "empty-name"],
)
def test_parse_rejects_bad_text_naming_the_key(text, message):
    with pytest.raises(ValueError) as error:
        SimTiming.parse(text)

    assert str(error.value) == message


@pytest.mark.slow
def test_importing_the_sim_executor_does_not_load_torch():
    code = "import sys, worker.executor.sim_executor; sys.exit('torch' in sys.modules)"

    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
