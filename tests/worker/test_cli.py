"""`kvgate worker` as an operator runs it: a KV-event port another process holds is one clear line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port, free_port_pair

pytestmark = pytest.mark.slow  # every test starts `kvgate worker` as a process


def start_worker(model_dir: Path, kv_port: int) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvgate", "worker", "--model", str(model_dir), "--executor", "sim",
            "--port", str(free_port()), "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("busy_offset", "socket_name"), [(0, "KV-event"), (1, "KV-event replay")],
                         ids=["event-port", "replay-port"])
def test_a_busy_kv_event_port_exits_with_one_line_and_no_traceback(tiny_llama_dir, busy_offset, socket_name):
    kv_port = free_port_pair()
    busy = kv_port + busy_offset
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", busy))
        holder.listen()
        result = start_worker(tiny_llama_dir, kv_port)
    assert result.returncode == 2
    assert result.stderr == f"kvgate worker: cannot bind {socket_name} socket tcp://127.0.0.1:{busy}: Address already in use\n"
