"""`kvgate up` over its lifetime: a killed worker comes back, SIGHUP reloads policies, a gateway that can't bind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port, free_port_pair

pytestmark = pytest.mark.slow  # `kvgate up` starts real worker and gateway processes

API_KEY = "lifecycle-test-key"


class Up:
    """`kvgate up --config PATH` as a child, its output gathered line by line on a thread."""

    def __init__(self, config_path: Path) -> None:
        env = {**os.environ, "KVGATE_API_KEY": API_KEY}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvgate", "up", "--config", str(config_path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                if text in self.output():
                    return
                raise AssertionError(f"kvgate up exited with {self.proc.returncode} before {text!r}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)

    def child_pid(self, marker: str) -> int:
        """The pid of the child whose command line contains `marker`."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        for pid in map(int, out.stdout.split()):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read().replace(b"\0", b" "):
                    return pid
        raise AssertionError(f"no child of kvgate up runs {marker!r}")

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=5)
            self.proc.stdout.close()


def write_config(tmp_path: Path, model_dir: Path, gateway_port: int, num_workers: int, **routing) -> Path:
    workers = []
    for i in range(num_workers):
        workers.append({"name": f"s{i}", "url": f"http://127.0.0.1:{free_port()}",
                        "kv_events_endpoint": f"tcp://127.0.0.1:{free_port_pair()}",
                        "launch": {"model": str(model_dir), "executor": "sim", "num_blocks": 256,
                                   "served_model_name": "tiny", "sim_timing": "name=fast,step_overhead_s=0.001"}})
    config = {"gateway": {"host": "127.0.0.1", "port": gateway_port},
              "health": {"interval_s": 0.5, "timeout_s": 1.0},
              "routing": routing,
              "pools": {"default": {"model": "tiny", "tokenizer": str(model_dir), "policy": {"type": "round_robin"},
                                    "workers": workers}}}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def complete(gateway_port: int, text: str = "hi") -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30,
                      json={"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2})


def test_a_killed_worker_is_restarted_while_the_gateway_serves_on_the_other_and_ramps_back_in(
        tiny_llama_dir, tmp_path):
    gateway_port = free_port()
    up = Up(write_config(tmp_path, tiny_llama_dir, gateway_port, num_workers=2))
    try:
        up.wait_for("Press Ctrl-C to stop.")
        os.kill(up.child_pid("--worker-id s0"), signal.SIGKILL)
        up.wait_for("kvgate: restarting s0 in 1 s (death 1 in a row)")
        served_by = {complete(gateway_port, f"while s0 is down {i}").headers["x-kvgate-worker"] for i in range(4)}
        assert served_by == {"s1"}
        up.wait_for("kvgate: s0 is healthy again")
        deadline = time.monotonic() + 30
        while "warming" not in (ready := httpx.get(f"http://127.0.0.1:{gateway_port}/ready").json()):
            assert time.monotonic() < deadline, f"s0 never warmed up: {ready}"
            time.sleep(0.1)
        assert 0 < ready["warming"]["default"]["s0"] < 1
        # slow start: round robin would give s0 half; coming back cold it takes about a tenth of that at first
        first = [complete(gateway_port, f"back {i}").headers["x-kvgate-worker"] for i in range(40)]
        assert first.count("s0") < 10, first
        metrics = httpx.get(f"http://127.0.0.1:{gateway_port}/metrics").text
        assert 'kvgate_worker_warmup_share{worker="s1"} 1.0' in metrics
        assert 'kvgate_worker_warmup_share{worker="s0"} 0.' in metrics
        while "s0" not in served_by:
            assert time.monotonic() < deadline, "the restarted worker never served through the gateway"
            reply = complete(gateway_port, f"after the restart {len(served_by)}")
            assert reply.status_code == 200, reply.text
            served_by.add(reply.headers["x-kvgate-worker"])
            time.sleep(0.2)
        assert "kvgate: s0 was killed by signal 9; last log lines:" in up.output()
    finally:
        assert up.close() == 0, up.output()


def test_sighup_reloads_the_gateway_policies_and_the_stack_keeps_running(tiny_llama_dir, tmp_path):
    policies = tmp_path / "policies.yaml"
    policies.write_text(yaml.safe_dump({"rules": [{"name": "all", "pool": "default",
                                                   "policy": {"type": "round_robin"}}]}))
    gateway_port = free_port()
    up = Up(write_config(tmp_path, tiny_llama_dir, gateway_port, num_workers=1, policies_file=str(policies)))
    try:
        up.wait_for("Press Ctrl-C to stop.")
        gateway_pid = up.child_pid("gateway --config")
        up.proc.send_signal(signal.SIGHUP)
        up.wait_for("kvgate: SIGHUP: forwarded to gateway to reload")
        assert complete(gateway_port).status_code == 200  # the gateway reloads before its next request
        up.wait_for("routing policies reloaded from")
        assert up.proc.poll() is None
        assert up.child_pid("gateway --config") == gateway_pid
    finally:
        assert up.close() == 0, up.output()


def test_sighup_without_a_policies_file_is_ignored_and_the_stack_keeps_running(tiny_llama_dir, tmp_path):
    gateway_port = free_port()
    up = Up(write_config(tmp_path, tiny_llama_dir, gateway_port, num_workers=1))
    try:
        up.wait_for("Press Ctrl-C to stop.")
        up.proc.send_signal(signal.SIGHUP)
        up.wait_for("kvgate: SIGHUP ignored: no running child reloads on it")
        assert complete(gateway_port).status_code == 200
    finally:
        assert up.close() == 0, up.output()


def test_a_gateway_that_cannot_bind_its_port_stops_the_stack_with_status_1(tiny_llama_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gateway_port = taken.getsockname()[1]
        up = Up(write_config(tmp_path, tiny_llama_dir, gateway_port, num_workers=1))
        try:
            assert up.proc.wait(timeout=60) == 1
        finally:
            up.close()
    output = up.output()
    assert "kvgate: gateway exited with code 3; last log lines:" in output  # uvicorn's startup failure
    assert "address already in use" in output
    assert "kvgate is up." not in output
