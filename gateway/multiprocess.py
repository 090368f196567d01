"""`kvgate gateway --workers N`: N full gateway processes on one port, the parent that supervises
them (kvgate/supervisor.py), and the /metrics page that shows all of them.

Port sharing: each process binds its own socket with SO_REUSEPORT and the kernel spreads new
connections over the listening sockets by a hash of the connection's addresses. The other model, one
socket bound by the parent and inherited (uvicorn's and gunicorn's --workers), balances worse on
Linux: every process waits on the one accept queue, and whichever event loop wakes first accepts
everything queued (asyncio and uvloop accept up to the backlog per wake-up), so under bursts a few
processes take most connections, and keep-alive connections stay where they landed. What SO_REUSEPORT
costs on failure: connections still queued at a process that dies are reset (the restart is prompt,
and Linux 5.14+ with net.ipv4.tcp_migrate_req=1 hands them to a sibling), and a process that hangs
alive keeps its share of new connections. The parent checks the port with a plain bind first (which
fails against any listener, even another SO_REUSEPORT group of this user), then holds it for the
processes, bound but not listening, so no other program takes it while one restarts.

Metrics: each process keeps its own registry, and a scrape through the shared port reaches one
process at random. So each process also serves its page on a unix socket in the parent's run
directory, and GET /metrics on the shared port answers every process's series merged, each with a
`gateway_process` label (0..N-1, stable across restarts), plus `kvgate_gateway_process_up` per
process (0: its page could not be read within 1 s). One scrape target stays enough, and sum()
over the label gives the host's totals. prometheus_client's multiprocess mode does not fit: it
covers only its own Counter/Gauge/Histogram classes, not the collectors that read router and
admission state at scrape time, nor gateway/loop_metrics.py's series.

Shared state: N > 1 needs redis.url (kvgate/cli.py refuses it otherwise), so the processes share
what replicas share (API keys, tenant limits, retry budgets, routing decisions, load, breakers, the
worker registry: docs/architecture.md); redis.replicas counts hosts, and each process keeps 1 /
(replicas x N) of a tenant's limits while Redis is unreachable. Each process runs its own health
checks, KV-event subscriptions and adaptive pool limits, as separate replicas do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import TextIO

import uvicorn
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.server import STARTUP_FAILURE

from gateway.app import build_app
from gateway.core import GatewayCore
from gateway.routing_config import routing_rules
from gateway.server import GatewayServer, configure_logging, listen_url, prepare_process, run_server, server_config
from kvgate.config import KvgateConfig
from kvgate.supervisor import ChildSpec, Supervisor

log = logging.getLogger("kvgate.gateway")

PROCESS_LABEL = "gateway_process"
START_TIMEOUT_S = 120.0  # for a process to serve, at start and after a restart
PAGE_TIMEOUT_S = 1.0  # for a sibling's metrics page at a scrape
STOP_MARGIN_S = 5.0  # past a process's shutdown grace, for its own stop (then it is killed)
PAGE_END = b"# EOF\n"  # ends a complete page on the unix socket (a comment to the text format's parsers)
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_UNIX_PATH_BYTES = 107


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessSlot:
    """Process `index` of `count`; run_dir holds each process's metrics socket."""

    index: int
    count: int
    run_dir: Path

    def metrics_socket(self, index: int | None = None) -> Path:
        return Path(self.run_dir) / f"metrics-{self.index if index is None else index}.sock"


# --- the parent -----------------------------------------------------------------------------------

def supervise(config_path: Path, config: KvgateConfig, host: str, port: int, count: int,
              out: TextIO = sys.stderr) -> int:
    """Start `count` gateway processes on host:port, restart one that dies, stop all on SIGTERM/SIGINT,
    pass SIGHUP on; 0 after a clean stop, non-zero when they cannot start or keep dying."""
    routing_rules(config)  # a policy error stops here, once, not in every process
    try:
        reservation = reserve_port(host, port)
    except OSError as exc:
        out.write(f"kvgate: cannot listen on {host}:{port}: {exc.strerror or exc}\n")
        return STARTUP_FAILURE
    with reservation, tempfile.TemporaryDirectory(prefix="kvgate-gateway-") as run_dir:
        port = reservation.getsockname()[1]
        slots = [ProcessSlot(i, count, Path(run_dir)) for i in range(count)]
        if len(os.fsencode(slots[-1].metrics_socket())) > _MAX_UNIX_PATH_BYTES:
            out.write(f"kvgate: {run_dir} is too long a path for unix sockets: set TMPDIR to a shorter one\n")
            return 2
        specs = [ChildSpec(name=f"gateway-{slot.index}", argv=process_argv(config_path, host, port, slot),
                           ready_check=partial(page_answers, slot.metrics_socket()), reloads_on_sighup=True)
                 for slot in slots]
        # each process drains its requests in flight for up to shutdown_grace_s before it exits
        supervisor = Supervisor(specs, health_timeout_s=START_TIMEOUT_S, out=out,
                                stop_timeout_s=config.gateway.shutdown_grace_s + STOP_MARGIN_S)

        def announce() -> None:
            out.write(f"kvgate: gateway listening on {listen_url(host, port, config.gateway)} ({count} processes; "
                      f"pools: {', '.join(config.pools)})\n")
            out.flush()

        return supervisor.run(on_ready=announce)


def reserve_port(host: str, port: int) -> socket.socket:
    """host:port (port 0: a free one) checked free and held, bound but not listening, for the processes.

    The check binds without SO_REUSEPORT, which fails while anything listens there. The hold has
    SO_REUSEPORT alone: processes of this user can join it, and any other bind fails.
    """
    with _bound_socket(host, port, socket.SO_REUSEADDR) as probe:
        port = probe.getsockname()[1]
    return _bound_socket(host, port, socket.SO_REUSEPORT)


def process_argv(config_path: Path, host: str, port: int, slot: ProcessSlot) -> tuple[str, ...]:
    return (sys.executable, "-m", "kvgate", "gateway", "--config", str(config_path), "--host", host,
            "--port", str(port), "--workers", str(slot.count), "--process-index", str(slot.index),
            "--run-dir", str(slot.run_dir))


def page_answers(path: Path) -> bool:
    """A process is up once its metrics socket accepts: it binds that after the gateway started serving."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PAGE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _bound_socket(host: str, port: int, *options: int) -> socket.socket:
    """A TCP socket bound to host:port with these SOL_SOCKET options on (an IPv6 host: an IPv6 socket,
    as uvicorn binds)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        for option in options:
            sock.setsockopt(socket.SOL_SOCKET, option, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


# --- one process --------------------------------------------------------------------------------

def serve_process(config: KvgateConfig, tokenizer_dirs: Mapping[str, Path], host: str, port: int,
                  slot: ProcessSlot) -> int:
    """One of the parent's processes: its own SO_REUSEPORT socket on the shared port, a full gateway,
    and its metrics page on its unix socket."""
    configure_logging(f"gateway[{os.getpid()}]")
    try:
        sock = _bound_socket(host, port, socket.SO_REUSEADDR, socket.SO_REUSEPORT)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return STARTUP_FAILURE
    core = GatewayCore(process_config(config, slot.count), tokenizer_dirs)
    prepare_process(core)
    app = build_app(core, freeze_gc=True)
    replace_metrics_route(app.starlette, AllProcessesMetrics(slot, core.metrics.render).page)
    server = _ProcessServer(server_config(app, host, port, config.gateway), core, slot,
                            f"gateway process {slot.index} of {slot.count} serving on "
                            f"{listen_url(host, port, config.gateway)}")
    return run_server(server, [sock])


def process_config(config: KvgateConfig, count: int) -> KvgateConfig:
    """A process's view of the config: redis.replicas x count replicas share the tenant limits (each
    keeps its share while Redis is unreachable)."""
    return dataclasses.replace(config, redis=dataclasses.replace(config.redis, replicas=config.redis.replicas * count))


class _ProcessServer(GatewayServer):
    """Once serving: opens this process's metrics socket (the parent's sign that it is up) and says so."""

    def __init__(self, config: uvicorn.Config, core: GatewayCore, slot: ProcessSlot, announcement: str) -> None:
        super().__init__(config, core, announcement)
        self._slot = slot
        self._page_server: asyncio.AbstractServer | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._page_server = await serve_page(self._slot.metrics_socket(), self.core.metrics.render)

    async def shutdown(self, sockets=None) -> None:
        if self._page_server is not None:
            self._page_server.close()
        await super().shutdown(sockets)


async def serve_page(path: Path, render: Callable[[], bytes]) -> asyncio.AbstractServer:
    """Each connection to path gets this process's metrics page, PAGE_END, and the end of the stream."""
    path.unlink(missing_ok=True)  # what a predecessor killed outright left behind

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(render() + PAGE_END)
            await writer.drain()
        except ConnectionError:
            pass  # the parent's readiness probe does not read
        finally:
            writer.close()

    return await asyncio.start_unix_server(answer, path=str(path))


# --- every process's metrics at the shared port ----------------------------------------------------

class AllProcessesMetrics:
    """GET /metrics on the shared port: this process's page and its siblings', merged (merge_pages)."""

    def __init__(self, slot: ProcessSlot, render: Callable[[], bytes]) -> None:
        self._slot = slot
        self._render = render

    async def page(self, request: Request) -> Response:
        siblings = [i for i in range(self._slot.count) if i != self._slot.index]
        own = self._render()  # here, on the event loop that owns the state it reads
        read = await asyncio.gather(*(read_page(self._slot.metrics_socket(i)) for i in siblings))
        pages = {self._slot.index: own, **dict(zip(siblings, read))}
        return Response(await asyncio.to_thread(merge_pages, pages), media_type=METRICS_CONTENT_TYPE)


def replace_metrics_route(app: Starlette, endpoint: Callable) -> None:
    """Serve GET /metrics with endpoint instead of this process's own page (the middleware stays)."""
    for i, route in enumerate(app.router.routes):
        if isinstance(route, Route) and route.path == "/metrics":
            app.router.routes[i] = Route("/metrics", endpoint, methods=["GET"])
            return
    raise RuntimeError("the gateway app has no /metrics route")


async def read_page(path: Path) -> bytes | None:
    """A sibling's page from its unix socket; None when it is not there, too slow, or cut short."""
    async def read() -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(path))
        try:
            return await reader.read()
        finally:
            writer.close()

    try:
        page = await asyncio.wait_for(read(), PAGE_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return None
    return page if page.endswith(PAGE_END) else None


def merge_pages(pages: Mapping[int, bytes | None]) -> bytes:
    """One exposition of every process's page (index -> page; None: unreadable): each series gains
    gateway_process="<index>", and kvgate_gateway_process_up says whose page was read."""
    up = GaugeMetricFamily("kvgate_gateway_process_up", "1 if this gateway process's metrics were read at this "
                           "scrape (kvgate gateway --workers N).", labels=[PROCESS_LABEL])
    merged: dict[str, Metric] = {}
    for index, page in sorted(pages.items()):
        families = _parse(page)
        up.add_metric([str(index)], 0 if families is None else 1)
        for family in families or ():
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(s._replace(labels={PROCESS_LABEL: str(index), **s.labels}) for s in family.samples)
    return generate_latest(_Families([up, *merged.values()]))


def _parse(page: bytes | None) -> list[Metric] | None:
    if page is None:
        return None
    try:
        return list(text_string_to_metric_families(page.decode()))
    except (UnicodeDecodeError, ValueError):
        return None


class _Families:
    """What generate_latest collects from: the merged families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
