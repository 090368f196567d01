"""A reverse proxy in front of workers that notes when each marked request reached them.

Run as `python -m loadtest.recording_proxy --port P --upstream w0=URL --upstream w1=URL`; the gateway
is pointed at `http://127.0.0.1:P/w0` and so on. A request whose body holds `bench-marker NAME` is
recorded as (NAME, worker, time.monotonic() on arrival) before it is forwarded; `GET /_arrivals`
lists what arrived. CLOCK_MONOTONIC is one clock for every process on a Linux host, so a load
generator on the same host can compare these times with its own send times.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from typing import Callable, Mapping

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loadtest.fault_proxy import pass_on

MARKER_RE = re.compile(rb"bench-marker ([A-Za-z0-9_.:-]+)")


def marker_text(name: str) -> str:
    """The text to put in a prompt so the proxy records the request under `name`."""
    return f"bench-marker {name}"


def find_marker(body: bytes) -> str | None:
    """The marker name in a request body, None when it holds none."""
    match = MARKER_RE.search(body)
    return match.group(1).decode() if match else None


def build_app(upstreams: Mapping[str, str], clock: Callable[[], float] = time.monotonic,
              transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The proxy app: /NAME/PATH goes to upstreams[NAME] + /PATH; `transport` replaces the network to
    the workers (tests pass an httpx.MockTransport)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), transport=transport,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    arrivals: list[tuple[str, str, float]] = []

    async def listing(request: Request) -> Response:
        return JSONResponse({"arrivals": arrivals})

    async def forward(request: Request) -> Response:
        name, path = request.path_params["name"], request.path_params["path"]
        if name not in upstreams:
            return JSONResponse({"error": {"message": f"no upstream {name!r}", "code": 404}}, status_code=404)
        body = await request.body()
        marker = find_marker(body) if request.method == "POST" else None
        if marker is not None:
            arrivals.append((marker, name, clock()))
        return await pass_on(client, request, f"{upstreams[name].rstrip('/')}/{path}", body)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await client.aclose()

    return Starlette(routes=[Route("/_arrivals", listing, methods=["GET"]), Route("/_health", health),
                             Route("/{name}/{path:path}", forward, methods=["GET", "POST"])], lifespan=lifespan)


def fetch_arrivals(proxy_url: str) -> dict[str, list[float]]:
    """marker -> arrival times (monotonic s, in order) of every marked request the proxy at proxy_url
    saw; a marker sent more than once (a retry, a failover) has several."""
    arrivals: dict[str, list[float]] = {}
    for marker, _worker, arrived_s in httpx.get(f"{proxy_url}/_arrivals", timeout=30.0).json()["arrivals"]:
        arrivals.setdefault(marker, []).append(arrived_s)
    return arrivals


def _upstream(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.recording_proxy", description=__doc__)
    parser.add_argument("--upstream", required=True, action="append", type=_upstream,
                        help="NAME=URL of a worker, e.g. w0=http://127.0.0.1:8101 (repeat for each)")
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(dict(args.upstream)), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
