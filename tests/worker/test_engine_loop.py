"""The engine end to end over a fake executor that keeps a real paged KV store.

The fake writes every token into (block, offset) slots named by the block table and samples from
what it reads back, so a wrong block table or a wrongly shared cached block changes the output.
"""

from __future__ import annotations

import random
import string

import pytest
from tokenizers import Tokenizer, decoders, models

from worker.engine.block_hash import block_keys, model_seed
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine, RequestOutput, StepFailed
from worker.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from worker.engine.sampling_params import SamplingParams
from worker.executor.base import TokenLogprobs
from tests.worker.fake_executor import VOCAB_SIZE, FailingExecutor, PagedFakeExecutor, reference_output

EOS = 50  # never sampled by the fake unless a test says so




def make_engine(executor: PagedFakeExecutor | None = None, tokenizer=None, **config) -> Engine:
    executor = executor or PagedFakeExecutor()
    config.setdefault("block_size", executor.block_size)
    engine_config = EngineConfig(model_name="fake", **config)
    return Engine(executor, tokenizer, engine_config, eos_token_ids=[EOS])


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def final(outputs: list[RequestOutput]) -> RequestOutput:
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    return outputs[-1]


# ---- correctness under load ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_blocks", "engine_config"),
    [
        (128, {}),
        (128, {"max_num_batched_tokens": 5}),
        (128, {"max_num_seqs": 3}),
        (14, {}),
        (14, {"enable_prefix_caching": False, "max_num_batched_tokens": 7}),
    ],
    ids=["roomy", "tiny-token-budget", "few-seqs", "tight-kv-preempts", "tight-kv-no-prefix-cache"],
)
def test_many_requests_match_the_reference_generation(num_blocks: int, engine_config: dict) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB_SIZE) for _ in range(12)]
    engine = make_engine(PagedFakeExecutor(num_blocks=num_blocks), **engine_config)
    expected = {}
    for i in range(24):
        tail = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(0, 10))]
        prompt = shared[: rng.randrange(1, 13)] + tail
        max_tokens = rng.randrange(1, 20)
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), priority=i % 3)
        expected[f"r{i}"] = reference_output(prompt, max_tokens)

    outputs = run_to_completion(engine)

    for request_id, want in expected.items():
        last = final(outputs[request_id])
        assert last.output_token_ids == want
        assert [t for o in outputs[request_id] for t in o.new_token_ids] == want
        assert last.finish_reason == "length"
        # every step's output, read after the request went on (preempted too), lists the tokens as of that step
        delivered: list[int] = []
        for out in outputs[request_id]:
            delivered += out.new_token_ids
            assert (out.num_output_tokens, out.output_token_ids) == (len(delivered), delivered)
    assert engine.block_manager.num_used_blocks == 0
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_tight_kv_cache_forces_preemption() -> None:
    engine = make_engine(PagedFakeExecutor(num_blocks=6))
    for i in range(3):
        engine.add_request(f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=8))

    outputs = run_to_completion(engine)

    assert engine.stats().num_preemptions > 0
    for i in range(3):
        assert final(outputs[f"r{i}"]).output_token_ids == reference_output([i + 1] * 5, 8)


# ---- stop conditions ----------------------------------------------------------------------------

PROMPT = [3, 1, 4, 1, 5]
GENERATED = reference_output(PROMPT, 12)


@pytest.mark.parametrize(
    ("params", "eos_at", "expected_len", "reason"),
    [
        (SamplingParams(max_tokens=6), None, 6, "length"),
        (SamplingParams(max_tokens=12), 3, 4, "stop"),
        (SamplingParams(max_tokens=4), 3, 4, "stop"),
        (SamplingParams(max_tokens=6, ignore_eos=True), 3, 6, "length"),
        (SamplingParams(max_tokens=12, stop_token_ids=(GENERATED[2],)), None, 3, "stop"),
    ],
    ids=["max-tokens", "eos", "eos-beats-length-on-same-token", "ignore-eos", "stop-token-id"],
)
def test_requests_finish_for_the_right_reason(
    params: SamplingParams, eos_at: int | None, expected_len: int, reason: str
) -> None:
    assert len(set(GENERATED[:4])) == 4  # the table relies on distinct early tokens
    executor = PagedFakeExecutor()
    eos_ids = [GENERATED[eos_at]] if eos_at is not None else []
    engine = Engine(executor, None, EngineConfig(block_size=4), eos_token_ids=eos_ids)
    engine.add_request("r", PROMPT, params)

    last = final(run_to_completion(engine)["r"])

    assert last.output_token_ids == GENERATED[:expected_len]
    assert last.finish_reason == reason


def test_generation_stops_with_length_at_max_model_len() -> None:
    engine = make_engine(max_model_len=8)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=100))

    last = final(run_to_completion(engine)["r"])

    assert (len(last.output_token_ids), last.finish_reason) == (3, "length")


def letters_tokenizer() -> Tokenizer:
    """Token i is the i-th ASCII letter; EOS is special; decoding concatenates."""
    vocab = {c: i for i, c in enumerate((string.ascii_lowercase + string.ascii_uppercase)[:50])}
    vocab["<eos>"] = EOS
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


@pytest.mark.parametrize("include", [False, True], ids=["stop-dropped", "stop-included"])
def test_stop_string_across_tokens_ends_request_and_truncates_text(include: bool) -> None:
    tokenizer = letters_tokenizer()
    full_text = tokenizer.decode(GENERATED)
    stop = full_text[4:7]
    assert full_text.find(stop) == 4
    engine = make_engine(tokenizer=tokenizer)
    engine.add_request(
        "r", PROMPT, SamplingParams(max_tokens=12, stop=(stop,), include_stop_str_in_output=include)
    )

    outputs = run_to_completion(engine)["r"]

    assert "".join(o.new_text for o in outputs) == full_text[: 7 if include else 4]
    assert final(outputs).finish_reason == "stop"
    assert final(outputs).output_token_ids == GENERATED[:7]


def test_streamed_text_equals_decoded_output() -> None:
    tokenizer = letters_tokenizer()
    engine = make_engine(tokenizer=tokenizer)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12))

    outputs = run_to_completion(engine)["r"]

    assert "".join(o.new_text for o in outputs) == tokenizer.decode(GENERATED)


# ---- abort, validation, stats, events ----------------------------------------------------------


def test_abort_frees_blocks_at_once_and_reports_a_final_output() -> None:
    engine = make_engine()
    engine.add_request("r", list(range(10)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0

    out = engine.abort("r")

    assert out is not None and out.finished and out.finish_reason == "abort"
    assert out.output_token_ids == reference_output(list(range(10)), 1)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.abort("r") is None


def test_aborting_a_waiting_request_removes_it_from_the_queue() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request("first", [1, 2], SamplingParams(max_tokens=3))
    engine.add_request("second", [3, 4], SamplingParams(max_tokens=3))
    engine.step()
    assert engine.stats().num_waiting == 1

    engine.abort("second")

    assert engine.stats().num_waiting == 0
    assert set(run_to_completion(engine)) == {"first"}


@pytest.mark.parametrize(
    ("request_id", "prompt", "params", "match"),
    [
        ("dup", [1], SamplingParams(), "already"),
        ("new", [], SamplingParams(), "at least one token"),
        ("new", [1] * 300, SamplingParams(), "max_model_len"),
        ("new", [-1], SamplingParams(), ">= 0"),
        ("new", [1], SamplingParams(stop=("x",)), "tokenizer"),
        ("new", [1], SamplingParams(logprobs=0), "logprobs are not available from the fake executor"),
    ],
    ids=["duplicate-id", "empty-prompt", "prompt-too-long", "negative-token", "stop-no-tokenizer",
         "logprobs-from-an-executor-without-a-distribution"],
)
def test_add_request_rejects_requests_that_cannot_run(request_id, prompt, params, match) -> None:
    engine = make_engine()
    engine.add_request("dup", [1], SamplingParams())

    with pytest.raises(ValueError, match=match):
        engine.add_request(request_id, prompt, params)


def test_stats_count_tokens_preemptions_and_prefix_hits() -> None:
    engine = make_engine()
    prompt = list(range(1, 11))  # 10 tokens: two full blocks of 4
    engine.add_request("a", prompt, SamplingParams(max_tokens=3))
    run_to_completion(engine)
    engine.add_request("b", prompt, SamplingParams(max_tokens=2))
    engine.add_request("c", [9, 9], SamplingParams(max_tokens=2))
    assert (engine.stats().num_waiting, engine.stats().num_running) == (2, 0)

    outputs = run_to_completion(engine)
    stats = engine.stats()

    assert final(outputs["b"]).num_cached_tokens == 8
    assert final(outputs["b"]).num_prompt_tokens == 10
    assert stats.num_prompt_tokens == 22 and stats.num_generation_tokens == 7
    assert stats.prefix_cache_queries_tokens == 22 and stats.prefix_cache_hits_tokens == 8
    assert stats.num_preemptions == 0 and stats.kv_cache_usage == 0.0


def test_kv_events_describe_prompt_and_generated_blocks() -> None:
    events: list[object] = []
    executor = PagedFakeExecutor(num_blocks=64)
    engine = Engine(executor, None, EngineConfig(model_name="fake", block_size=4), events.append)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=7))
    run_to_completion(engine)

    stored = [e for e in events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    all_tokens = PROMPT + GENERATED[:7]  # 12 tokens, the last never computed: 2 full blocks
    assert tokens == all_tokens[:8]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == block_keys(all_tokens[:8], 4, model_seed("fake"))
    assert [e.parent_block_hash for e in stored] == [None, *hashes[:-1]][: len(stored)]

    engine.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared()


def test_evicted_blocks_are_reported_removed() -> None:
    events: list[object] = []
    executor = PagedFakeExecutor(num_blocks=4)
    engine = Engine(executor, None, EngineConfig(block_size=4), events.append)
    for i in range(3):
        engine.add_request(f"r{i}", [i + 1] * 9, SamplingParams(max_tokens=1))
        run_to_completion(engine)

    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert removed and set(removed) <= stored


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("block_size", 0, "engine.block_size"),
        ("max_num_seqs", 0, "engine.max_num_seqs"),
        ("max_num_batched_tokens", -1, "engine.max_num_batched_tokens"),
        ("num_blocks", 0, "engine.num_blocks"),
        ("max_model_len", 0, "engine.max_model_len"),
        ("block_size", 2.5, "engine.block_size"),
    ],
    ids=["zero-block-size", "no-seqs", "negative-budget", "no-blocks", "zero-len", "float-size"],
)
def test_engine_config_rejects_bad_values(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (EngineConfig(block_size=8), "block_size"),
        (EngineConfig(block_size=4, num_blocks=1000), "num_blocks"),
        (EngineConfig(block_size=4, max_model_len=10_000), "max_model_len"),
    ],
    ids=["block-size-mismatch", "more-blocks-than-executor", "longer-than-model"],
)
def test_engine_rejects_config_the_executor_cannot_honour(config: EngineConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(PagedFakeExecutor(), None, config)


# ---- a failed executor step -----------------------------------------------------------------------


def test_a_failed_step_ends_its_requests_caches_nothing_and_the_engine_serves_on():
    executor = FailingExecutor(PagedFakeExecutor(block_size=4))
    engine = make_engine(executor)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # two full blocks: a failed step must not cache them
    engine.add_request("a", prompt, SamplingParams(max_tokens=3))
    engine.add_request("b", [7, 7, 7], SamplingParams(max_tokens=3))
    executor.fail_next_steps(1)

    with pytest.raises(StepFailed) as info:
        engine.step()

    assert sorted(info.value.request_ids) == ["a", "b"]
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_cached_blocks == 0
    engine.add_request("a-again", prompt, SamplingParams(max_tokens=3))
    again = final(run_to_completion(engine)["a-again"])
    assert again.output_token_ids == reference_output(prompt, 3) and again.num_cached_tokens == 0


def test_a_step_whose_executor_returns_too_few_tokens_fails_like_a_raising_one():
    class ShortExecutor(PagedFakeExecutor):
        def execute(self, batch):
            return super().execute(batch)[:-1]

    engine = make_engine(ShortExecutor())
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6, 5], SamplingParams(max_tokens=2))

    with pytest.raises(StepFailed) as info:
        engine.step()

    assert info.value.request_ids == ["a"] and engine.block_manager.num_cached_blocks == 0


class LogprobsFakeExecutor(PagedFakeExecutor):
    """The paged fake with a made-up distribution: the sampled token at -0.5, its successor at -1.5."""

    computes_logprobs = True

    def execute(self, batch):
        tokens = super().execute(batch)
        for chunk, token in zip([c for c in batch.chunks if c.sampling is not None], tokens):
            if chunk.sampling.logprobs is not None:
                top = [token, (token + 1) % VOCAB_SIZE][:chunk.sampling.logprobs]
                chunk.logprobs = TokenLogprobs(-0.5, top, [-0.5, -1.5][:len(top)])
        return tokens


def test_each_output_carries_the_logprobs_of_its_new_token_only_when_asked():
    engine = make_engine(LogprobsFakeExecutor())
    engine.add_request("asked", [3, 1, 4], SamplingParams(max_tokens=4, logprobs=1))
    engine.add_request("not-asked", [2, 7], SamplingParams(max_tokens=4))

    outputs = run_to_completion(engine)

    asked = outputs["asked"]
    assert [[entry.top_token_ids for entry in o.new_logprobs] for o in asked] == [[o.new_token_ids] for o in asked]
    assert [o.new_logprobs for o in outputs["not-asked"]] == [None] * 4


def test_a_step_whose_executor_leaves_out_asked_logprobs_fails_like_a_raising_one():
    class Forgetful(PagedFakeExecutor):
        computes_logprobs = True

    engine = make_engine(Forgetful())
    engine.add_request("a", [3, 1, 4, 1, 5], SamplingParams(max_tokens=2, logprobs=2))

    with pytest.raises(StepFailed, match="step failed") as info:
        engine.step()

    assert info.value.request_ids == ["a"] and "no logprobs" in str(info.value.cause)


def test_under_min_tokens_the_stop_tokens_are_banned_and_then_free():
    executor = PagedFakeExecutor()
    engine = Engine(executor, None, EngineConfig(block_size=4), eos_token_ids=[EOS])
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=(7,)))
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=6))

    run_to_completion(engine)

    r, plain = (executor.chunks_of(seq_id) for seq_id in (0, 1))
    banned = [c.logits_context.banned_token_ids for c in r if c.sampling is not None]
    assert banned == [(EOS, 7)] * 3 + [()] * 3  # drawing output tokens 1-3, then 4-6
    assert all(c.logits_context.token_ids[:len(PROMPT)] == PROMPT for c in r if c.sampling is not None)
    assert all(c.logits_context is None for c in plain)  # nothing adjusts its logits


@pytest.mark.parametrize(("min_tokens", "expected_tokens"), [(0, 7), (5, 7), (6, 12)])
def test_stop_strings_do_not_match_before_min_tokens(min_tokens: int, expected_tokens: int) -> None:
    tokenizer = letters_tokenizer()
    full_text = tokenizer.decode(GENERATED)
    stop = full_text[4:7]  # completed by the 7th token
    assert full_text.find(stop, 5) == -1  # and nowhere later
    engine = make_engine(tokenizer=tokenizer)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, stop=(stop,), min_tokens=min_tokens))

    outputs = run_to_completion(engine)["r"]

    assert len(final(outputs).output_token_ids) == expected_tokens
    assert "".join(o.new_text for o in outputs) == (full_text[:4] if expected_tokens == 7 else full_text)


def test_the_stop_string_or_token_id_that_ended_a_request_is_its_stop_reason() -> None:
    tokenizer = letters_tokenizer()
    stop = tokenizer.decode(GENERATED)[4:7]
    engine = Engine(PagedFakeExecutor(), tokenizer, EngineConfig(block_size=4), eos_token_ids=[GENERATED[5]])
    engine.add_request("string", PROMPT, SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True))
    engine.add_request("token", PROMPT, SamplingParams(max_tokens=12, stop_token_ids=(GENERATED[2],)))
    engine.add_request("eos", PROMPT, SamplingParams(max_tokens=12))
    engine.add_request("length", PROMPT, SamplingParams(max_tokens=2))

    finals = {rid: final(outputs) for rid, outputs in run_to_completion(engine).items()}

    assert {rid: (out.finish_reason, out.stop_reason) for rid, out in finals.items()} == {
        "string": ("stop", stop), "token": ("stop", GENERATED[2]), "eos": ("stop", None), "length": ("length", None)}
