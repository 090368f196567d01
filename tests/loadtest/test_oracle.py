"""The oracle hit rate on hand-made traces (whitespace words as tokens)."""

from __future__ import annotations

import pytest

from loadtest.oracle import oracle_hit_rate, oracle_over_tokens
from loadtest.types import RequestSpec


def _prompts(*texts: str, offsets=None) -> list[RequestSpec]:
    return [RequestSpec(index=i, kind="completion", max_tokens=1, prompt=t,
                        arrival_offset_s=None if offsets is None else offsets[i]) for i, t in enumerate(texts)]


@pytest.mark.parametrize("prompts, block, shared, total", [
    (["a b c d", "a b c d"], 1, 4, 8),
    (["a b c d", "a b x d"], 1, 2, 8),
    (["a b c d", "a b c d e f"], 2, 4, 10),
    (["a b c", "a b c"], 2, 2, 6),            # the partial last block is never shared
    (["a b", "c d", "a b c d"], 1, 2, 8),     # only a prefix counts, not text shared later on
    (["x y", "a b", "a b"], 1, 2, 6),
], ids=["identical", "diverges", "blocks-of-two", "partial-block", "prefix-only", "any-earlier"])
def test_oracle_counts_the_longest_prefix_shared_with_any_earlier_request(prompts, block, shared, total):
    result = oracle_over_tokens([p.split() for p in prompts], block)
    assert (result.shared_tokens, result.prompt_tokens) == (shared, total)


def test_oracle_hit_rate_is_shared_over_prompt_tokens():
    result = oracle_hit_rate(_prompts("s s s s q1", "s s s s q2", "s s s s q3"), block_size_tokens=1)
    assert result.hit_rate == pytest.approx(8 / 15)


def test_oracle_replays_in_arrival_order_when_every_request_has_an_arrival_time():
    specs = _prompts("a b c d", "a b", offsets=[2.0, 1.0])
    assert oracle_hit_rate(specs, block_size_tokens=1).shared_tokens == 2


def test_no_prompts_means_no_hit_rate():
    assert oracle_hit_rate([], 16).hit_rate is None


def test_a_run_cut_short_gets_the_oracle_of_the_requests_it_sent():
    from loadtest.runner import _oracle_over_sent
    from loadtest.types import RequestRecord

    specs = [RequestSpec(index=i, kind="completion", max_tokens=1, prompt=p)
             for i, p in enumerate(["a b", "a b", "c d", "c d"])]
    sent = [RequestRecord(index=i, scheduled_s=0.0, start_s=0.0, end_s=1.0, status=200) for i in (0, 1)]
    planned = {"hit_rate": 0.5, "block_size_tokens": 1, "prompt_tokens": 8, "shared_tokens": 4}
    oracle = _oracle_over_sent(specs, sent, planned)
    assert (oracle["prompt_tokens"], oracle["shared_tokens"], oracle["hit_rate"]) == (4, 2, 0.5)
    assert _oracle_over_sent(specs, sent[:1], planned)["hit_rate"] == 0.0


def test_a_static_partition_with_small_caches_loses_what_does_not_fit():
    from loadtest.oracle import static_partition_hit_rate
    from loadtest.types import RequestSpec

    def req(i: int, group: str, words: str) -> RequestSpec:
        return RequestSpec(index=i, kind="completion", max_tokens=1, prompt=words, prefix_group=group)

    a, b = " ".join(f"a{i}" for i in range(8)), " ".join(f"b{i}" for i in range(8))
    specs = [req(0, "A", a), req(1, "B", b), req(2, "A", a), req(3, "B", b)]
    # two workers: A and B each on its own, both fit (4 blocks of 2 words each)
    assert static_partition_hit_rate(specs, 2, capacity_tokens=8, block_size_tokens=2).hit_rate == 0.5
    # one worker holding one prefix at a time: each evicts the other
    assert static_partition_hit_rate(specs, 1, capacity_tokens=8, block_size_tokens=2).hit_rate == 0.0
    assert static_partition_hit_rate(specs, 1, capacity_tokens=16, block_size_tokens=2).hit_rate == 0.5
