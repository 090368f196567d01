"""`kvgate worker`: builds model, executor, engine, KV-event publisher and HTTP app, then serves.

The worker is meant to be reachable only from the gateway (HTTP on 127.0.0.1 by default, KV
events on loopback unless an endpoint says otherwise): it trusts the x-priority header and does no
authentication. It exits 1 when its engine stops for an error (see worker.async_engine), so that
the supervisor (`kvgate up`) restarts it.

Observability: one JSON line per completion request on stderr (kvgate/request_log.py; off with
--no-request-log, prompt token ids added with --log-prompt-token-ids), and traces when --tracing-exporter
(or OTEL_TRACES_EXPORTER) says where to; tracing is set up once at start and flushed at exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import uvicorn
from opentelemetry import trace
from uvicorn.config import STARTUP_FAILURE

from kvgate.request_log import RequestLog
from kvgate.tracing import Tracing, TracingSettings, resolve_settings
from worker.async_engine import AsyncEngine
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.executor.base import Executor
from worker.metrics import WorkerMetrics
from worker.model.default_model import DEFAULT_MODEL_SPEC, DEFAULT_SERVED_MODEL_NAME, resolve_model_path
from worker.model.tokenizer import ModelTokenizer, load_tokenizer
from worker.request_telemetry import RequestTelemetry
from worker.server import WorkerState, build_app

log = logging.getLogger("kvgate.worker")

# A sim worker stands in for a GPU worker (docs/sim-calibration.md): ~80 GB of KV for an 8B model
# is far more than this, but routing experiments want caches that fill and evict.
SIM_DEFAULT_NUM_BLOCKS = 8192
SIM_DEFAULT_MAX_MODEL_LEN = 32768
# How long an idle keep-alive connection stays open. Longer than the gateway keeps idle connections
# to workers (gateway/upstream_http.py KEEPALIVE_EXPIRY_S, at most 4 s), so that the gateway, not
# the worker, closes them: a request sent on a connection the worker is closing at that moment fails.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 15.0
# on SIGTERM: what is still running then is cut, and a gateway continues it on another worker (within a
# Kubernetes pod's default 30 s termination grace)
DEFAULT_SHUTDOWN_GRACE_S = 25.0
TRACING_SERVICE_NAME = "kvgate-worker"


class _Terminated(Exception):
    """SIGTERM: a clean stop. uvicorn, which catches it while serving, raises it again once it has shut down."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; 0 after a stop (Ctrl-C, SIGTERM), 1 after an engine crash, 2 for a bad setting.
    Stopping closes the KV-event publisher and exports the spans still buffered."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.worker_id or 'worker'} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        tracing = Tracing(_tracing_settings(args))
        publisher = _build_publisher(args)  # first: a busy port fails at once, not after loading the model
    except (ValueError, OSError) as exc:  # TracingSettingError is a ValueError
        print(f"kvgate worker: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, publisher, tracing)
    except _Terminated:
        return 0  # stopped before it served
    finally:
        if publisher is not None:
            publisher.close()
        tracing.shutdown()


def _tracing_settings(args: argparse.Namespace) -> TracingSettings:
    """--tracing-* flags; each one not given (or absent from a Namespace built without them) falls back to
    the OTEL_* variables (kvgate.tracing)."""
    return resolve_settings(TRACING_SERVICE_NAME, getattr(args, "tracing_exporter", None),
                            getattr(args, "tracing_endpoint", None), getattr(args, "tracing_sample_ratio", None))


def _serve(args: argparse.Namespace, publisher, tracing: Tracing) -> int:
    """Load the model, start the engine loop and serve HTTP until uvicorn stops; 1 if the engine crashed."""
    try:
        model_dir = resolve_model_path(args.model)
        tokenizer = load_tokenizer(model_dir)
        executor = _build_executor(args, model_dir, tokenizer)
    except (ValueError, OSError) as exc:
        print(f"kvgate worker: {exc}", file=sys.stderr)
        return 2
    served_name = args.served_model_name or _default_served_name(args.model, model_dir)
    budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    config = EngineConfig(model_name=served_name, block_size=args.block_size, num_blocks=executor.num_blocks,
                          max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **budget)
    request_log = RequestLog("worker", enabled=not getattr(args, "no_request_log", False))
    state = build_state(executor, tokenizer, model_dir, config, publisher, request_log=request_log,
                        tracer=tracing.tracer("kvgate.worker"),
                        log_prompt_token_ids=getattr(args, "log_prompt_token_ids", False))
    log.info("serving %s (%s executor, %d KV blocks of %d tokens) on http://%s:%d", served_name, executor.name,
             executor.num_blocks, args.block_size, args.host, args.port)
    try:
        status = serve(uvicorn.Server(uvicorn_config(build_app(state), args)), state.engine)
    finally:
        state.engine.shutdown()
    if status == 1:
        print("kvgate worker: the engine stopped after an error; exiting so that it is restarted", file=sys.stderr)
    return status


def build_state(executor: Executor, tokenizer: ModelTokenizer, model_dir: Path, config: EngineConfig,
                publisher=None, *, request_log: RequestLog | None = None, tracer: trace.Tracer | None = None,
                log_prompt_token_ids: bool = False) -> WorkerState:
    """Engine, its loop (started), metrics and request telemetry over an executor, as the HTTP handlers
    need them. request_log None writes no request lines; tracer None makes no spans."""
    step_events: list = []
    engine = Engine(executor, tokenizer.tokenizer, config, event_sink=step_events.append,
                    eos_token_ids=tokenizer.eos_token_ids)
    metrics = WorkerMetrics(config.model_name, executor.name, block_size=config.block_size,
                            num_blocks=engine.num_blocks, max_model_len=engine.max_model_len)
    async_engine = AsyncEngine(engine, step_events, publisher=publisher, observer=metrics)
    telemetry = RequestTelemetry(config.model_name, request_log or RequestLog("worker", False),
                                 tracer, log_prompt_token_ids=log_prompt_token_ids, clock=async_engine.clock)
    async_engine.start()
    return WorkerState(engine=async_engine, tokenizer=tokenizer, served_model_name=config.model_name,
                       model_root=str(model_dir), executor_name=executor.name, block_size=config.block_size,
                       max_model_len=engine.max_model_len, metrics=metrics, num_token_ids=executor.vocab_size,
                       telemetry=telemetry)


def uvicorn_config(app, args: argparse.Namespace) -> uvicorn.Config:
    """The HTTP server's settings: listen address, the idle keep-alive timeout (--timeout-keep-alive) and
    how long requests in flight may finish once it is told to stop (--shutdown-grace)."""
    timeout_keep_alive_s = getattr(args, "timeout_keep_alive_s", None)  # None where the parser lacks it
    if timeout_keep_alive_s is None:
        timeout_keep_alive_s = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    shutdown_grace_s = getattr(args, "shutdown_grace_s", None)
    if shutdown_grace_s is None:
        shutdown_grace_s = DEFAULT_SHUTDOWN_GRACE_S
    return uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                          timeout_graceful_shutdown=shutdown_grace_s, timeout_keep_alive=timeout_keep_alive_s)


def serve(server: uvicorn.Server, engine: AsyncEngine) -> int:
    """Serve until stopped (a signal, should_exit) or until the engine crashes.

    Returns 0 after a stop, 1 after an engine crash, 3 (uvicorn's startup failure) if it never started."""
    engine.on_crash = lambda: setattr(server, "should_exit", True)
    if not engine.crashed:
        try:
            server.run()
        except (KeyboardInterrupt, _Terminated):  # uvicorn raises the Ctrl-C or SIGTERM it caught once shut down
            pass
    if engine.crashed:
        return 1
    return 0 if server.started else STARTUP_FAILURE


def _default_served_name(spec: str, model_dir: Path) -> str:
    return DEFAULT_SERVED_MODEL_NAME if spec == DEFAULT_MODEL_SPEC else model_dir.name


def _build_executor(args: argparse.Namespace, model_dir: Path, tokenizer: ModelTokenizer):
    if args.executor == "sim":
        from worker.executor.sim_executor import DEFAULT_SIM_TIMING, SimExecutor, SimTiming

        timing = SimTiming.parse(args.sim_timing) if args.sim_timing else DEFAULT_SIM_TIMING
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        return SimExecutor(timing, block_size=args.block_size, num_blocks=args.num_blocks or SIM_DEFAULT_NUM_BLOCKS,
                           max_model_len=args.max_model_len or SIM_DEFAULT_MAX_MODEL_LEN,
                           vocab_size=tokenizer.vocab_size, eos_token_id=eos,
                           ordinary_token_ids=_ordinary_token_ids(tokenizer))
    from worker.executor.torch_executor import TorchExecutor

    return TorchExecutor.from_pretrained(model_dir, device=args.device or _default_device(),
                                         block_size=args.block_size, num_blocks=args.num_blocks,
                                         max_model_len=args.max_model_len)


def _ordinary_token_ids(tokenizer: ModelTokenizer) -> range:
    """Ids above the special tokens (which tokenizers put first), so sim text decodes as text."""
    special = [i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special]
    return range(max(special, default=-1) + 1, tokenizer.vocab_size)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _build_publisher(args: argparse.Namespace):
    """The KV-event publisher, bound (a bare port on 127.0.0.1); OSError when its ports are taken,
    ValueError for an endpoint without a port. Binding elsewhere exposes prompts' token ids: logged."""
    if not args.kv_events_endpoint:
        return None
    from worker.kv_publisher import KVEventPublisher, bind_endpoint, is_loopback

    endpoint = bind_endpoint(args.kv_events_endpoint)
    if not is_loopback(endpoint):
        log.warning("KV events bind %s: anyone who can reach it reads every prompt's token ids", endpoint)
    return KVEventPublisher(endpoint, None, topic=f"kv-events.{args.worker_id or 'worker'}")
