"""Proxy overhead side by side, in one run: kvgate's gateway, SGLang's Rust router (LiteLLM too when
installed), the floor of a Python proxy on kvgate's HTTP stack (loadtest/proxy_floor.py: what kvgate's
own per-request work adds is kvgate less the floor) and no proxy at all in front of a fixed-response
nginx, loaded by wrk; requests/s on one core and the latency each adds to direct.

The upstream is nginx (`worker_processes 1`, no daemon, a temp config) answering POST
/v1/chat/completions and /v1/completions with a fixed OpenAI-style answer: JSON when the request body
says `"stream": false`, SSE (4 content chunks, a usage chunk, `data: [DONE]`, one write with a
content-length) when it says `"stream": true`. nginx cannot branch on a body by itself: the echo module
reads the body, a `map` on `$request_body` picks the answer and `echo_exec` jumps to it, so each proxy
gets what it asks for (kvgate always asks its worker for a stream, also for a non-streaming client).
The proxy under test runs on CPU 0 (`taskset`), nginx and wrk on the other CPU. Each cell (mode x
connections) runs every proxy in turn, the order mirrored in the second round; figures are medians.
Writes results/bench_proxy.json and the "proxy-peers" section of docs/benchmarks.md.
Run: .venv/bin/python -m loadtest.bench_proxy [--quick] [--no-doc] [--no-litellm] [--doc-only]
Needs: apt-get install -y nginx-light libnginx-mod-http-echo wrk; sglang-router in results/sglang-venv.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.balancer import nginx_head
from loadtest.bench_gateway import API_KEY, MODEL, cpu_placement, gateway_config
from loadtest.benchdoc import machine_description, replace_section
from loadtest.procs import ChildProcess, free_port, process_cpu_s, tree_cpu_s
from loadtest.proxy_floor import UPSTREAM_ENV
from loadtest.sse import StreamReader

SECTION = "proxy-peers"
ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "results" / "bench_proxy.json"
SGLANG_VENV = ROOT / "results" / "sglang-venv"
LITELLM_VENV = ROOT / "results" / "litellm-venv"  # optional: measured when installed
APT_INSTALL = "apt-get update && apt-get install -y nginx-light libnginx-mod-http-echo wrk"
SGLANG_INSTALL = "python3 -m venv results/sglang-venv && results/sglang-venv/bin/pip install sglang-router"
LITELLM_INSTALL = "python3 -m venv results/litellm-venv && results/litellm-venv/bin/pip install 'litellm[proxy]'"
ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")
PATH = "/v1/chat/completions"
PROMPT = "Say hello to the benchmark in a few words."
NUM_CHUNKS = 4
DIRECT, KVGATE, FLOOR, SGLANG, LITELLM = "direct", "kvgate", "python floor", "sglang-router", "litellm"
MODES = ("non-streaming", "streaming")
CONNECTIONS = (1, 32)
NUM_ROUNDS = 2
SHARED_CORES = 0.1  # a run during which other work took more CPU than this shared the machine
# issue #17, non-streaming: kvgate's req/s per core >= 0.5x sglang-router's (32 connections), its added
# p50 <= 2x sglang-router's (1 connection); streaming: keep the lead (>= 1x req/s, <= 1x added p50)
TARGETS = {"non-streaming": {"rps_ratio_min": 0.5, "added_p50_ratio_max": 2.0},
           "streaming": {"rps_ratio_min": 1.0, "added_p50_ratio_max": 1.0}}


# -- the upstream: nginx ------------------------------------------------------------------------

def _sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n"


def _usage() -> dict[str, Any]:
    return {"prompt_tokens": 12, "completion_tokens": NUM_CHUNKS, "total_tokens": 12 + NUM_CHUNKS,
            "prompt_tokens_details": {"cached_tokens": 0}}


def answer_body(kind: str, stream: bool) -> str:
    """The fixed answer: NUM_CHUNKS x "tok " as JSON, or as SSE chunks then usage and [DONE]."""
    chat = kind == "chat"
    head = {"id": "chatcmpl-bench" if chat else "cmpl-bench",
            "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion",
            "created": 0, "model": MODEL}
    if not stream:
        choice = ({"index": 0, "message": {"role": "assistant", "content": "tok " * NUM_CHUNKS}} if chat
                  else {"index": 0, "text": "tok " * NUM_CHUNKS})
        return json.dumps({**head, "choices": [{**choice, "logprobs": None, "finish_reason": "length"}],
                           "usage": _usage()}, separators=(",", ":"))
    chunks = []
    for i in range(NUM_CHUNKS):
        finish = "length" if i == NUM_CHUNKS - 1 else None
        choice = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
        chunks.append(_sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}))
    return "".join(chunks) + _sse({**head, "choices": [], "usage": _usage()}) + "data: [DONE]\n\n"


def _nginx_string(text: str) -> str:
    """text as a single-quoted nginx string (nginx unescapes \\n; the answers hold no ' \\ or $)."""
    if any(c in text for c in "'\\$"):
        raise ValueError("an nginx answer must not contain ', \\ or $")
    return "'" + text.replace("\n", "\\n") + "'"


def nginx_conf(port: int, tmp_dir: Path) -> str:
    """One worker process, no daemon, no logs; the answers above, chosen by the body's "stream";
    /health, /v1/models and an empty /metrics for the proxies' own checks, /v1/traces taking OTLP span
    batches as a collector would (loadtest/bench_telemetry.py), 404 elsewhere."""
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                     "owned_by": "bench"}]}, separators=(",", ":"))
    answers = "\n".join(
        f"        location = /_{name}{path} {{ internal; default_type {media_type}; "
        f"return 200 {_nginx_string(answer_body(kind, name == 'sse'))}; }}"
        for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion"))
        for name, media_type in (("json", "application/json"), ("sse", "text/event-stream")))
    return f"load_module {ECHO_MODULE};\n" + nginx_head(tmp_dir, 8192) + f"""    keepalive_requests 100000000;
    keepalive_timeout 300s;
    client_body_buffer_size 64k;
    map $request_body $answer {{ '~"stream"\\s*:\\s*true' sse; default json; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        default_type application/json;
        location = /health {{ return 200 '{{"status":"ok"}}'; }}
        location = /v1/models {{ return 200 {_nginx_string(models)}; }}
        location = /metrics {{ default_type text/plain; return 200 ''; }}
        location = /v1/traces {{ default_type application/x-protobuf; return 200 ''; }}
        location / {{ return 404 '{{"error":{{"message":"not found","type":"not_found_error"}}}}'; }}
        location ~ ^/v1/(chat/)?completions$ {{ echo_read_request_body; echo_exec /_$answer$uri; }}
{answers}
    }}
}}
"""


# -- the load: wrk --------------------------------------------------------------------------------

def request_body(stream: bool) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": NUM_CHUNKS, "stream": stream}, separators=(",", ":"))


def wrk_script(stream: bool) -> str:
    """wrk's Lua: the POST, and a done() that prints one `BENCH {json}` line (latencies in us)."""
    return f"""wrk.method = "POST"
wrk.path = "{PATH}"
wrk.body = {json.dumps(request_body(stream))}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {API_KEY}"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('BENCH {{"requests": %d, "duration_us": %d, "bytes": %d, "errors_connect": %d, '
    .. '"errors_read": %d, "errors_write": %d, "errors_status": %d, "errors_timeout": %d, '
    .. '"p50_us": %.1f, "p90_us": %.1f, "p99_us": %.1f, "max_us": %.1f, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


def parse_wrk(stdout: str) -> dict[str, Any]:
    """The figures of one wrk run, from its `BENCH` line: requests/s counts only 2xx answers."""
    lines = [line for line in stdout.splitlines() if line.startswith("BENCH ")]
    if not lines:
        raise ValueError(f"no BENCH line in wrk's output:\n{stdout[-2000:]}")
    raw = json.loads(lines[-1][len("BENCH "):])
    errors = sum(v for k, v in raw.items() if k.startswith("errors_"))
    ok = raw["requests"] - raw["errors_status"]
    return {"requests": raw["requests"], "errors": errors, "requests_per_s": ok / (raw["duration_us"] / 1e6),
            "p50_ms": raw["p50_us"] / 1e3, "p90_ms": raw["p90_us"] / 1e3, "p99_ms": raw["p99_us"] / 1e3,
            "max_ms": raw["max_us"] / 1e3, "mean_ms": raw["mean_us"] / 1e3}


def _pin(cpus: set[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, sorted(cpus)))] if cpus else []


def wrk_argv(port: int, script: Path, connections: int, duration_s: int, cpus: set[int] | None) -> list[str]:
    """One wrk thread with `connections` keep-alive connections, on cpus (taskset) when given."""
    return [*_pin(cpus), "wrk", "-t", "1", "-c", str(connections), "-d", f"{duration_s}s", "--timeout", "10s",
            "-s", str(script), f"http://127.0.0.1:{port}{PATH}"]


def run_wrk(argv: list[str]) -> dict[str, Any]:
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{(out.stdout + out.stderr)[-2000:]}")
    return parse_wrk(out.stdout)


# -- the processes --------------------------------------------------------------------------------

def missing_tools(peers: bool = True) -> list[str]:
    """What this benchmark needs and does not find, each with the command that installs it (peers:
    sglang-router too)."""
    missing = [f"{tool} (install: {APT_INSTALL})" for tool in ("nginx", "wrk") if shutil.which(tool) is None]
    if not ECHO_MODULE.exists():
        missing.append(f"{ECHO_MODULE} (install: {APT_INSTALL})")
    if peers and not (SGLANG_VENV / "bin" / "python").exists():
        missing.append(f"sglang-router (install: {SGLANG_INSTALL})")
    return missing


def start_nginx(port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    conf = tmp_dir / "nginx.conf"
    conf.write_text(nginx_conf(port, tmp_dir))
    return ChildProcess("nginx", [*_pin(cpus), "nginx", "-c", str(conf), "-p", str(tmp_dir)], tmp_dir / "nginx.log",
                        f"http://127.0.0.1:{port}/health")


def start_kvgate(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    """kvgate's gateway as bench_gateway runs it: one uvicorn process, kv_aware, `tokenizer: null`; no
    request log lines, as the peers here write none (sglang-router at `--log-level warn`, LiteLLM without
    an access log). bench_telemetry measures what the log costs."""
    config = tmp_dir / "gateway.yaml"
    config.write_text(yaml.safe_dump({**gateway_config(port, upstream_port), "logging": {"requests": False}}))
    argv = [*_pin(cpus), sys.executable, "-m", "kvgate", "gateway", "--config", str(config)]
    return ChildProcess(KVGATE, argv, tmp_dir / "kvgate.log", f"http://127.0.0.1:{port}/ready",
                        env={"KVGATE_API_KEY": API_KEY})


def floor_argv(port: int) -> list[str]:
    """The floor of a proxy on kvgate's HTTP stack (loadtest/proxy_floor.py): uvicorn as kvgate runs it,
    kvgate's upstream client, and nothing else; its upstream is in the environment (floor_env)."""
    return [sys.executable, "-m", "uvicorn", "--factory", "loadtest.proxy_floor:create_app", "--host", "127.0.0.1",
            "--port", str(port), "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]


def floor_env(upstream_port: int, tree: Path = ROOT) -> dict[str, str]:
    return {UPSTREAM_ENV: f"http://127.0.0.1:{upstream_port}", "PYTHONPATH": str(tree)}


def start_floor(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    return ChildProcess(FLOOR, [*_pin(cpus), *floor_argv(port)], tmp_dir / "floor.log",
                        f"http://127.0.0.1:{port}/health", env=floor_env(upstream_port))


def sglang_argv(port: int, upstream_port: int, prometheus_port: int) -> list[str]:
    """SGLang's router as PEERS.md runs it, round robin, no health checks (a fake upstream), and no
    per-request log lines (kvgate writes none either)."""
    return [str(SGLANG_VENV / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--worker-urls", f"http://127.0.0.1:{upstream_port}", "--policy", "round_robin",
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prometheus_port),
            "--disable-health-check", "--log-level", "warn"]


def start_sglang(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    argv = [*_pin(cpus), *sglang_argv(port, upstream_port, free_port())]
    return ChildProcess(SGLANG, argv, tmp_dir / "sglang.log", f"http://127.0.0.1:{port}/v1/models")


def start_litellm(port: int, upstream_port: int, tmp_dir: Path, cpus: set[int] | None) -> ChildProcess:
    """LiteLLM's proxy as PEERS.md runs it (one uvicorn worker, `openai/<model>` at the upstream), with
    no master key (loopback only) and no access log."""
    config, log_config = tmp_dir / "litellm.yaml", tmp_dir / "litellm-logging.json"
    config.write_text(yaml.safe_dump({"model_list": [{"model_name": MODEL, "litellm_params": {
        "model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{upstream_port}/v1", "api_key": "none"}}]}))
    log_config.write_text(json.dumps({"version": 1, "disable_existing_loggers": False,
                                      "loggers": {"uvicorn.access": {"level": "WARNING"}}}))
    argv = [*_pin(cpus), str(LITELLM_VENV / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", "1", "--log_config", str(log_config)]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    return ChildProcess(LITELLM, argv, tmp_dir / "litellm.log", f"http://127.0.0.1:{port}/health/liveliness", env=env)


STARTERS = {KVGATE: start_kvgate, FLOOR: start_floor, SGLANG: start_sglang, LITELLM: start_litellm}


def check_answers(name: str, port: int) -> None:
    """One request per mode through this proxy; the whole fixed answer must come back."""
    for stream in (False, True):
        response = httpx.post(f"http://127.0.0.1:{port}{PATH}", content=request_body(stream), timeout=10.0,
                              headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
        if response.status_code != 200 or answer_text(response.text, stream) != "tok " * NUM_CHUNKS:
            raise RuntimeError(f"{name} answered {response.status_code} (stream={stream}): {response.text[:500]}")


def answer_text(body: str, stream: bool) -> str | None:
    """The content of a chat answer (JSON, or SSE that ends with [DONE]); None if it is not whole."""
    if not stream:
        return json.loads(body)["choices"][0]["message"]["content"]
    reader = StreamReader()
    for line in body.splitlines():
        reader.feed_line(line)
    return reader.text if reader.done and reader.error is None else None


def versions() -> dict[str, str | None]:
    def first_line(argv: list[str]) -> str:
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        return (out.stdout + out.stderr).strip().splitlines()[0]

    def package(venv: Path, name: str) -> str | None:
        if not venv.exists():
            return None
        script = f"import importlib.metadata as m; print(m.version('{name}'))"
        return first_line([str(venv / "bin" / "python"), "-c", script])

    return {"nginx": first_line(["nginx", "-v"]).removeprefix("nginx version: "),
            "wrk": first_line(["wrk", "-v"]).split(" [")[0],
            "sglang-router": package(SGLANG_VENV, "sglang-router"), "litellm": package(LITELLM_VENV, "litellm"),
            "python": sys.version.split()[0]}


# -- the run ------------------------------------------------------------------------------------

def machine_busy_s() -> float:
    """CPU seconds all CPUs have spent busy since boot (user, nice, system, irq, softirq; not steal)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children: each wrk run once it ends
    return usage.ru_utime + usage.ru_stime


def measured_run(argv: list[str], pid: int | None, own_pids: list[int]) -> dict[str, Any]:
    """One wrk run, with the proxy's CPU seconds (pid None: none) and what other work on the machine
    took meanwhile (foreign_cores: busy CPU time not spent by the proxies, nginx or wrk, per second)."""
    started, busy, own, wrk = time.perf_counter(), machine_busy_s(), tree_cpu_s(own_pids), _children_cpu_s()
    proxy = process_cpu_s(pid) if pid else 0.0
    figures = run_wrk(argv)
    figures["proxy_cpu_s"] = process_cpu_s(pid) - proxy if pid else None
    ours = tree_cpu_s(own_pids) - own + _children_cpu_s() - wrk
    figures["foreign_cores"] = max(0.0, machine_busy_s() - busy - ours) / (time.perf_counter() - started)
    return figures


def measure(targets: dict[str, tuple[int, int | None]], scripts: dict[str, Path], duration_s: int,
            warmup_s: int, load_cpus: set[int] | None, own_pids: list[int],
            rounds: int = NUM_ROUNDS) -> list[dict[str, Any]]:
    """Every cell (mode x connections) through every proxy (port, pid; no pid: direct), the proxies'
    order mirrored every second round; each measured run follows a warm-up run of the same load.
    own_pids: every process this run started (proxies, nginx), to tell other work's CPU use apart."""
    runs = []
    for index in range(rounds):
        order = list(targets) if index % 2 == 0 else list(targets)[::-1]
        for mode in MODES:
            for connections in CONNECTIONS:
                for proxy in order:
                    port, pid = targets[proxy]
                    run_wrk(wrk_argv(port, scripts[mode], connections, warmup_s, load_cpus))
                    figures = measured_run(wrk_argv(port, scripts[mode], connections, duration_s, load_cpus), pid,
                                           own_pids)
                    run = {"round": index + 1, "proxy": proxy, "mode": mode, "connections": connections,
                           "duration_s": duration_s, **figures}
                    runs.append(run)
                    print(f"round {index + 1} {mode} c={connections} {proxy}: {figures['requests_per_s']:.0f} req/s, "
                          f"p50 {figures['p50_ms']:.3f} ms, p99 {figures['p99_ms']:.3f} ms, "
                          f"other work {figures['foreign_cores']:.2f} cores", file=sys.stderr)
    return runs


# -- figures ------------------------------------------------------------------------------------

def _cell(runs: list[dict[str, Any]], mode: str, connections: int, proxy: str) -> list[dict[str, Any]]:
    return sorted((r for r in runs if (r["mode"], r["connections"], r["proxy"]) == (mode, connections, proxy)),
                  key=lambda r: r["round"])


def proxy_figures(mine: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, Any]:
    """One proxy in one cell: medians over rounds; "added" = this proxy minus direct in the same round."""
    direct_by_round = {r["round"]: r for r in direct}

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    def added(key: str) -> float | None:
        return median([r[key] - direct_by_round[r["round"]][key] for r in mine if r["round"] in direct_by_round])

    cpu = [r["proxy_cpu_s"] for r in mine]
    return {"requests_per_s": median([r["requests_per_s"] for r in mine]),
            "requests_per_s_rounds": [r["requests_per_s"] for r in mine],
            "p50_ms": median([r["p50_ms"] for r in mine]), "p99_ms": median([r["p99_ms"] for r in mine]),
            "added_p50_ms": added("p50_ms"), "added_p99_ms": added("p99_ms"),
            "cpu_busy": median([c / r["duration_s"] if c is not None else None for c, r in zip(cpu, mine)]),
            "cpu_ms_per_request": median([c * 1e3 / r["requests"] if c is not None and r["requests"] else None
                                          for c, r in zip(cpu, mine)]),
            "errors": sum(r["errors"] for r in mine)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """{mode: {connections: {proxy: figures}}} for every cell and proxy the runs hold."""
    figures: dict[str, Any] = {}
    proxies = dict.fromkeys([DIRECT, *(r["proxy"] for r in runs)])
    for mode in MODES:
        for connections in CONNECTIONS:
            direct = _cell(runs, mode, connections, DIRECT)
            cell = {proxy: proxy_figures(mine, direct) for proxy in proxies
                    if (mine := _cell(runs, mode, connections, proxy))}
            if cell:
                figures.setdefault(mode, {})[str(connections)] = cell
    return figures


def interference(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Other work's CPU use during the measured runs, in cores: the median run's and the worst run's."""
    foreign = [r["foreign_cores"] for r in runs]
    return {"median_cores": statistics.median(foreign), "max_cores": max(foreign)}


def verdict(figures: dict[str, Any]) -> dict[str, Any]:
    """Per mode: kvgate's req/s at 32 connections over sglang-router's, its added p50 at 1 connection
    over sglang-router's, and no failed requests through either; each against TARGETS."""
    out = {}
    for mode, target in TARGETS.items():
        many, one = figures[mode][str(CONNECTIONS[-1])], figures[mode][str(CONNECTIONS[0])]
        rps_ratio = many[KVGATE]["requests_per_s"] / many[SGLANG]["requests_per_s"]
        kv_added, sg_added = one[KVGATE]["added_p50_ms"], one[SGLANG]["added_p50_ms"]
        cpu_kv, cpu_sg = many[KVGATE]["cpu_ms_per_request"], many[SGLANG]["cpu_ms_per_request"]
        errors = sum(cell[p]["errors"] for cell in figures[mode].values() for p in (KVGATE, SGLANG))
        out[mode] = {"rps_ratio": rps_ratio, "rps_pass": rps_ratio >= target["rps_ratio_min"],
                     "added_p50_ratio": kv_added / sg_added if sg_added > 0 else None,
                     "added_p50_pass": kv_added <= target["added_p50_ratio_max"] * sg_added,
                     "cpu_per_request_ratio": cpu_kv / cpu_sg if cpu_kv and cpu_sg else None,
                     "errors": errors, "errors_pass": errors == 0}
    return out


# -- the report ---------------------------------------------------------------------------------

def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(figures: dict[str, Any]) -> str:
    rows = []
    for mode, cells in figures.items():
        for connections, cell in cells.items():
            for proxy, f in cell.items():
                rounds = " / ".join(f"{x:,.0f}" for x in f["requests_per_s_rounds"])
                busy_pct = None if f["cpu_busy"] is None else f["cpu_busy"] * 100
                rows.append(f"| {mode} | {connections} | {proxy} | {f['requests_per_s']:,.0f} ({rounds}) "
                            f"| {_num(f['p50_ms'], 3)} | {_num(f['p99_ms'], 3)} | {_num(f['added_p50_ms'], 3)} "
                            f"| {_num(f['added_p99_ms'], 3)} | {_num(busy_pct, 0)} "
                            f"| {_num(f['cpu_ms_per_request'], 3)} | {f['errors']} |")
    return "\n".join(rows)


def _verdict_rows(v: dict[str, Any]) -> str:
    mark = {True: "pass", False: "FAIL"}
    rows = []
    for mode, target in TARGETS.items():
        m = v[mode]
        rows += [f"| {mode}: kvgate req/s at {CONNECTIONS[-1]} connections / sglang-router's | {m['rps_ratio']:.2f}x "
                 f"(kvgate's CPU per request: {_num(m['cpu_per_request_ratio'], 1)}x sglang-router's) "
                 f"| >= {target['rps_ratio_min']:g}x | {mark[m['rps_pass']]} |",
                 f"| {mode}: kvgate added p50 at {CONNECTIONS[0]} connection / sglang-router's "
                 f"| {_num(m['added_p50_ratio'])}x | <= {target['added_p50_ratio_max']:g}x "
                 f"| {mark[m['added_p50_pass']]} |",
                 f"| {mode}: failed requests through kvgate and sglang-router | {m['errors']} | 0 "
                 f"| {mark[m['errors_pass']]} |"]
    return "\n".join(rows)


def _cpus(cpus: list[int]) -> str:
    return ", ".join(map(str, cpus)) or "(any: one CPU only)"


def markdown(result: dict[str, Any]) -> str:
    s, v, i = result["settings"], result["versions"], result["interference"]
    measured = {proxy for cells in result["figures"].values() for cell in cells.values() for proxy in cell}
    litellm = (f" LiteLLM {v['litellm']} (`litellm --num_workers 1`, no master key, no access log),"
               if LITELLM in measured else "")
    floor = (" the floor of a proxy built the same way (\"python floor\", `loadtest/proxy_floor.py`: uvicorn as kvgate "
             "runs it and kvgate's upstream client passing each request on and its answer back, and nothing else: no "
             "auth, parsing, admission, routing or metrics)," if FLOOR in measured else "")
    return f"""## Proxy overhead beside SGLang's router

Command: `{result['command']}`
Machine: {result['machine']} (shared with other work; figures from one run; load average
{result['load_average']['start'][0]:.1f} at the start, {result['load_average']['end'][0]:.1f} at the end)
Date: {result['date']}

A fixed-response upstream ({v['nginx']}, one worker process, echo module) answers chat completions at once:
JSON for `"stream": false`, SSE ({NUM_CHUNKS} content chunks, a usage chunk, `data: [DONE]`, in one write) for
`"stream": true` (nginx reads the body and picks the answer with a `map` on it). In front of it, each on CPU
{_cpus(s['cpus']['proxy'])} alone: kvgate's gateway (`python -m kvgate gateway`, one uvicorn process, kv_aware routing
with `tokenizer: null`, no request log lines (`logging.requests: false`: the peers write none); it always asks
its worker for a stream, also for a non-streaming client),{floor} SGLang's router {v['sglang-router']}
(`--policy round_robin --disable-health-check --log-level warn`),{litellm} and no proxy ("direct"). nginx and {v['wrk']} (one thread, keep-alive connections, a fixed chat request) share CPU(s)
{_cpus(s['cpus']['upstream_and_load'])}. Every cell runs each proxy in turn for {s['duration_s']:g} s after a
{s['warmup_s']:g} s warm-up; {s['rounds']} rounds, the order mirrored in the second; figures are medians over
rounds (req/s of each round in brackets). Added = the proxy's latency minus direct's in the same round and cell.
Proxy CPU = the proxy process's CPU time over the run (100 = one core busy); ms/req = its CPU per request.
Other work on the machine during the measured runs (busy CPU time not spent by the proxies, nginx or wrk):
{i['median_cores']:.2f} cores in the median run, {i['max_cores']:.2f} in the worst{_shared_note(result['raw'])}.

| mode | connections | proxy | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | proxy CPU % | CPU ms/req | failed |
|---|---|---|---|---|---|---|---|---|---|---|
{_table(result['figures'])}

| target (issue #17) | value | target | result |
|---|---|---|---|
{_verdict_rows(result['verdict'])}

{_floor_note(result['figures'])}{_stall_note(result['figures'])}Raw figures: `results/bench_proxy.json`.
"""


def _shared_note(runs: list[dict[str, Any]]) -> str:
    shared = [f"{r['proxy']} {r['mode']} c={r['connections']} round {r['round']}" for r in runs
              if r["foreign_cores"] > SHARED_CORES]
    return f" (above {SHARED_CORES:g}: {', '.join(shared)})" if shared else f" (none above {SHARED_CORES:g})"


def _floor_note(figures: dict[str, Any]) -> str:
    """Lines splitting kvgate's CPU per request at 32 connections into the floor's (the HTTP stack) and
    the rest (its own per-request work), when the floor was measured."""
    lines = []
    for mode in MODES:
        cell = figures[mode][str(CONNECTIONS[-1])]
        if FLOOR not in cell:
            return ""
        kvgate, floor = cell[KVGATE]["cpu_ms_per_request"], cell[FLOOR]["cpu_ms_per_request"]
        if not kvgate or not floor:
            return ""
        lines.append(f"{mode}: kvgate {kvgate:.3f} ms of CPU a request, the floor {floor:.3f} ms "
                     f"({cell[FLOOR]['requests_per_s'] / cell[SGLANG]['requests_per_s']:.2f}x sglang-router's req/s): "
                     f"{kvgate - floor:.3f} ms ({(kvgate - floor) / kvgate:.0%}) is kvgate's own work")
    return ("At " + str(CONNECTIONS[-1]) + " connections, what the HTTP stack costs and what kvgate does on it:\n"
            + "".join(f"- {line}.\n" for line in lines) + "\n")


def _stall_note(figures: dict[str, Any]) -> str:
    """A line on sglang-router's streams when they wait rather than work (its CPU mostly idle at 32)."""
    one, many = figures["streaming"][str(CONNECTIONS[0])][SGLANG], figures["streaming"][str(CONNECTIONS[-1])][SGLANG]
    if many["cpu_busy"] is None or many["cpu_busy"] > 0.5:
        return ""
    return (f"Streaming through sglang-router waits rather than works: {one['p50_ms']:.0f} ms per answer at "
            f"{CONNECTIONS[0]} connection (p50) and {many['requests_per_s']:,.0f} req/s at {CONNECTIONS[-1]}, its CPU "
            f"{many['cpu_busy']:.0%} busy (a stall per stream on this harness).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s runs (a smoke run; figures are noisier)")
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--doc-only", action="store_true",
                        help="measure nothing: rewrite the docs section from results/bench_proxy.json (after a "
                             "change to the section's wording; the figures and command stay the run's)")
    parser.add_argument("--no-litellm", action="store_true",
                        help=f"leave LiteLLM out (measured when results/litellm-venv exists; install: {LITELLM_INSTALL})")
    args = parser.parse_args()
    if args.doc_only:
        return rewrite_doc(json.loads(RESULTS_PATH.read_text()))
    if missing := missing_tools():
        sys.exit("missing:\n  " + "\n  ".join(missing))
    duration_s, warmup_s = phase_seconds(args.quick)
    proxy_cpus, load_cpus = cpu_placement()
    started, load_start = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp, ExitStack() as stack:
        tmp_dir = Path(tmp)
        scripts = {mode: tmp_dir / f"{mode}.lua" for mode in MODES}
        for mode, path in scripts.items():
            path.write_text(wrk_script(mode == "streaming"))
        nginx_port = free_port()
        nginx = _healthy(stack, start_nginx(nginx_port, tmp_dir, load_cpus))
        names = [KVGATE, FLOOR, SGLANG] + ([LITELLM] if LITELLM_VENV.exists() and not args.no_litellm else [])
        targets = start_proxies(stack, names, nginx_port, tmp_dir, proxy_cpus)
        for name, (port, _) in targets.items():
            check_answers(name, port)
        own_pids = [nginx.popen.pid, *(pid for _, pid in targets.values() if pid)]
        runs = measure(targets, scripts, duration_s, warmup_s, load_cpus, own_pids)
    load_average = {"start": list(load_start), "end": list(os.getloadavg())}
    write_result(runs, args, (proxy_cpus, load_cpus), time.time() - started, load_average)


def start_proxies(stack: ExitStack, names: list[str], upstream_port: int, tmp_dir: Path,
                  cpus: set[int] | None) -> dict[str, tuple[int, int | None]]:
    """Each proxy in front of the upstream, healthy: {name: (port, pid)}, direct first (no pid)."""
    targets: dict[str, tuple[int, int | None]] = {DIRECT: (upstream_port, None)}
    for name in names:
        port = free_port()
        proc = _healthy(stack, STARTERS[name](port, upstream_port, tmp_dir, cpus))
        targets[name] = (port, proc.popen.pid)
    return targets


def phase_seconds(quick: bool) -> tuple[int, int]:
    """(measured, warm-up) seconds of each wrk run (wrk takes whole seconds)."""
    return (3, 1) if quick else (10, 1)


def _healthy(stack: ExitStack, proc: ChildProcess) -> ChildProcess:
    """proc, stopped when the stack closes, once it answers its health URL."""
    stack.callback(proc.stop)
    proc.wait_healthy(120.0)  # LiteLLM takes ~10 s
    return proc


def rewrite_doc(result: dict[str, Any]) -> None:
    """The docs section again from a saved run: its figures and verdict recomputed from its raw runs."""
    result["figures"] = figures = summarise(result["raw"])
    result |= {"verdict": verdict(figures), "interference": interference(result["raw"])}
    replace_section(SECTION, markdown(result))


def write_result(runs: list[dict[str, Any]], args: argparse.Namespace,
                 cpus: tuple[set[int] | None, set[int] | None], wall_s: float,
                 load_average: dict[str, list[float]]) -> None:
    figures = summarise(runs)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "benchmark": SECTION, "command": ".venv/bin/python -m loadtest.bench_proxy" + (" --quick" if args.quick else ""),
        "machine": machine_description(), "date": now.isoformat(timespec="seconds"),
        "versions": versions(), "wall_s": round(wall_s, 1), "load_average": load_average,
        "settings": {"rounds": NUM_ROUNDS, "duration_s": runs[0]["duration_s"],
                     "warmup_s": phase_seconds(args.quick)[1],
                     "connections": list(CONNECTIONS), "chunks": NUM_CHUNKS, "request": json.loads(request_body(True)),
                     "cpus": {"proxy": sorted(cpus[0] or []), "upstream_and_load": sorted(cpus[1] or [])}},
        "targets": TARGETS, "figures": figures, "verdict": verdict(figures), "interference": interference(runs),
        "raw": runs,
    }
    RESULTS_PATH.parent.mkdir(exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_doc:
        replace_section(SECTION, markdown(result))
    print(json.dumps(result["verdict"], indent=2))


if __name__ == "__main__":
    main()
