"""`kvgate gateway`: build the app from a config and serve it with uvicorn (one process; `--workers N`
hands over to gateway/multiprocess.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Mapping
from pathlib import Path

import uvicorn
from uvicorn.server import STARTUP_FAILURE

from gateway.app import build_app
from gateway.core import GatewayCore
from kvgate.config import ConfigError, KvgateConfig, ServerConfig

GIL_SWITCH_INTERVAL_S = 0.0005


def serve(config: KvgateConfig, tokenizer_dirs: Mapping[str, Path], host: str, port: int) -> int:
    configure_logging("gateway")
    core = GatewayCore(config, tokenizer_dirs)
    prepare_process(core)
    announcement = f"gateway listening on {listen_url(host, port, config.gateway)} (pools: {', '.join(config.pools)})"
    app = build_app(core, freeze_gc=True)
    server = GatewayServer(server_config(app, host, port, config.gateway), core, announcement)
    return run_server(server)


def configure_logging(source: str) -> None:
    """Log lines name their source (`gateway`, or `gateway[PID]` for one of several processes)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {source} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise


def prepare_process(core: GatewayCore) -> None:
    """The interpreter's switch interval, and SIGHUP to reload the routing policies."""
    # While the offload thread works on a large request (kvgate/offload.py), the event loop waits up
    # to this long for the interpreter lock at each wake-up (Python's default is 5 ms)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # reload the policy file; without one, a stray SIGHUP (a closed terminal, a reload sent out of
    # habit) is logged, it must not kill the gateway
    signal.signal(signal.SIGHUP, lambda signum, frame: core.reload_policies())


def server_config(app, host: str, port: int, server: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings for the gateway.

    Keep idle client connections longer than the usual load-balancer idle timeout (60 s), so a
    balancer never reuses a connection the gateway has just closed. No per-request access log (the
    metrics count requests) and no X-Forwarded-* rewriting (nothing reads the client address): both
    cost CPU on every request. HTTPS with server.tls_certfile; on SIGTERM, requests in flight get
    server.shutdown_grace_s to finish.
    """
    return uvicorn.Config(app, host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=server.shutdown_grace_s, ssl_certfile=server.tls_certfile,
                          ssl_keyfile=server.tls_keyfile, loop="uvloop", http="httptools", backlog=4096,
                          timeout_keep_alive=75, access_log=False, proxy_headers=False)


def listen_url(host: str, port: int, server: ServerConfig) -> str:
    return f"{server.scheme}://[{host}]:{port}" if ":" in host else f"{server.scheme}://{host}:{port}"


def check_tls(server: ServerConfig) -> None:
    """ConfigError naming the key unless the certificate chain and its key load (checked once, before any
    process starts: uvicorn's own error would come from each process, as a traceback)."""
    if not server.tls_certfile:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(server.tls_certfile, server.tls_keyfile)
    except OSError as exc:  # ssl.SSLError included
        key = f" with the key {server.tls_keyfile}" if server.tls_keyfile else ""
        reason = exc.strerror if exc.strerror and not isinstance(exc, ssl.SSLError) else str(exc)
        raise ConfigError("gateway.tls_certfile",
                          f"cannot load the certificate chain {server.tls_certfile}{key}: {reason}") from None


def run_server(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> int:
    """Serve until stopped: 0 after a clean stop, STARTUP_FAILURE when it never started."""
    try:
        server.run(sockets)
    except KeyboardInterrupt:
        pass
    return 0 if server.started else STARTUP_FAILURE


class GatewayServer(uvicorn.Server):
    """Logs that the gateway listens once the socket is bound (not before: a taken port fails there); as
    it stops, begins the gateway's shutdown (gateway/shutdown.py) and says what is still in flight."""

    def __init__(self, config: uvicorn.Config, core: GatewayCore, announcement: str) -> None:
        super().__init__(config)
        self.core = core
        self.announcement = announcement

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            logging.getLogger("kvgate.gateway").info("%s", self.announcement)

    async def shutdown(self, sockets=None) -> None:
        self.core.shutdown.begin()
        in_flight = self.core.metrics.requests_in_flight
        if in_flight:
            logging.getLogger("kvgate.gateway").info(
                "stopping: %d request(s) in flight get up to %g s to finish", in_flight,
                self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)


def run(args: argparse.Namespace, config: KvgateConfig, tokenizer_dirs: Mapping[str, Path]) -> int:
    check_tls(config.gateway)
    host = args.host or config.gateway.host
    port = args.port if args.port is not None else config.gateway.port
    workers = getattr(args, "workers", 1)
    process_index = getattr(args, "process_index", None)
    if process_index is not None:  # one of the processes a `--workers N` parent started
        from gateway.multiprocess import ProcessSlot, serve_process

        return serve_process(config, tokenizer_dirs, host, port, ProcessSlot(process_index, workers, args.run_dir))
    if workers > 1:
        from gateway.multiprocess import supervise

        return supervise(args.config, config, host, port, workers)
    return serve(config, tokenizer_dirs, host, port)
