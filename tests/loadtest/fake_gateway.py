"""A stand-in for `kvgate gateway` in fleet tests: reads the YAML, round-robins, names the worker it chose.

Only what the fleet loop needs: --config/--port, /health, /metrics, streaming pass-through, x-kvgate-worker.
With --worker-urls URL... instead of --config it stands in for a peer router the fleet starts itself
(workers named w0, w1, ... in the order given). With --routes-after-s S it answers /health at once but
/v1/* with 503 for its first S seconds, as sglang-router 0.3.2 does until it has found its workers healthy.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import httpx
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


def build_app(config: dict, routes_after_s: float = 0.0) -> Starlette:
    workers = config["pools"]["default"]["workers"]
    turn = itertools.cycle(workers)
    client = httpx.AsyncClient(timeout=60.0)
    served = {"count": 0}
    routes_from = time.monotonic() + routes_after_s

    def no_workers_yet() -> PlainTextResponse | None:
        return PlainTextResponse("no healthy worker", status_code=503) if time.monotonic() < routes_from else None

    async def forward(request: Request):
        if (refused := no_workers_yet()) is not None:
            return refused
        worker = next(turn)
        served["count"] += 1
        upstream = client.build_request("POST", worker["url"] + request.url.path, content=await request.body(),
                                        headers={"content-type": "application/json"})
        resp = await client.send(upstream, stream=True)
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"),
                                 headers={"x-kvgate-worker": worker["name"],
                                          "x-kvgate-policy": config["pools"]["default"]["policy"]["type"]})

    async def health(request: Request):
        return PlainTextResponse("ok")

    async def models(request: Request):
        return no_workers_yet() or JSONResponse({"object": "list", "data": []})

    async def metrics(request: Request):
        return PlainTextResponse(f'kvgate_upstream_retries_total{{pool="default"}} {served["count"]}\n')

    return Starlette(routes=[Route("/v1/chat/completions", forward, methods=["POST"]),
                             Route("/v1/completions", forward, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)])


def main() -> int:
    parser = argparse.ArgumentParser()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config")
    source.add_argument("--worker-urls", nargs="+")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--routes-after-s", type=float, default=0.0)
    args = parser.parse_args()
    if args.config:
        with open(args.config) as f:
            config = yaml.safe_load(f)
    else:
        workers = [{"name": f"w{i}", "url": url} for i, url in enumerate(args.worker_urls)]
        config = {"pools": {"default": {"workers": workers, "policy": {"type": "peer"}}}}
    uvicorn.run(build_app(config, args.routes_after_s), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
