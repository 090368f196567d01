"""Router micro-benchmark: decision latency, index size and event apply rate; prints JSON.

Decision = block keys + index lookup + kv_aware scoring + predicted-entry recording, for an
8,192-token prompt across 64 workers with 1,000,000 indexed blocks. The router runs on a fake
clock advanced 5 ms per decision, so, as in a long-running gateway, the predictions recorded by
earlier decisions expire during later ones: from decision prediction_ttl_s / 5 ms on (2,000 with
kv_aware's 10 s), each decision also runs the expiry path; the default 4,000 iterations make half
the samples include it. The judged decision runs with the router's key cache off (every decision
hashes all 512 blocks); a second run with it on reports the decision for a prompt whose blocks
were seen before (a conversation's next turn). Tokenization is measured apart (a small BPE
trained here, so absolute numbers differ from a real model's tokenizer): a whole encode, and with
the routing tokenizer's prefix cache a conversation's next turn and a completions prompt whose long
context a prompt before it had (kvgate/text_prefix_cache.py). The KV-event rate is
measured through the real subscriber (ZMQ, decode, apply), judged with 32 events per message.
After the index fills, gc.freeze() moves everything allocated so far out of the collector's
generations (as a long-running gateway's steady state would be), so a collection during a
decision does not walk the whole index. Prints JSON and writes the "router" section of
docs/benchmarks.md (--no-doc to skip).
Run: kvgate bench router [--blocks 1000000] [--iterations 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from kvgate.clock import ManualClock
from loadtest.benchdoc import bench_command, machine_description, replace_section
from loadtest.stats import percentile
from router.block_keys import COMPILED_KEYS, PrefixKeyCache
from router.kv_events import BlockStored
from router.kv_index import KvIndex
from router.mask_table import COMPILED_WALK
from router.policies.kv_aware import KvAwareParams
from router.router import Router
from router.rules import RoutingRules, rule
from router.tokenization import RoutingTokenizer
from router.types import RouteRequest, WorkerSpec

MODEL = "bench-model"
BLOCK_SIZE = 16
NUM_WORKERS = 64
PROMPT_TOKENS = 8192
BLOCKS_PER_EVENT = 32
DECISION_P99_TARGET_US = 500
EVENTS_PER_S_TARGET = 200_000
CLOCK_STEP_S = 0.005  # fake time between two decisions


def percentile_us(samples_s: list[float], q: float) -> float:
    """loadtest.stats.percentile of samples in seconds, in microseconds."""
    return percentile(samples_s, q) * 1e6


def fill_index(index: KvIndex, total_blocks: int, prompt: list[int], rng: random.Random) -> dict:
    """Each worker gets random sequences; worker i also holds the first 4*i blocks of the prompt."""
    per_worker = total_blocks // NUM_WORKERS
    events_applied = blocks = 0
    elapsed_s = 0.0
    next_hash = 1
    for w in range(NUM_WORKERS):
        worker_id = f"w{w}"
        shared_blocks = min(4 * w, per_worker, PROMPT_TOKENS // BLOCK_SIZE)
        batches = []
        if shared_blocks:
            hashes = list(range(next_hash, next_hash + shared_blocks))
            next_hash += shared_blocks
            batches.append(BlockStored(hashes, None, prompt[: shared_blocks * BLOCK_SIZE], BLOCK_SIZE, None, "GPU"))
        remaining = per_worker - shared_blocks
        while remaining > 0:
            n = min(BLOCKS_PER_EVENT, remaining)
            tokens = [rng.randrange(50_000) for _ in range(n * BLOCK_SIZE)]
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            batches.append(BlockStored(hashes, None, tokens, BLOCK_SIZE, None, "GPU"))
            remaining -= n
        start = time.perf_counter()
        events_applied += index.apply(worker_id, batches)
        elapsed_s += time.perf_counter() - start
        blocks += sum(len(b.block_hashes) for b in batches)
    return {"events_per_s": events_applied / elapsed_s, "blocks_per_s": blocks / elapsed_s, "blocks_per_event": BLOCKS_PER_EVENT}


def single_block_event_rate(rng: random.Random, num_events: int = 200_000) -> float:
    """Events/s for one-block BlockStored events chained on a parent (a decode-step pattern)."""
    index = KvIndex(default_max_blocks=num_events)
    index.add_worker("w", model_name=MODEL)
    tokens = [rng.randrange(50_000) for _ in range(num_events * BLOCK_SIZE)]
    events = [
        BlockStored([i + 1], i if i else None, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], BLOCK_SIZE, None, "GPU")
        for i in range(num_events)
    ]
    start = time.perf_counter()
    index.apply("w", events)
    return num_events / (time.perf_counter() - start)


_PUBLISHER = """
import sys, time, msgpack, zmq
endpoint, num_events, per_batch, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokens = list(range(1000, 1000 + block_size))
def event(i):
    return ["BlockStored", [i + 1], i if i else None, tokens, block_size, None, "GPU"]
messages = [(i // per_batch).to_bytes(8, "big", signed=True) for i in range(0, num_events, per_batch)]
payloads = [msgpack.packb([time.time(), [event(i) for i in range(j, min(num_events, j + per_batch))], 0])
            for j in range(0, num_events, per_batch)]
socket = zmq.Context.instance().socket(zmq.PUB)
socket.setsockopt(zmq.SNDHWM, 0)
socket.bind(endpoint)
time.sleep(1.0)  # let the subscription reach the publisher (ZMQ's slow joiner)
for seq, payload in zip(messages, payloads):
    socket.send_multipart([b"kv", seq, payload])
time.sleep(30)  # keep the socket open until the subscriber has read everything (it kills us)
"""


@contextlib.asynccontextmanager
async def _subscribed(index: KvIndex, publisher_source: str, num_events: int, per_batch: int):
    """The real subscriber (KvEventSubscriber, on this loop) applying to index what a publisher process
    (publisher_source, _PUBLISHER's arguments) sends over ZMQ ipc; yields the subscriber's counters."""
    from router.subscriber import KvEventSubscriber

    index.add_worker("w", model_name=MODEL)
    index.reserve(num_events)
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/kv-events"
        subscriber = KvEventSubscriber("w", index, endpoint)
        subscriber.start()
        publisher = subprocess.Popen([sys.executable, "-c", publisher_source, endpoint, str(num_events), str(per_batch),
                                      str(BLOCK_SIZE)])
        try:
            yield subscriber.counters
        finally:
            publisher.kill()
            publisher.wait()
            await subscriber.stop()


def subscriber_paced_cpu(num_messages: int = 2000, interval_s: float = 0.001) -> dict:
    """The subscriber's CPU a message (this process's, libzmq's I/O thread included) when messages come one
    at a time, as a live engine publishes them: one one-block event each interval_s. The process's idle CPU
    over as long is taken off."""
    import uvloop

    paced = _PUBLISHER.replace("    socket.send_multipart([b\"kv\", seq, payload])",
                               f"    socket.send_multipart([b\"kv\", seq, payload]); time.sleep({interval_s})")
    assert paced != _PUBLISHER

    async def run() -> dict:
        async with _subscribed(KvIndex(default_max_blocks=num_messages), paced, num_messages, 1) as counters:
            deadline = time.perf_counter() + 120
            while counters.events_applied < 1 and time.perf_counter() < deadline:
                await asyncio.sleep(0.001)
            cpu_before, started, applied_before = time.process_time(), time.perf_counter(), counters.events_applied
            while counters.events_applied < num_messages and time.perf_counter() < deadline:
                await asyncio.sleep(0.05)
            cpu_s, elapsed_s = time.process_time() - cpu_before, time.perf_counter() - started
            messages = counters.events_applied - applied_before
        idle_before = time.process_time()
        await asyncio.sleep(elapsed_s)
        idle_s = time.process_time() - idle_before
        return {"messages": messages, "interval_s": interval_s,
                "cpu_us_per_message": 1e6 * (cpu_s - idle_s) / max(1, messages)}

    return uvloop.run(run())


def subscriber_event_rate(num_events: int, per_batch: int) -> dict:
    """One-block BlockStored events through the real subscriber (ZMQ SUB on an asyncio loop,
    msgpack decode, seq tracking, index apply), published by another process as fast as it can.

    The rate counts from the first batch applied to the last, so the publisher's start-up and
    ZMQ's connection set-up are not in it."""
    import uvloop

    class TimedIndex(KvIndex):
        """Notes when the first and the last batch were applied."""

        first_s = last_s = 0.0

        def apply(self, worker_id, events):  # type: ignore[override]
            applied = super().apply(worker_id, events)
            self.last_s = time.perf_counter()
            self.first_s = self.first_s or self.last_s
            return applied

    async def run() -> dict:
        index = TimedIndex(default_max_blocks=num_events)
        async with _subscribed(index, _PUBLISHER, num_events, per_batch) as counters:
            deadline = time.perf_counter() + 120
            while counters.events_applied < num_events and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)
        # the first batch's own events are applied at first_s: they are not in the interval
        timed_events = counters.events_applied - per_batch
        elapsed_s = index.last_s - index.first_s
        return {"events_per_batch": per_batch, "events": counters.events_applied, "gaps": counters.gaps,
                "events_per_s": timed_events / elapsed_s if elapsed_s > 0 else 0.0}

    return uvloop.run(run())


def decision_latency(router: Router, clock: ManualClock, prompt: list[int], iterations: int) -> dict:
    """Latency of route(); the clock moves CLOCK_STEP_S before each decision (not timed), so
    predictions start to expire after prediction_ttl_s / CLOCK_STEP_S decisions."""
    samples: list[float] = []
    for i in range(iterations):
        req = RouteRequest(model=MODEL, prompt=prompt, request_id=str(i))
        clock.advance(CLOCK_STEP_S)
        start = time.perf_counter()
        router.route(req)
        samples.append(time.perf_counter() - start)
    ttl_s = KvAwareParams().prediction_ttl_s
    return {"p50_us": percentile_us(samples, 0.5), "p99_us": percentile_us(samples, 0.99),
            "mean_us": statistics.fmean(samples) * 1e6, "iterations": iterations,
            "clock_step_ms": CLOCK_STEP_S * 1e3, "prediction_ttl_s": ttl_s,
            "expiring_from_decision": round(ttl_s / CLOCK_STEP_S)}


def decision_with_key_cache(router: Router, key_cache: PrefixKeyCache, clock: ManualClock, prompt: list[int],
                            iterations: int) -> dict:
    """The same decisions with the router's key cache turned on: the prompt's blocks were seen
    before (as a conversation's history is on its next turn), so their keys are reused, not hashed."""
    key_cache.max_entries = PrefixKeyCache().max_entries
    return decision_latency(router, clock, prompt, iterations)


def tokenization_latency(iterations: int) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = [f"word{i}" for i in range(2000)] + ["the", "cache", "router", "block", "prefix"]
    corpus = [" ".join(random.Random(i).choices(words, k=200)) for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    cached = RoutingTokenizer(tokenizer, template)
    uncached = RoutingTokenizer(tokenizer, template, prefix_cache_tokens=0)
    rng = random.Random(1)
    messages: list[dict] = []
    while len(uncached.encode_chat(messages or [{"role": "user", "content": ""}])) < PROMPT_TOKENS:
        messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant", "content": " ".join(rng.choices(words, k=150))})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "and?"})
    full_samples, cached_samples = [], []
    for i in range(iterations):
        turn = messages + [{"role": "assistant", "content": f"reply {i}"}, {"role": "user", "content": f"next {i}"}]
        start = time.perf_counter()
        uncached.encode_chat(turn)
        full_samples.append(time.perf_counter() - start)
        cached.encode_chat(messages)  # the previous turn, as a session would have sent it
        start = time.perf_counter()
        cached.encode_chat(turn)
        cached_samples.append(time.perf_counter() - start)
    # completions: one long context, a new question each time (RAG, vLLM's prefix_repetition benchmark)
    context = " ".join(" ".join(m["content"] for m in messages).split()[:PROMPT_TOKENS])
    full_prompt_samples, cached_prompt_samples = [], []
    for i in range(iterations):
        prompt = f"{context}\nQuestion {i}: " + " ".join(rng.choices(words, k=48))
        start = time.perf_counter()
        uncached.encode_prompt(prompt)
        full_prompt_samples.append(time.perf_counter() - start)
        start = time.perf_counter()
        cached.encode_prompt(prompt)
        cached_prompt_samples.append(time.perf_counter() - start)
    return {
        "prompt_tokens": len(uncached.encode_chat(messages)),
        "full_encode_p50_us": percentile_us(full_samples, 0.5),
        "full_encode_p99_us": percentile_us(full_samples, 0.99),
        "prefix_cached_p50_us": percentile_us(cached_samples, 0.5),
        "prefix_cached_p99_us": percentile_us(cached_samples, 0.99),
        "completion_prompt_tokens": len(uncached.encode_prompt(prompt)),
        "completion_full_encode_p50_us": percentile_us(full_prompt_samples, 0.5),
        "completion_full_encode_p99_us": percentile_us(full_prompt_samples, 0.99),
        "completion_prefix_cached_p50_us": percentile_us(cached_prompt_samples[1:], 0.5),
        "completion_prefix_cached_p99_us": percentile_us(cached_prompt_samples[1:], 0.99),
        "note": "small BPE trained in the benchmark, not a production tokenizer",
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvgate bench router", description=__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--iterations", type=int, default=4000)
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompt = [rng.randrange(50_000) for _ in range(PROMPT_TOKENS)]
    pools = {"main": [WorkerSpec(f"w{i}", MODEL, BLOCK_SIZE, num_blocks=args.blocks) for i in range(NUM_WORKERS)]}
    clock = ManualClock()  # the router's clock, advanced CLOCK_STEP_S per decision
    rules = RoutingRules((rule("default", "main"),))
    index = KvIndex(clock=clock)  # the router reserves its room from the workers' num_blocks
    # key cache off: every decision hashes all 512 blocks (the judged figure)
    key_cache = PrefixKeyCache(max_entries=0)
    router = Router(pools, rules, index=index, clock=clock, rng=random.Random(0), key_cache=key_cache)
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    apply_rate = fill_index(index, args.blocks, prompt, rng)
    rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gc.collect()
    gc.freeze()
    stats = index.stats()
    indexed = sum(stats.blocks_per_worker.values())
    result = {
        "python": sys.version.split()[0],
        "compiled": {"block_keys": COMPILED_KEYS, "index_walk": COMPILED_WALK},
        "workers": NUM_WORKERS,
        "indexed_blocks": indexed,
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK_SIZE,
        "decision": decision_latency(router, clock, prompt, args.iterations),
        "decision_key_cache_hit": decision_with_key_cache(router, key_cache, clock, prompt, args.iterations // 2),
        "index_approx_bytes_per_block": stats.approx_bytes / indexed,
        "index_rss_growth_bytes_per_block": (rss_after_kib - rss_before_kib) * 1024 / indexed,
        "apply_multi_block_events": apply_rate,
        "apply_single_block_events_per_s": single_block_event_rate(rng),
        "subscriber": [subscriber_event_rate(200_000, 32), subscriber_event_rate(50_000, 1)],
        "subscriber_paced": subscriber_paced_cpu(),
        "tokenization": tokenization_latency(max(20, args.iterations // 20)),
    }
    print(json.dumps(result, indent=2))
    if not args.no_doc:
        command = bench_command("router", argv)
        replace_section("router", markdown(result, command.strip()))


def markdown(result: dict, command: str) -> str:
    d, h, t = result["decision"], result["decision_key_cache_hit"], result["tokenization"]
    apply = result["apply_multi_block_events"]
    verdict = "pass" if d["p99_us"] <= DECISION_P99_TARGET_US else "FAIL"
    batched, single = result["subscriber"]
    paced = result["subscriber_paced"]
    events_verdict = "pass" if batched["events_per_s"] >= EVENTS_PER_S_TARGET and not batched["gaps"] else "FAIL"
    compiled = result["compiled"]
    in_c = {True: "in C", False: "in Python (the C extension was not built)"}
    return f"""## Router decision

Command: `{command}`
Machine: {machine_description()} (shared with other work; figures from one run)
Date: {datetime.datetime.now().isoformat(timespec="seconds")}, Python {result["python"]}

Decision = block keys + index lookup + kv_aware scoring + predicted-entry recording, for a
{result["prompt_tokens"]:,}-token prompt across {result["workers"]} workers with {result["indexed_blocks"]:,} indexed blocks
(tokenization apart). The router's clock is fake and moves {d["clock_step_ms"]:g} ms per decision, so predictions
expire during the run as in a long-running gateway: from decision {d["expiring_from_decision"]:,} on (prediction_ttl_s
{d["prediction_ttl_s"]:g} s), each decision also runs the expiry path ({d["iterations"]:,} decisions measured).
The judged decision runs with the router's key cache off; the second row turns it on (the prompt's
blocks were seen before, as a conversation's history is on its next turn). Block keys ran
{in_c[compiled["block_keys"]]} (router/_blockhash.c), the confirmed index walk {in_c[compiled["index_walk"]]}
(router/_mask_lookup.c).

| figure | value | target | result |
|---|---|---|---|
| decision p50 / p99 / mean (all {result["prompt_tokens"] // result["block_size"]} blocks hashed) | {d["p50_us"]:.0f} / {d["p99_us"]:.0f} / {d["mean_us"]:.0f} µs | p99 <= {DECISION_P99_TARGET_US} µs | {verdict} |
| decision p50 / p99 / mean, prompt seen before (key cache: blocks reused) | {h["p50_us"]:.0f} / {h["p99_us"]:.0f} / {h["mean_us"]:.0f} µs | (reported) | |
| index size (approx / RSS growth) | {result["index_approx_bytes_per_block"]:.0f} / {result["index_rss_growth_bytes_per_block"]:.0f} bytes per block | | |
| apply, {apply["blocks_per_event"]}-block events | {apply["events_per_s"]:,.0f} events/s ({apply["blocks_per_s"]:,.0f} blocks/s) | | |
| apply, one-block events (the index alone) | {result["apply_single_block_events_per_s"]:,.0f} events/s | | |
| subscriber: ZMQ SUB + msgpack decode + seq check + apply, one-block events, {batched["events_per_batch"]} per message (a busy engine step) | {batched["events_per_s"]:,.0f} events/s ({batched["events"]:,} events, {batched["gaps"]} gaps) | >= {EVENTS_PER_S_TARGET:,}/s | {events_verdict} |
| subscriber, one event per message | {single["events_per_s"]:,.0f} events/s | (reported) | |
| subscriber, one message each {paced["interval_s"] * 1000:g} ms (a live engine's pace): CPU a message, libzmq's thread included | {paced["cpu_us_per_message"]:.0f} µs | (reported) | |
| chat tokenization, {t["prompt_tokens"]:,} tokens, full encode p50 / p99 | {t["full_encode_p50_us"]:.0f} / {t["full_encode_p99_us"]:.0f} µs | | |
| chat tokenization, next turn with the prefix cache p50 / p99 | {t["prefix_cached_p50_us"]:.0f} / {t["prefix_cached_p99_us"]:.0f} µs | | |
| completions tokenization, {t["completion_prompt_tokens"]:,} tokens, full encode p50 / p99 | {t["completion_full_encode_p50_us"]:.0f} / {t["completion_full_encode_p99_us"]:.0f} µs | | |
| completions tokenization, the same context and a new question, with the prefix cache p50 / p99 | {t["completion_prefix_cached_p50_us"]:.0f} / {t["completion_prefix_cached_p99_us"]:.0f} µs | | |

Tokenization uses {t["note"]}. The subscriber rows publish from another process over ZMQ ipc as
fast as it can; the rate counts from the first batch applied to the last. The paced row publishes
{paced["messages"]:,} messages one at a time and takes this process's idle CPU over as long off its CPU.
"""


if __name__ == "__main__":
    main()
