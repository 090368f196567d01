"""The inference engines a fleet runs (`kvgate bench fleet --engine`): how one worker of each is started
(command line, environment, CPU) and what the gateway is told about it (block size).

sim: `kvgate worker --executor sim` (a timing model, unpinned, as before); kvgate: `kvgate worker` with the
torch executor; vllm: vLLM's CPU build from its venv under results/ (loadtest/peers/vllm.py). Real
engines are pinned: worker i on the i-th CPU this process may use (round robin past the last one).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from loadtest.peers.vllm import (VLLM_BLOCK_SIZE, VLLM_START_TIMEOUT_S, ensure_vllm_venv, read_model_max_len,
                                 vllm_argv, vllm_env)
from loadtest.procs import default_model_dir

ENGINES = ("sim", "kvgate", "vllm")
EXECUTORS = {"sim": "sim", "kvgate": "torch", "vllm": "vllm"}  # what result files and reports call them
DEFAULT_MODEL = "default"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `kvgate worker --model default` serves
KVGATE_WORKER = (sys.executable, "-m", "kvgate", "worker")
DEFAULT_BLOCK_SIZE = 16  # a kvgate worker's, and the gateway's assumption until a worker reports its own


@dataclass(frozen=True, slots=True)
class Engine:
    """An engine resolved once per fleet: the command that starts a worker (kvgate: `kvgate worker`;
    vllm: the venv's python) and the model it serves (vllm: always a folder, with the name it serves and
    its context length, which a small --num-blocks must cap)."""

    kind: str
    command: tuple[str, ...]
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    model_max_len: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {self.kind!r}")
        if self.kind == "vllm" and len(self.command) != 1:
            raise ValueError("a vllm engine's command is its venv's python alone")


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """How to start one worker, and what the gateway's entry for it says (block_size None: the engine's
    default, which the gateway assumes too); start_timeout_s None: the fleet's own health timeout."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cpus: frozenset[int] | None
    block_size: int | None = None
    start_timeout_s: float | None = None


def resolve_engine(kind: str, worker_model: str = DEFAULT_MODEL,
                   worker_command: Sequence[str] = KVGATE_WORKER) -> Engine:
    """The engine for `--engine kind --worker-model worker_model`; for vllm this installs vLLM when its
    venv is missing and converts the default model when it is asked for (both once, and slow)."""
    if kind != "vllm":
        return Engine(kind, tuple(worker_command), worker_model)
    model_dir = default_model_dir() if worker_model == DEFAULT_MODEL else Path(worker_model)
    served = DEFAULT_SERVED_MODEL_NAME if worker_model == DEFAULT_MODEL else model_dir.name
    return Engine("vllm", (str(ensure_vllm_venv()),), str(model_dir), served, read_model_max_len(model_dir))


def worker_cpu(kind: str, index: int, cpus: Sequence[int]) -> int | None:
    """The CPU worker `index` is pinned to: None for sim workers (they mostly sleep) or when none is known."""
    if kind == "sim" or not cpus:
        return None
    return sorted(cpus)[index % len(cpus)]


def worker_launch(engine: Engine, name: str, port: int, kv_port: int, *, cpu: int | None = None,
                  num_blocks: int | None = None, extra_args: Sequence[str] = ()) -> WorkerLaunch:
    """Worker `name` on 127.0.0.1:port publishing KV events on tcp://127.0.0.1:kv_port (replay on the next
    port), num_blocks KV blocks when given, pinned to cpu when given; extra_args go last."""
    cpus = None if cpu is None else frozenset({cpu})
    if engine.kind == "vllm":
        served = engine.served_model_name or Path(engine.model).name
        argv = vllm_argv(Path(engine.command[0]), Path(engine.model), served, port, kv_port, num_blocks=num_blocks,
                         model_max_len=engine.model_max_len, extra_args=extra_args)
        return WorkerLaunch(tuple(argv), vllm_env(cpu), cpus, VLLM_BLOCK_SIZE, VLLM_START_TIMEOUT_S)
    capacity = ("--num-blocks", str(num_blocks)) if num_blocks is not None else ()
    argv = (*engine.command, "--model", engine.model, "--executor", EXECUTORS[engine.kind], "--port", str(port),
            "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}", "--worker-id", name, *capacity, *extra_args)
    env = {"OMP_NUM_THREADS": "1"} if engine.kind == "kvgate" and cpu is not None else {}  # one core, one thread
    return WorkerLaunch(argv, env, cpus, _block_size_arg(extra_args))


def worker_block_size(kind: str, extra_args: Sequence[str] = ()) -> int:
    """Tokens per KV block of a worker of this engine: vLLM's on CPU, else `--block-size` or the default, 16."""
    return VLLM_BLOCK_SIZE if kind == "vllm" else _block_size_arg(extra_args) or DEFAULT_BLOCK_SIZE


def _block_size_arg(args: Sequence[str]) -> int | None:
    """The `--block-size N` (or `=N`) a `kvgate worker` is given, the last one winning, as in argparse; the
    gateway must key requests with the size its workers' KV events use (it assumes the default, 16)."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--block-size" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--block-size="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.isdigit() else None
