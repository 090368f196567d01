"""`kvgate gateway`: build the app from a config and serve it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import uvicorn
from uvicorn.server import STARTUP_FAILURE

from gateway.app import build_app
from gateway.core import GatewayCore
from kvgate.config import KvgateConfig

GIL_SWITCH_INTERVAL_S = 0.0005


def serve(config: KvgateConfig, tokenizer_dirs: Mapping[str, Path], host: str, port: int) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise
    core = GatewayCore(config, tokenizer_dirs)
    # While the offload thread works on a large request (kvgate/offload.py), the event loop waits up
    # to this long for the interpreter lock at each wake-up (Python's default is 5 ms)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # reload the policy file; without one, a stray SIGHUP (a closed terminal, a reload sent out of
    # habit) is logged, it must not kill the gateway
    signal.signal(signal.SIGHUP, lambda signum, frame: core.reload_policies())
    # Keep idle client connections longer than the usual load-balancer idle timeout (60 s), so
    # a balancer never reuses a connection the gateway has just closed. No per-request access log
    # (the metrics count requests) and no X-Forwarded-* rewriting (nothing reads the client address):
    # both cost CPU on every request.
    server_config = uvicorn.Config(build_app(core, freeze_gc=True), host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=5, loop="uvloop", http="httptools", backlog=4096,
                                   timeout_keep_alive=75, access_log=False, proxy_headers=False)
    server = _AnnouncingServer(server_config, f"gateway listening on http://{host}:{port} "
                                              f"(pools: {', '.join(config.pools)})")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0 if server.started else STARTUP_FAILURE


class _AnnouncingServer(uvicorn.Server):
    """Logs that the gateway listens once the socket is bound (not before: a taken port fails there)."""

    def __init__(self, config: uvicorn.Config, announcement: str) -> None:
        super().__init__(config)
        self.announcement = announcement

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            logging.getLogger("kvgate.gateway").info("%s", self.announcement)


def run(args: argparse.Namespace, config: KvgateConfig, tokenizer_dirs: Mapping[str, Path]) -> int:
    host = args.host or config.gateway.host
    port = args.port if args.port is not None else config.gateway.port
    return serve(config, tokenizer_dirs, host, port)
