"""The worker command lines a fleet builds for each engine (loadtest/engines.py): sim as before, the bundled
torch worker pinned to a core, vLLM with prefix caching and KV events (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.engines import Engine, resolve_engine, worker_cpu, worker_launch

KVGATE = ("python", "-m", "kvgate", "worker")
VLLM = Engine("vllm", ("/venv/bin/python",), "/models/smollm2", "SmolLM2-135M-Instruct")


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_a_sim_worker_is_started_as_before_and_left_unpinned():
    launch = worker_launch(Engine("sim", KVGATE), "w1", 9001, 9101, extra_args=("--sim-timing=name=x",))
    assert launch.argv == (*KVGATE, "--model", "default", "--executor", "sim", "--port", "9001",
                           "--kv-events-endpoint", "tcp://127.0.0.1:9101", "--worker-id", "w1", "--sim-timing=name=x")
    assert (launch.env, launch.cpus, launch.block_size, launch.start_timeout_s) == ({}, None, None, None)


def test_a_kvgate_worker_runs_the_torch_executor_on_one_core_with_one_thread():
    launch = worker_launch(Engine("kvgate", KVGATE, "/models/tiny"), "w0", 9000, 9100, cpu=1, num_blocks=192)
    assert launch.argv == (*KVGATE, "--model", "/models/tiny", "--executor", "torch", "--port", "9000",
                           "--kv-events-endpoint", "tcp://127.0.0.1:9100", "--worker-id", "w0", "--num-blocks", "192")
    assert (dict(launch.env), launch.cpus) == ({"OMP_NUM_THREADS": "1"}, frozenset({1}))
    assert launch.block_size is None  # the worker's default, which the gateway assumes too


@pytest.mark.parametrize("extra_args", [("--block-size", "32"), ("--block-size=16", "--block-size=32")],
                         ids=["two-words", "last-wins"])
def test_a_kvgate_worker_given_a_block_size_tells_the_gateway(extra_args):
    """The gateway keys requests with the block size it is told (default 16); KV events of 32-token
    blocks would never match them."""
    assert worker_launch(Engine("kvgate", KVGATE), "w0", 9000, 9100, extra_args=extra_args).block_size == 32


def test_a_vllm_worker_caches_prefixes_and_publishes_kv_events_with_replay():
    launch = worker_launch(VLLM, "w0", 9000, 9100, cpu=0, num_blocks=192, extra_args=("--max-model-len", "4096"))
    argv = launch.argv
    assert argv[:3] == ("/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    assert (_flag(argv, "--model"), _flag(argv, "--served-model-name")) == ("/models/smollm2", "SmolLM2-135M-Instruct")
    assert (_flag(argv, "--dtype"), _flag(argv, "--block-size"), _flag(argv, "--port")) == ("float32", "32", "9000")
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(argv)
    assert _flag(argv, "--num-gpu-blocks-override") == "192"
    assert argv[-2:] == ("--max-model-len", "4096")
    assert json.loads(_flag(argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:9100",
        "replay_endpoint": "tcp://*:9101"}
    assert dict(launch.env) == {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                                "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert (launch.cpus, launch.block_size) == (frozenset({0}), 32)
    assert launch.start_timeout_s is not None and launch.start_timeout_s >= 300


def test_a_vllm_worker_without_a_kv_capacity_sizes_its_own_cache():
    argv = worker_launch(VLLM, "w0", 9000, 9100).argv
    assert "--num-gpu-blocks-override" not in argv
    assert "VLLM_CPU_OMP_THREADS_BIND" not in worker_launch(VLLM, "w0", 9000, 9100).env


@pytest.mark.parametrize(("kind", "index", "cpus", "expected"), [
    ("vllm", 0, [0, 1], 0),
    ("vllm", 1, [0, 1], 1),
    ("kvgate", 2, [0, 1], 0),
    ("vllm", 1, [5, 3], 5),
    ("sim", 0, [0, 1], None),
    ("vllm", 0, [], None),
], ids=["first", "second", "round-robin", "sorted", "sim-unpinned", "no-cpus"])
def test_real_engine_workers_are_pinned_one_per_cpu(kind, index, cpus, expected):
    assert worker_cpu(kind, index, cpus) == expected


def test_sim_and_kvgate_engines_resolve_without_installing_anything():
    assert resolve_engine("kvgate", "/models/tiny", KVGATE) == Engine("kvgate", KVGATE, "/models/tiny")
    assert resolve_engine("sim") == Engine("sim", resolve_engine("sim").command, "default")


def test_an_unknown_engine_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="--engine must be one of sim, kvgate, vllm, not 'sglang'"):
        Engine("sglang", KVGATE)


def test_a_vllm_model_folder_serves_under_its_folder_name_when_no_name_is_given():
    engine = Engine("vllm", ("/venv/bin/python",), str(Path("/models/tiny-llama")))
    assert _flag(worker_launch(engine, "w0", 9000, 9100).argv, "--served-model-name") == "tiny-llama"


@pytest.mark.parametrize(("num_blocks", "extra_args", "expected"), [
    (192, (), "6112"),  # 191 usable blocks of 32 (vLLM keeps one as its null block) < the model's 8192
    (1024, (), None),  # the model's own length fits
    (192, ("--max-model-len=2048",), None),  # the user's own wins
], ids=["capped", "fits", "user-set"])
def test_a_small_vllm_kv_capacity_caps_the_context_so_that_vllm_starts(num_blocks, extra_args, expected):
    engine = Engine("vllm", ("/venv/bin/python",), "/models/smollm2", "SmolLM2-135M-Instruct", model_max_len=8192)
    argv = worker_launch(engine, "w0", 9000, 9100, num_blocks=num_blocks, extra_args=extra_args).argv
    assert (_flag(argv, "--max-model-len") if "--max-model-len" in argv else None) == expected
