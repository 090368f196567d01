"""One gateway process's uvicorn server: its settings, logging, the process's signal setup, the
announcement once it listens, and serving until stopped (used by gateway/cli.py for one process and by
gateway/multiprocess.py for each of `--workers N`)."""

from __future__ import annotations

import logging
import signal
import socket
import ssl
import sys

import uvicorn
from uvicorn.server import STARTUP_FAILURE

from gateway.core import GatewayCore
from kvgate.config import ConfigError, ServerConfig

GIL_SWITCH_INTERVAL_S = 0.0005


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
