"""Fixtures shared by every test package."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P and P + 1 both free: a KV-event endpoint and its replay socket."""
    for _ in range(200):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of adjacent ports")


@pytest.fixture
def port_factory():
    return free_port
