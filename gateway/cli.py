"""`kvgate gateway`: build the app from a config and serve it with uvicorn (one process, served by
gateway/server.py; `--workers N` hands over to gateway/multiprocess.py)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from gateway.app import build_app
from gateway.core import GatewayCore
from gateway.multiprocess import ProcessSlot, serve_process, supervise
from gateway.server import (
    GatewayServer,
    check_tls,
    configure_logging,
    listen_url,
    prepare_process,
    run_server,
    server_config,
)
from kvgate.config import KvgateConfig


def serve(config: KvgateConfig, tokenizer_dirs: Mapping[str, Path], host: str, port: int) -> int:
    configure_logging("gateway")
    core = GatewayCore(config, tokenizer_dirs)
    prepare_process(core)
    announcement = f"gateway listening on {listen_url(host, port, config.gateway)} (pools: {', '.join(config.pools)})"
    app = build_app(core, freeze_gc=True)
    server = GatewayServer(server_config(app, host, port, config.gateway), core, announcement)
    return run_server(server)


def run(args: argparse.Namespace, config: KvgateConfig, tokenizer_dirs: Mapping[str, Path]) -> int:
    check_tls(config.gateway)
    host = args.host or config.gateway.host
    port = args.port if args.port is not None else config.gateway.port
    workers = getattr(args, "workers", 1)
    process_index = getattr(args, "process_index", None)
    if process_index is not None:  # one of the processes a `--workers N` parent started
        return serve_process(config, tokenizer_dirs, host, port, ProcessSlot(process_index, workers, args.run_dir))
    if workers > 1:
        return supervise(args.config, config, host, port, workers)
    return serve(config, tokenizer_dirs, host, port)
