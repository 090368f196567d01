"""`kvgate up` end to end: sim workers and the gateway as real children, one request, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import yaml

from tests.conftest import free_port, free_port_pair

pytestmark = pytest.mark.slow  # `kvgate up` starts real worker and gateway processes


def test_up_starts_the_stack_serves_the_sdk_and_stops_cleanly_on_ctrl_c(tiny_llama_dir, tmp_path):
    gateway_port = free_port()
    workers = []
    for i in range(2):
        port, kv = free_port(), free_port_pair()
        workers.append({"name": f"s{i}", "url": f"http://127.0.0.1:{port}",
                        "kv_events_endpoint": f"tcp://127.0.0.1:{kv}",
                        "launch": {"model": str(tiny_llama_dir), "executor": "sim", "num_blocks": 256,
                                   "served_model_name": "tiny", "sim_timing": "name=fast,step_overhead_s=0.001"}})
    config = {"gateway": {"host": "127.0.0.1", "port": gateway_port},
              "pools": {"default": {"model": "tiny", "tokenizer": str(tiny_llama_dir), "workers": workers}}}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "KVGATE_API_KEY": "up-test-key"}
    proc = subprocess.Popen([sys.executable, "-m", "kvgate", "up", "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Press Ctrl-C to stop."):
                break
        banner = "".join(lines)
        assert f"OpenAI base URL: http://127.0.0.1:{gateway_port}/v1" in banner, banner
        assert "API key:         up-test-key" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="up-test-key")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
        assert reply.usage.completion_tokens == 3
        children = _children(proc.pid)
        assert len(children) == 3
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    for pid in children:
        assert not _alive(pid), f"child {pid} outlived kvgate up"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
