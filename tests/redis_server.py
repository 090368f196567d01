"""A redis-server a test starts on a loopback port of its own: it can stop, start again, hang and resume."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import redis


class RedisServer:
    """A redis-server this test started on a loopback port; it can stop, start again, hang and resume."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
            self._proc.wait(5)
            self._proc = None

    def hang(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)
