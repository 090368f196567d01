"""Large bodies beside small streams: a small stream's TTFT while ~4 MiB requests go through the
gateway, with their parse, tokenize and encode off the event loop ("offloaded", limits.offload_min_bytes
at its default) or on it ("inline", offload_min_bytes above max_body_bytes), both in the same run.

Processes as in gateway (its fake worker; the real gateway, here two, pinned to a CPU of their
own; the load generator and the fake worker on the others). The pool routes with the default model's
exact tokenizer and max_model_len 8192. Each round measures both gateways (the order alternates):
a quiet phase (Poisson small streams only), then a loaded one (the same, plus paced senders of
large requests, LARGE_RATE_PER_S in all: sporadic large requests beside the small ones, not a
flood that saturates the gateway's core; a sender whose request outlasts its period sends the next at once). Writes results/bench_large_bodies.json and the "large-bodies" section of
docs/benchmarks.md.
Run: kvgate bench large-bodies [--quick] [--no-doc]

Over ~400 lines, and one module all the same: its requests, its two load-generator jobs (harness/load_jobs.py
runs them), its figures and its section are this benchmark's alone; nothing here is used elsewhere, and what is
shared (the fake worker, the raw client, the gateway's setup) already lives in loadtest/harness/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import yaml

from loadtest.benchdoc import bench_command, save_result
from loadtest.harness import load_jobs
from loadtest.harness.gateway import API_KEY, MODEL, child, cpu_placement, gateway_argv, gateway_config, raise_fd_limit
from loadtest.harness.raw_http import Connection, Pool, check_answer
from loadtest.paths import RESULTS_DIR
from loadtest.procs import default_model_dir, free_port, process_cpu_s
from loadtest.sse import StreamReader
from loadtest.stats import percentile
from loadtest.text import seeded_text

SECTION = "large-bodies"
MODULE = "loadtest.benchmarks.large_bodies"  # its load-generator jobs run as `python -m MODULE --job SPEC`
RESULTS_PATH = RESULTS_DIR / "bench_large_bodies.json"
# the verdict, on the offloaded gateway: loaded TTFT p99 <= RATIO x quiet p99 + SLACK, nothing unexpected
TARGET_P99_RATIO = 1.5
TARGET_P99_SLACK_MS = 2.0
MAX_MODEL_LEN = 8192
MAX_BODY_BYTES = 4 * 1024 * 1024  # the gateway's default limits.max_body_bytes
LARGE_BODY_BYTES = MAX_BODY_BYTES - 4096  # the ~4 MiB requests, just under the limit
VOCAB_SIZE = 49152  # SmolLM2's: token ids drawn below it
CHAT_PROMPT_TOKENS = 6500  # ~41 KB of word-list English; under max_model_len with the chat template
FIT_IDS = 8000
SMALL_RATE_PER_S = 20.0
SMALL_MAX_TOKENS = 4
SMALL_PROMPT = "Say hello to the benchmark in a few words."
PROBE_CONNECTIONS = 32
LARGE_SENDERS = 2
LARGE_RATE_PER_S = 8.0  # large requests a second, all senders together (~a fifth of the gateway's core)
WARMUP_S = 1.0
START_LEAD_S = 3.0  # jobs start together this long after they are spawned (building 4 MiB bodies included)
SEED = 0
OFFLOADED, INLINE = "offloaded", "inline"
GATEWAY_LIMITS = {OFFLOADED: {}, INLINE: {"offload_min_bytes": MAX_BODY_BYTES + 1}}
# the fake worker never fails: a health check that times out means the shared host stalled, and the
# worker leaving rotation would turn that stall into seconds of 503s that say nothing about the loop
HEALTH = {"timeout_s": 10.0, "unhealthy_threshold": 3}
LARGE_KINDS = ("ids_4mib", "text_4mib", "chat_6k_tokens", "ids_8k")
EXPECTED = {"ids_4mib": "400 context_length_exceeded", "text_4mib": "400 context_length_exceeded",
            "chat_6k_tokens": "200", "ids_8k": "200"}


# -- requests -----------------------------------------------------------------------------------

def post(port: int, path: str, data: bytes) -> bytes:
    """A raw HTTP/1.1 POST of data (already JSON) to the gateway."""
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer {API_KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data


def token_ids_json(max_bytes: int, seed: int) -> str:
    """A compact JSON array of random token ids, as many as fit in max_bytes (within a few bytes)."""
    rng, text = random.Random(seed), ""
    while len(text) < max_bytes:  # an id below VOCAB_SIZE and its comma take 5.77 bytes on average
        text += "," + ",".join(map(str, rng.choices(range(VOCAB_SIZE), k=int(max_bytes / 5.7) + 1)))
    return "[" + text[1:max_bytes - 1].rsplit(",", 1)[0] + "]"


def completion_data(prompt_json: str, max_bytes: int | None = None) -> bytes:
    """A non-streaming /v1/completions body around an encoded prompt (trimmed to max_bytes when
    given: prompt_json is then a JSON array or string that may be cut and closed again)."""
    head, tail = f'{{"model":"{MODEL}","max_tokens":1,"prompt":', "}"
    if max_bytes is not None and len(head) + len(prompt_json) + len(tail) > max_bytes:
        cut = prompt_json[:max_bytes - len(head) - len(tail) - 1]
        prompt_json = (cut.rsplit(",", 1)[0] + "]") if cut.startswith("[") else cut + '"'
    return (head + prompt_json + tail).encode()


def large_bodies(seed: int) -> dict[str, bytes]:
    """The fixed large bodies: ~4 MiB of token ids, ~4 MiB of text (both over max_model_len), 8,000 ids."""
    text = seeded_text(("text", seed), 10_000)
    repeated = " ".join([text] * (LARGE_BODY_BYTES // len(text) + 1))
    fit_ids = random.Random(seed).choices(range(VOCAB_SIZE), k=FIT_IDS)
    return {"ids_4mib": completion_data(token_ids_json(LARGE_BODY_BYTES, seed), LARGE_BODY_BYTES),
            "text_4mib": completion_data(json.dumps(repeated), LARGE_BODY_BYTES),
            "ids_8k": completion_data(json.dumps(fit_ids, separators=(",", ":")))}


def chat_data(content: str, max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": True}).encode()


def outcome(status: int, body: bytes, stream: bool) -> str:
    """"200" for a whole answer, "200 bad answer", else "STATUS CODE" from the OpenAI error body."""
    if status == 200:
        return "200" if check_answer(status, body, stream, 1) else "200 bad answer"
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return f"{status} {code}"


# -- the load generator's jobs ------------------------------------------------------------------

async def _first_content(conn: Connection, raw: bytes) -> tuple[int, StreamReader]:
    """Send raw; read the answer, feeding its SSE lines to a reader as they arrive (perf_counter).
    An answer that is not a stream sets the reader's error to its outcome (e.g. "503 overloaded")."""
    conn.writer.write(raw)
    head = (await conn.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
    status, reader = int(head[0].split(" ", 2)[1]), StreamReader(clock=time.perf_counter)
    if headers.get("transfer-encoding") != "chunked":
        reader.error = outcome(status, await conn.reader.readexactly(int(headers.get("content-length", "0"))), False)
        return status, reader
    pending = b""
    while size := int((await conn.reader.readuntil(b"\r\n")).split(b";")[0], 16):
        *lines, pending = (pending + (await conn.reader.readexactly(size + 2))[:-2]).split(b"\n")
        for line in lines:
            reader.feed_line(line.decode(errors="replace").rstrip("\r"))
    await conn.reader.readuntil(b"\r\n")
    return status, reader


class StreamPool(Pool):
    """gateway's pool, for streams whose first content is timed as it arrives."""

    async def stream(self, raw: bytes) -> tuple[int, StreamReader]:
        return await self.use(lambda conn: _first_content(conn, raw))


async def _sleep_until(wall_s: float) -> float:
    await asyncio.sleep(max(0.0, wall_s - time.time()))
    return time.perf_counter()


async def probe(port: int, start_at: float, warmup_s: float, duration_s: float, seed: int) -> dict[str, Any]:
    """Small streaming chats at Poisson arrivals; TTFT = scheduled send -> first content (no
    coordinated omission: a request that waits for a connection counts from its schedule)."""
    raw = post(port, "/v1/chat/completions", chat_data(SMALL_PROMPT, SMALL_MAX_TOKENS))
    pool, rng = StreamPool(port, PROBE_CONNECTIONS), random.Random(seed)
    await pool.open()
    ttft_ms: list[float] = []
    late_ms: list[float] = []
    errors: list[str] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(scheduled: float, measured: bool) -> None:
        sent = time.perf_counter()
        try:
            status, reader = await pool.stream(raw)
            ok = status == 200 and reader.done and reader.error is None and reader.text == "tok " * SMALL_MAX_TOKENS
            error = None if ok else f"{status}: {reader.error}"
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            error = repr(exc)
        if measured and error is None:
            ttft_ms.append((reader.content_times_s[0] - scheduled) * 1e3)
            late_ms.append((sent - scheduled) * 1e3)
        elif measured:
            errors.append(error)

    start = await _sleep_until(start_at)
    t = start
    while t < start + warmup_s + duration_s:
        t += rng.expovariate(SMALL_RATE_PER_S)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        task = asyncio.create_task(one(t, t >= start + warmup_s))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    pool.close()
    return {"ttft_ms": ttft_ms, "errors": len(errors), "error_samples": errors[:5],
            "send_late_p99_ms": percentile(late_ms, 0.99) if late_ms else None}


async def send_large(port: int, start_at: float, warmup_s: float, duration_s: float, seed: int) -> dict[str, Any]:
    """LARGE_SENDERS paced senders (LARGE_RATE_PER_S in all), each cycling through LARGE_KINDS (from its own
    offset);
    records [kind, outcome, start offset s, latency ms] for those started after the warm-up."""
    fixed = large_bodies(seed)
    chat_text = seeded_text(("chat", seed), CHAT_PROMPT_TOKENS)
    records: list[list[Any]] = []
    counter = itertools.count()

    def body(kind: str) -> tuple[bytes, bool]:
        if kind == "chat_6k_tokens":  # a new first line each time: nothing of it is cached
            return chat_data(f"Note {next(counter)}: {chat_text}", 1), True
        return fixed[kind], False

    async def sender(offset: int) -> None:
        conn = await Connection.open(port)
        period_s = LARGE_SENDERS / LARGE_RATE_PER_S
        next_at = time.perf_counter() + offset * period_s / LARGE_SENDERS
        for i in itertools.count(offset):
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            next_at = max(next_at + period_s, time.perf_counter())
            if time.perf_counter() >= stop_at:
                break
            kind = LARGE_KINDS[i % len(LARGE_KINDS)]
            data, stream = body(kind)
            path = "/v1/chat/completions" if stream else "/v1/completions"
            started = time.perf_counter()
            try:
                result = outcome(*await conn.request(post(port, path, data)), stream)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                result = f"error {type(exc).__name__}"
                conn.close()
                conn = await Connection.open(port)
            if started >= start + warmup_s:
                records.append([kind, result, started - start, (time.perf_counter() - started) * 1e3])
        conn.close()

    start = await _sleep_until(start_at)
    start_late_s, stop_at = time.time() - start_at, start + warmup_s + duration_s
    await asyncio.gather(*(sender(i) for i in range(LARGE_SENDERS)))
    body_bytes = {kind: len(data) for kind, data in fixed.items()} | {"chat_6k_tokens": len(chat_data(chat_text, 1))}
    return {"records": records, "body_bytes": body_bytes, "start_late_s": start_late_s}


JOBS = {"probe": probe, "large": send_large}


# -- the run ------------------------------------------------------------------------------------

def run_phase(port: int, pid: int, loaded: bool, duration_s: float, seed: int) -> dict[str, Any]:
    """Small streams for warm-up + duration_s (with the large senders beside them when loaded)."""
    spec = {"port": port, "start_at": time.time() + START_LEAD_S, "warmup_s": WARMUP_S, "duration_s": duration_s,
            "seed": seed}
    cpu_before = process_cpu_s(pid)
    large = load_jobs.spawn(MODULE, "large", **spec) if loaded else None
    result = load_jobs.run(MODULE, "probe", **spec)
    if large is not None:
        result["large"] = load_jobs.collect(large, "large")
    result["gateway_cpu_s"] = process_cpu_s(pid) - cpu_before
    return result


def measure(gateways: dict[str, tuple[int, int]], quick: bool) -> list[dict[str, Any]]:
    """Rounds of (quiet, loaded) per gateway, the gateways' order alternating by round."""
    duration_s, num_rounds = (5.0, 2) if quick else (15.0, 3)
    rounds = []
    for index in range(num_rounds):
        order = list(gateways) if index % 2 == 0 else list(gateways)[::-1]
        one: dict[str, Any] = {"order": order, "duration_s": duration_s}
        for name in order:
            port, pid = gateways[name]
            one[name] = {phase: run_phase(port, pid, phase == "loaded", duration_s, SEED + index)
                         for phase in ("quiet", "loaded")}
            print(f"round {index + 1} {name}: " + json.dumps(round_figures(one[name], duration_s)["ttft"]),
                  file=sys.stderr)
        rounds.append(one)
    return rounds


# -- figures ------------------------------------------------------------------------------------

def ttft_figures(ttft_ms: list[float]) -> dict[str, float | int | None]:
    if not ttft_ms:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(ttft_ms), "p50_ms": percentile(ttft_ms, 0.5), "p99_ms": percentile(ttft_ms, 0.99),
            "max_ms": max(ttft_ms)}


def large_figures(records: list[list[Any]], duration_s: float) -> dict[str, Any]:
    """Per kind: how many, their outcomes and latency p50; in all: per second, and the unexpected."""
    kinds = {}
    for kind in LARGE_KINDS:
        mine = [r for r in records if r[0] == kind]
        kinds[kind] = {"sent": len(mine), "outcomes": dict(Counter(r[1] for r in mine)),
                       "latency_p50_ms": percentile([r[3] for r in mine], 0.5) if mine else None}
    return {"per_s": len(records) / duration_s, "kinds": kinds,
            "unexpected": sum(1 for r in records if r[1] != EXPECTED[r[0]])}


def round_figures(phases: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """One gateway in one round: TTFT quiet vs loaded, the large requests, failures, gateway CPU."""
    quiet, loaded = ttft_figures(phases["quiet"]["ttft_ms"]), ttft_figures(phases["loaded"]["ttft_ms"])
    large = large_figures(phases["loaded"]["large"]["records"], duration_s)
    both = quiet["p99_ms"] is not None and loaded["p99_ms"] is not None
    return {"ttft": {"quiet": quiet, "loaded": loaded,
                     "p99_ratio": loaded["p99_ms"] / quiet["p99_ms"] if both else None,
                     "p99_diff_ms": loaded["p99_ms"] - quiet["p99_ms"] if both else None},
            "large": large, "small_errors": phases["quiet"]["errors"] + phases["loaded"]["errors"],
            "gateway_cpu_share": {p: phases[p]["gateway_cpu_s"] / (duration_s + WARMUP_S) for p in ("quiet", "loaded")},
            "send_late_p99_ms": max((phases[p]["send_late_p99_ms"] or 0.0) for p in ("quiet", "loaded"))}


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def gateway_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One gateway over the rounds: the median round's figures; failures and outcomes summed."""
    def med(*path: str) -> float | None:
        values = []
        for r in rounds:
            value: Any = r
            for key in path:
                value = value[key]
            values.append(value)
        return _median(values)

    outcomes: dict[str, Counter] = {kind: Counter() for kind in LARGE_KINDS}
    for r in rounds:
        for kind, figures in r["large"]["kinds"].items():
            outcomes[kind].update(figures["outcomes"])
    summary = {f"{phase}_{q}_ms": med("ttft", phase, f"{q}_ms") for phase in ("quiet", "loaded")
               for q in ("p50", "p99", "max")}
    quiet, loaded = summary["quiet_p99_ms"], summary["loaded_p99_ms"]
    return {**summary, "p99_ratio": loaded / quiet if quiet and loaded is not None else None,
            "p99_diff_ms": loaded - quiet if quiet is not None and loaded is not None else None,
            "large_per_s": med("large", "per_s"), "unexpected": sum(r["large"]["unexpected"] for r in rounds),
            "small_errors": sum(r["small_errors"] for r in rounds),
            "large_outcomes": {k: dict(c) for k, c in outcomes.items()},
            "large_latency_p50_ms": {k: _median([r["large"]["kinds"][k]["latency_p50_ms"] for r in rounds])
                                     for k in LARGE_KINDS},
            "gateway_cpu_share_loaded": med("gateway_cpu_share", "loaded"),
            "send_late_p99_ms": max(r["send_late_p99_ms"] for r in rounds)}


def verdict(offloaded: dict[str, Any]) -> dict[str, Any]:
    """The targets, judged on the offloaded gateway's median figures."""
    quiet, loaded = offloaded["quiet_p99_ms"], offloaded["loaded_p99_ms"]
    limit_ms = TARGET_P99_RATIO * quiet + TARGET_P99_SLACK_MS if quiet is not None else None
    ttft_ok = limit_ms is not None and loaded is not None and loaded <= limit_ms
    nothing_unexpected = offloaded["unexpected"] == 0 and offloaded["small_errors"] == 0
    return {"loaded_p99_limit_ms": limit_ms, "ttft_p99": ttft_ok, "nothing_unexpected": nothing_unexpected,
            "pass": ttft_ok and nothing_unexpected}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    per_round = {name: [round_figures(r[name], r["duration_s"]) for r in rounds] for name in (OFFLOADED, INLINE)}
    gateways = {name: gateway_summary(figures) for name, figures in per_round.items()}
    return {"gateways": gateways, "rounds": per_round, "verdict": verdict(gateways[OFFLOADED])}


# -- the section --------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _outcomes(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} x {o}" for o, n in sorted(counts.items())) or "none"


def markdown(result: dict[str, Any]) -> str:
    f = result["figures"]
    off, inl, v = f["gateways"][OFFLOADED], f["gateways"][INLINE], f["verdict"]
    mark = {True: "pass", False: "FAIL"}
    s = result["settings"]

    def row(label: str, key_a: str, key_b: str | None = None, fmt: Callable[[Any], str] = _ms) -> str:
        cell = (lambda g: f"{fmt(g[key_a])} / {fmt(g[key_b])}") if key_b else (lambda g: fmt(g[key_a]))
        return f"| {label} | {cell(off)} | {cell(inl)} |"

    kinds = "\n".join(
        f"| {k} | {s['body_bytes'].get(k, 0):,} | {EXPECTED[k]} | {_outcomes(off['large_outcomes'][k])} "
        f"({_ms(off['large_latency_p50_ms'][k])} ms) | {_outcomes(inl['large_outcomes'][k])} "
        f"({_ms(inl['large_latency_p50_ms'][k])} ms) |" for k in LARGE_KINDS)
    rounds = "\n".join(
        f"| {i + 1} | {name} | {_ms(r['ttft']['quiet']['p99_ms'])} | {_ms(r['ttft']['loaded']['p99_ms'])} "
        f"| {_ms(r['ttft']['loaded']['max_ms'])} | {r['large']['per_s']:.1f} | {r['gateway_cpu_share']['loaded']:.0%} "
        f"| {r['send_late_p99_ms']:.1f} |"
        for i in range(len(f["rounds"][OFFLOADED])) for name in (OFFLOADED, INLINE) for r in [f["rounds"][name][i]])
    return f"""## Large bodies beside small streams

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; figures from one run; load average
{result['load_average']['start'][0]:.1f} at the start, {result['load_average']['end'][0]:.1f} at the end)
Date: {result['date']}

Two gateways (`python -m kvgate gateway`, exact SmolLM2 routing tokenizer, `max_model_len: {MAX_MODEL_LEN}`) in front of
gateway's fake worker, both on CPU {s['cpus']['gateway']}; the load generator and the fake worker on CPUs
{s['cpus']['load_generator']}. "offloaded": `limits.offload_min_bytes` at its default (bodies from 8 KiB parsed,
tokenized and encoded in a worker thread); "inline": `offload_min_bytes` above `max_body_bytes` (all on the event
loop). {s['rounds']} rounds, the gateways' order alternating; per gateway a quiet phase (small streams only), then a
loaded one, {s['duration_s']:g} s each after {WARMUP_S:g} s of warm-up. Small streams: streaming chats at
{SMALL_RATE_PER_S:g}/s (Poisson), {SMALL_MAX_TOKENS} tokens; TTFT = scheduled send -> first content chunk, at the
client. Loaded: also {LARGE_SENDERS} senders cycling through the large requests below, {LARGE_RATE_PER_S:g}/s in
all. Figures: the
median round. Health checks allow {HEALTH['timeout_s']:g} s and {HEALTH['unhealthy_threshold']} misses, so that a stall of the
shared host does not take the fake worker out of rotation.

| figure | offloaded | inline (baseline) |
|---|---|---|
{row("small-stream TTFT p50 quiet / loaded, ms", "quiet_p50_ms", "loaded_p50_ms")}
{row("small-stream TTFT p99 quiet / loaded, ms", "quiet_p99_ms", "loaded_p99_ms")}
{row("small-stream TTFT max quiet / loaded, ms", "quiet_max_ms", "loaded_max_ms")}
{row("p99 loaded / quiet", "p99_ratio", fmt=lambda x: "-" if x is None else f"{x:.2f}x")}
{row("p99 loaded - quiet, ms", "p99_diff_ms")}
{row("large requests per second", "large_per_s")}
{row("gateway CPU share, loaded phase", "gateway_cpu_share_loaded", fmt=lambda x: f"{x:.0%}")}
{row("unexpected large-request outcomes / failed small streams (all rounds)", "unexpected", "small_errors", fmt=str)}

| target (offloaded gateway) | value | result |
|---|---|---|
| TTFT p99 loaded <= {TARGET_P99_RATIO:g} x quiet p99 + {TARGET_P99_SLACK_MS:g} ms | {_ms(off['loaded_p99_ms'])} ms (limit {_ms(v['loaded_p99_limit_ms'])} ms) | {mark[v['ttft_p99']]} |
| no unexpected outcomes, no failed small streams | {off['unexpected']} / {off['small_errors']} | {mark[v['nothing_unexpected']]} |

Large requests (all rounds; latency: the median round's p50):

| kind | body bytes | expected | offloaded | inline |
|---|---|---|---|---|
{kinds}

ids_4mib: /v1/completions with ~700k token ids; text_4mib: a ~4 MiB text prompt (refused by its length before
tokenizing); chat_6k_tokens: a streaming chat of ~{CHAT_PROMPT_TOKENS:,} tokens of English words (max_tokens 1);
ids_8k: {FIT_IDS:,} token ids (max_tokens 1).

Rounds (late = the load generator's p99 lateness against its schedule, included in TTFT):

| round | gateway | TTFT p99 quiet ms | TTFT p99 loaded ms | TTFT max loaded ms | large req/s | gateway CPU | late p99 ms |
|---|---|---|---|---|---|---|---|
{rounds}

Raw figures: `results/bench_large_bodies.json`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvgate bench large-bodies", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 s phases (a smoke run; noisier)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return load_jobs.job_main(JOBS, args.job)
    raise_fd_limit()
    tokenizer_dir = str(default_model_dir())
    worker_port = free_port()
    gateway_cpus, other_cpus = cpu_placement()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-large-bodies-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        stack.enter_context(child([sys.executable, "-m", "loadtest.benchmarks.gateway", "--fake-worker", str(worker_port)],
                                  worker_port, "/health", tmp_dir, cpus=other_cpus))
        gateways = {}
        for name, limits in GATEWAY_LIMITS.items():
            port = free_port()
            config = gateway_config(port, worker_port)
            config["pools"]["default"].update(tokenizer=tokenizer_dir, max_model_len=MAX_MODEL_LEN)
            config["limits"] = {"max_body_bytes": MAX_BODY_BYTES, **limits}
            config["health"] = HEALTH
            path = tmp_dir / f"gateway-{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            proc = stack.enter_context(child(gateway_argv(path), port, "/ready", tmp_dir,
                                             env={**os.environ, "KVGATE_API_KEY": API_KEY}, cpus=gateway_cpus))
            gateways[name] = (port, proc.pid)
        rounds = measure(gateways, args.quick)
    load_average = {"start": load_start, "end": os.getloadavg()}
    write_result(rounds, args.quick, args.no_doc, load_average, (gateway_cpus, other_cpus))


def write_result(rounds: list[dict[str, Any]], quick: bool, no_doc: bool, load_average: dict[str, Any],
                 cpus: tuple[set[int] | None, set[int] | None]) -> None:
    from loadtest.benchdoc import machine_description, replace_section

    body_bytes = next(r[OFFLOADED]["loaded"]["large"]["body_bytes"] for r in rounds)
    result = {
        "benchmark": SECTION, "command": bench_command("large-bodies", ["--quick"] if quick else []),
        "machine": machine_description(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "settings": {"rounds": len(rounds), "duration_s": rounds[0]["duration_s"], "warmup_s": WARMUP_S,
                     "gateway_limits": GATEWAY_LIMITS, "health": HEALTH, "body_bytes": body_bytes,
                     "cpus": {"gateway": sorted(cpus[0] or []), "load_generator": sorted(cpus[1] or [])}},
        "load_average": load_average,
        "targets": {"p99_ratio": TARGET_P99_RATIO, "p99_slack_ms": TARGET_P99_SLACK_MS},
        "raw": rounds,
    }
    result["figures"] = summarise(rounds)
    save_result(RESULTS_PATH, result)
    if not no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps({"gateways": result["figures"]["gateways"], "verdict": result["figures"]["verdict"]}, indent=2))


if __name__ == "__main__":
    main()
