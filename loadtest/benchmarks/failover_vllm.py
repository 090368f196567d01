"""Exact mid-stream failover in front of two real vLLM (CPU build) workers: a greedy answer whose worker
is killed half-way goes on, token for token, on the other worker, for completions and for chat.

Two vLLM workers (KV events on) behind the real gateway (`python -m kvgate gateway`). For each kind the
uninterrupted greedy answer through the gateway (temperature 0, max_tokens 1200, ignore_eos) is the
reference; the same request is sent again and, after 100 content chunks, the serving worker's process
group (API server and engine) is SIGKILLed. The one stream the client reads is compared with the
reference (token ids, text, usage) and the gateway's kvgate_failovers_total is read by mode. Where they
differ, the exact continuation prompt goes straight to vLLM, to tell vLLM's own prefill-vs-decode
numerics from a gateway defect. The killed worker is restarted before the next kind.
Writes results/bench_failover_vllm.json and the "failover-vllm" section of docs/benchmarks.md.
Run: kvgate bench failover-vllm [--no-doc]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import yaml

from loadtest.benchdoc import bench_command, save_result
from loadtest.harness.gateway import gateway_argv
from loadtest.paths import RESULTS_DIR
from loadtest.peers.vllm import VLLM_BLOCK_SIZE, VllmWorker, ensure_vllm_venv
from loadtest.procs import ChildProcess, default_model_dir, free_port
from loadtest.prometheus_text import parse_samples
from loadtest.sse import StreamReader

SECTION = "failover-vllm"
RESULTS_PATH = RESULTS_DIR / "bench_failover_vllm.json"
LOG_DIR = RESULTS_DIR / "bench_failover_vllm"
MODEL = "SmolLM2-135M-Instruct"
POOL = "default"
API_KEY = "bench-failover-key"
MAX_TOKENS = 1200
KILL_AFTER_CHUNKS = 100
ROTATION_TIMEOUT_S = 60.0
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
# the surviving worker's counters read around a failover: how much it was given, found cached, generated
SURVIVOR_COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total", "cached_tokens": "vllm:prefix_cache_hits_total",
                     "generated_tokens": "vllm:generation_tokens_total"}
COMPLETION_PROMPT = "The history of the Roman Empire"
CHAT_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user",
                  "content": "Explain step by step how a compiler turns source code into machine code."}]


# -- one streamed answer --------------------------------------------------------------------------

@dataclass(slots=True)
class Answer:
    """What the client read of one stream: the serving worker (x-kvgate-worker), generated text and ids."""

    worker: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    num_chunks: int = 0  # chunks that carried generated tokens
    wall_s: float = 0.0

    def feed(self, chunk: dict[str, Any]) -> bool:
        """Take one chunk's ids and finish reason; True when it carried generated tokens."""
        choice = (chunk.get("choices") or [{}])[0]
        if self.prompt_token_ids is None:  # chat: on the first chunk; completions: in its choice
            self.prompt_token_ids = chunk.get("prompt_token_ids") or choice.get("prompt_token_ids")
        self.token_ids.extend(choice.get("token_ids") or ())
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        carried = bool(choice.get("token_ids") or choice.get("text") or (choice.get("delta") or {}).get("content"))
        self.num_chunks += carried
        return carried

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")


def request_body(kind: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if kind == "chat":
        body["messages"] = CHAT_MESSAGES
    else:
        body["prompt"] = COMPLETION_PROMPT
    return body


def stream_answer(client: httpx.Client, url: str, body: dict[str, Any],
                  on_chunk: Callable[[Answer], None] | None = None) -> Answer:
    """Read one whole stream; on_chunk(answer) after each chunk that carried tokens."""
    answer, reader, started = Answer(), StreamReader(), time.monotonic()
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"POST {url}: {response.status_code} {response.read()[:500]!r}")
        answer.worker = response.headers.get("x-kvgate-worker")
        for chunk in reader.read(response.iter_lines()):
            if answer.feed(chunk) and on_chunk is not None:
                on_chunk(answer)
    answer.text, answer.usage, answer.done, answer.error = reader.text, reader.usage, reader.done, reader.error
    answer.wall_s = time.monotonic() - started
    return answer


# -- comparison, verdicts (pure) ------------------------------------------------------------------

def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where a and b differ (a length difference counts at the shorter's end); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: Answer, failover: Answer) -> dict[str, Any]:
    token_diff = first_difference(reference.token_ids, failover.token_ids)
    return {"token_first_diff": token_diff, "text_first_diff": first_difference(reference.text, failover.text),
            "matched_tokens": len(reference.token_ids) if token_diff is None else token_diff,
            "reference_tokens": len(reference.token_ids), "failover_tokens": len(failover.token_ids),
            "reference_chars": len(reference.text), "failover_chars": len(failover.text),
            "reference_completion_tokens": reference.completion_tokens,
            "failover_completion_tokens": failover.completion_tokens,
            "same_prompt_ids": reference.prompt_token_ids == failover.prompt_token_ids}


def failovers_by_mode(metrics_text: str, pool: str = POOL) -> dict[str, float]:
    """kvgate_failovers_total of one pool, by mode, from the gateway's /metrics."""
    return {labels.get("mode", ""): value for labels, value in parse_samples(metrics_text, "kvgate_failovers_total")
            if labels.get("pool") == pool}


def survivor_counts(before: str, after: str) -> dict[str, int]:
    """What the surviving vLLM worker did between two scrapes of its /metrics (SURVIVOR_COUNTERS)."""
    return {key: round(metric_total(after, name) - metric_total(before, name))
            for key, name in SURVIVOR_COUNTERS.items()}


def cut_tokens(survivor: dict[str, int], prompt_token_ids: list[int] | None) -> int | None:
    """Where the survivor took over: the prompt tokens it was given minus the request's own."""
    return None if prompt_token_ids is None else survivor["prompt_tokens"] - len(prompt_token_ids)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    modes = sorted({"token_ids", "text", *before, *after})
    return {mode: round(after.get(mode, 0.0) - before.get(mode, 0.0)) for mode in modes}


def metric_total(metrics_text: str, name: str) -> float:
    """The sum of one metric's samples (a vLLM worker runs one engine)."""
    return sum(value for _, value in parse_samples(metrics_text, name))


def judge(kind_result: dict[str, Any]) -> dict[str, bool]:
    """What a failover must give the client: one complete stream, the same ids, text and usage as
    the uninterrupted answer, and exactly one failover, continued from token ids."""
    c, stream, failovers = kind_result["comparison"], kind_result["failover"], kind_result["failovers"]
    return {"one_complete_stream": stream["done"] and stream["error"] is None,
            "failed_over": kind_result["killed"] is not None and kind_result["continued_on"] != kind_result["killed"],
            "same_token_ids": c["token_first_diff"] is None and c["reference_tokens"] == MAX_TOKENS,
            "same_text": c["text_first_diff"] is None,
            "same_usage": c["failover_completion_tokens"] == c["reference_completion_tokens"] == MAX_TOKENS,
            "token_ids_mode": failovers.get("token_ids") == 1 and failovers.get("text") == 0}


def blame(failover_diff: int | None, cut: int | None, direct_diff: int | None, direct_matches_failover: bool) -> str:
    """Who made the failed-over answer differ from the reference: "none"; "first_worker" (before the
    cut the tokens are the first worker's own, relayed as they came); "vllm_numerics" (vLLM, given the
    exact continuation prompt directly, gives the failed-over answer, differing from the reference at
    the same token); else "gateway"."""
    if failover_diff is None:
        return "none"
    if cut is not None and failover_diff < cut:
        return "first_worker"
    if direct_diff == failover_diff and direct_matches_failover:
        return "vllm_numerics"
    return "gateway"


def summarise(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    verdicts = {kind: judge(result) for kind, result in kinds.items()}
    return {"verdicts": verdicts, "pass": {kind: all(v.values()) for kind, v in verdicts.items()},
            "all_pass": bool(verdicts) and all(all(v.values()) for v in verdicts.values())}


def markdown(result: dict[str, Any]) -> str:
    rows, notes = [], []
    for kind, r in result["kinds"].items():
        c, fo = r["comparison"], r["failovers"]
        ok = result["figures"]["pass"][kind]
        rows.append(f"| {kind} | {r['killed']} after {r['kill_at_chunks']} chunks ({r['kill_at_tokens']} tokens) "
                    f"| {r['continued_on']} at token {_dash(r['cut_tokens'])}{_cached(r['survivor'])} "
                    f"| {c['reference_tokens']} / "
                    f"{c['failover_tokens']} | {c['matched_tokens']} | {_dash(c['token_first_diff'])} "
                    f"| {_dash(c['text_first_diff'])} | {c['reference_completion_tokens']} / "
                    f"{c['failover_completion_tokens']} | {fo.get('token_ids', 0)} / {fo.get('text', 0)} "
                    f"| {r['reference']['wall_s']:.0f} / {r['failover']['wall_s']:.0f} s "
                    f"| {'pass' if ok else 'FAIL'} |")
        if r["diagnosis"] is not None:
            notes.append(_diagnosis_line(kind, r["diagnosis"]))
    s = result["settings"]
    return f"""## Failover on real vLLM workers

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; one run)
Date: {result['date']}

Two vLLM {result['vllm_version']} CPU workers ({s['model']}, float32, block size 32, prefix caching, KV events;
one core each) behind the real gateway (`python -m kvgate gateway`, policy {s['policy']}, the model's own
tokenizer). Each kind: the uninterrupted greedy answer through the gateway (temperature 0, max_tokens
{s['max_tokens']}, ignore_eos, return_token_ids) is the reference; the same request is sent again and after
{s['kill_after_chunks']} content chunks the serving worker's process group is SIGKILLed; the client reads one
stream. The cut is where the other worker took over (its prompt tokens minus the request's, from its
`vllm:prompt_tokens_total`); cached = its `vllm:prefix_cache_hits_total` for the continuation (KV it reused
rather than prefilled). Target: the failed-over answer equals the reference token for token, text and
usage too, with one failover counted as `mode="token_ids"`.

| kind | killed | continued on | tokens reference / failover | tokens matched | first differing token | first differing char | completion_tokens reference / failover | failovers token_ids / text | wall reference / failover | result |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}
{chr(10).join(notes)}
Raw figures (ids and text of every answer): `results/bench_failover_vllm.json`.
"""


def _diagnosis_line(kind: str, d: dict[str, Any]) -> str:
    return (f"\n{kind}: blamed on {d['blame']}. vLLM given the exact continuation prompt directly "
            f"(prompt ids + the reference's first {d['cut']} ids, temperature 0) differs from the reference at "
            f"token {_dash(d['direct_first_diff'])}; it "
            f"{'matches' if d['direct_matches_failover'] else 'differs from'} the failed-over answer.\n")


def _cached(survivor: dict[str, int] | None) -> str:
    if survivor is None:
        return ""
    return (f" ({survivor['prompt_tokens']} prompt tokens, {survivor['cached_tokens']} of them cached; "
            f"{survivor['generated_tokens']} generated)")


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


# -- processes ------------------------------------------------------------------------------------

def gateway_config(port: int, workers: Sequence[VllmWorker], tokenizer: Path, policy: str) -> dict[str, Any]:
    return {"gateway": {"host": "127.0.0.1", "port": port},
            "pools": {POOL: {"model": MODEL, "tokenizer": str(tokenizer), "policy": {"type": policy},
                             "workers": [{"name": w.name, "url": w.url, "kv_events_endpoint": w.kv_events_endpoint,
                                          "block_size": VLLM_BLOCK_SIZE} for w in workers]}}}


def wait_in_rotation(gateway_url: str, worker: str, timeout_s: float = ROTATION_TIMEOUT_S) -> float:
    """Wait until the gateway has the worker back in rotation with its breaker closed; seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        text = scrape(gateway_url)
        healthy = {labels.get("worker"): v for labels, v in parse_samples(text, "kvgate_worker_healthy")}
        breaker = {labels.get("worker"): v for labels, v in parse_samples(text, "kvgate_breaker_state")}
        if healthy.get(worker) == 1 and breaker.get(worker) == 0:
            return time.monotonic() - started
        time.sleep(0.5)
    raise RuntimeError(f"the gateway did not take {worker} back into rotation within {timeout_s:g} s")


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=10.0).text


# -- the run --------------------------------------------------------------------------------------

def run_kind(kind: str, client: httpx.Client, gateway_url: str, workers: dict[str, VllmWorker]) -> dict[str, Any]:
    """Reference, then the same request with its worker killed mid-answer, then the worker restarted."""
    url = gateway_url + PATHS[kind]
    reference = stream_answer(client, url, request_body(kind))
    print(f"{kind}: reference from {reference.worker}, {len(reference.token_ids)} tokens in {reference.wall_s:.0f} s",
          file=sys.stderr)
    gateway_before, workers_before = scrape(gateway_url), {n: scrape(w.url) for n, w in workers.items()}
    kill: dict[str, Any] = {}

    def on_chunk(answer: Answer) -> None:
        if answer.num_chunks == KILL_AFTER_CHUNKS and answer.worker in workers:
            workers[answer.worker].crash()
            kill.update(worker=answer.worker, chunks=answer.num_chunks, tokens=len(answer.token_ids))

    failover = stream_answer(client, url, request_body(kind), on_chunk)
    failovers = counter_delta(failovers_by_mode(gateway_before), failovers_by_mode(scrape(gateway_url)))
    survivor = next((n for n in workers if n != kill.get("worker")), None)
    counts = survivor_counts(workers_before[survivor], scrape(workers[survivor].url)) if survivor and kill else None
    cut = cut_tokens(counts, failover.prompt_token_ids) if counts else None
    comparison = compare(reference, failover)
    print(f"{kind}: killed {kill.get('worker')} after {kill.get('tokens')} tokens, continued on {survivor} at "
          f"{cut}; first differing token {comparison['token_first_diff']}", file=sys.stderr)
    diagnosis = None
    if comparison["token_first_diff"] is not None and survivor is not None:
        diagnosis = diagnose(client, workers[survivor].url, reference, failover, cut, comparison["token_first_diff"])
    restart_s = _restart(workers[kill["worker"]], gateway_url) if kill else None
    return {"path": PATHS[kind], "killed": kill.get("worker"), "kill_at_chunks": kill.get("chunks"),
            "kill_at_tokens": kill.get("tokens"), "continued_on": survivor, "cut_tokens": cut, "survivor": counts,
            "failovers": failovers, "comparison": comparison, "diagnosis": diagnosis, "restart_s": restart_s,
            "reference": asdict(reference), "failover": asdict(failover)}


def diagnose(client: httpx.Client, worker_url: str, reference: Answer, failover: Answer, cut: int | None,
             failover_diff: int) -> dict[str, Any]:
    """Send the exact continuation prompt (prompt ids + the reference's ids up to the cut) straight to
    vLLM and compare its answer with the reference's remainder and with the failed-over answer's."""
    if cut is None or reference.prompt_token_ids is None:
        return {"blame": blame(failover_diff, cut, None, False), "cut": cut, "direct_first_diff": None,
                "direct_matches_failover": False, "note": "no cut or prompt ids known: no direct check"}
    body = {"model": MODEL, "prompt": reference.prompt_token_ids + reference.token_ids[:cut],
            "max_tokens": MAX_TOKENS - cut, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = client.post(f"{worker_url}/v1/completions", json=body)
    response.raise_for_status()
    direct = response.json()["choices"][0]["token_ids"]
    diff = first_difference(reference.token_ids[cut:], direct)
    direct_diff = None if diff is None else cut + diff
    matches = first_difference(failover.token_ids[cut:], direct) is None
    return {"blame": blame(failover_diff, cut, direct_diff, matches), "cut": cut, "direct_first_diff": direct_diff,
            "direct_matches_failover": matches, "direct_token_ids": direct}


def _restart(worker: VllmWorker, gateway_url: str) -> float:
    started = time.monotonic()
    worker.start()
    worker.wait_healthy()
    wait_in_rotation(gateway_url, worker.name)
    return time.monotonic() - started


def run(policy: str) -> dict[str, Any]:
    python, model_dir = ensure_vllm_venv(), default_model_dir()
    for old_log in LOG_DIR.glob("*.log"):  # this run's logs only (a restarted worker appends to its own)
        old_log.unlink()
    workers = {name: VllmWorker(name, i % (os.cpu_count() or 1), python, model_dir, MODEL, LOG_DIR)
               for i, name in enumerate(("w0", "w1"))}
    gateway_port = free_port()
    gateway: ChildProcess | None = None
    with tempfile.TemporaryDirectory(prefix="bench-failover-vllm-") as tmp:
        config_path = Path(tmp) / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(gateway_config(gateway_port, list(workers.values()), model_dir, policy)))
        try:
            for worker in workers.values():  # both boot at once
                worker.start()
            for worker in workers.values():
                worker.wait_healthy()
            gateway = ChildProcess("gateway", gateway_argv(config_path), LOG_DIR / "gateway.log",
                                   f"http://127.0.0.1:{gateway_port}/ready", {"KVGATE_API_KEY": API_KEY})
            gateway.wait_healthy(60.0)
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            version = httpx.get(f"{workers['w0'].url}/version", timeout=5.0).json().get("version")
            timeout = httpx.Timeout(600.0, connect=10.0)
            with httpx.Client(headers={"authorization": f"Bearer {API_KEY}"}, timeout=timeout) as client:
                kinds = {kind: run_kind(kind, client, gateway_url, workers) for kind in PATHS}
        finally:
            if gateway is not None:
                gateway.stop()
            for worker in workers.values():
                worker.stop()
    return {"vllm_version": version, "model_dir": str(model_dir), "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench failover-vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--policy", default="kv_aware", help="the pool's routing policy (default kv_aware)")
    args = parser.parse_args(argv)
    from loadtest.benchdoc import machine_description, replace_section

    raw = run(args.policy)
    command = bench_command("failover-vllm", sys.argv[1:] if argv is None else argv)
    result = {"benchmark": SECTION, "command": command, "machine": machine_description(),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": sys.version.split()[0],
              "settings": {"model": MODEL, "policy": args.policy, "max_tokens": MAX_TOKENS,
                           "kill_after_chunks": KILL_AFTER_CHUNKS, "completion_prompt": COMPLETION_PROMPT,
                           "chat_messages": CHAT_MESSAGES},
              **raw}
    result["figures"] = summarise(result["kinds"])
    save_result(RESULTS_PATH, result)
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(result["figures"], indent=2))
    return 0 if result["figures"]["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
