"""Peer routers a fleet run starts itself (`kvgate bench fleet --external-command NAME=COMMAND`): the
command line with the run's worker URLs and ports filled in.

COMMAND is split like a shell line (no shell runs it). Placeholders: `{worker_urls}`, a word of its own,
becomes one word per worker URL; `{port}` is where the router must serve (the fleet drives
http://127.0.0.1:{port}/v1 and waits for any answer below 500 on /health); `{metrics_port}` is a second
free port (e.g. SGLang's --prometheus-port).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Sequence

WORKER_URLS = "{worker_urls}"
PORT = "{port}"
METRICS_PORT = "{metrics_port}"


@dataclass(frozen=True, slots=True)
class ExternalCommand:
    """A peer router's command line, checked when given: it must take the workers and the port."""

    name: str
    command: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("--external-command takes NAME=COMMAND")
        words = shlex.split(self.command)
        if WORKER_URLS not in words:
            raise ValueError(f"--external-command {self.name}: {WORKER_URLS} must be a word of its own "
                             "(it becomes one word per worker URL)")
        if not any(PORT in word for word in words):
            raise ValueError(f"--external-command {self.name}: {PORT} is missing (where the router serves)")

    def argv(self, worker_urls: Sequence[str], port: int, metrics_port: int) -> list[str]:
        """The command with the placeholders filled in."""
        argv: list[str] = []
        for word in shlex.split(self.command):
            if word == WORKER_URLS:
                argv.extend(worker_urls)
            else:
                argv.append(word.replace(PORT, str(port)).replace(METRICS_PORT, str(metrics_port)))
        return argv


def parse_external_command(spec: str) -> ExternalCommand:
    """NAME=COMMAND (the first '=' splits them)."""
    name, sep, command = spec.partition("=")
    if not sep or not command.strip():
        raise ValueError("--external-command takes NAME=COMMAND")
    return ExternalCommand(name, command)
