"""The round-robin balancer a fleet puts before gateway replicas (loadtest/peers/nginx.py): its config,
and, where nginx is installed, requests alternating over two real upstreams."""

from __future__ import annotations

import http.server
import threading
from collections import Counter

import httpx
import pytest

from loadtest.peers import NGINX
from loadtest.peers.nginx import balancer_argv, balancer_conf
from loadtest.procs import ChildProcess, free_port


def test_the_config_names_every_upstream_and_streams_unbuffered(tmp_path):
    conf = balancer_conf(9000, [9001, 9002], tmp_path)
    assert "listen 127.0.0.1:9000" in conf
    assert "server 127.0.0.1:9001;" in conf and "server 127.0.0.1:9002;" in conf
    assert "proxy_buffering off;" in conf and "daemon off;" in conf
    with pytest.raises(ValueError):
        balancer_conf(9000, [], tmp_path)


@pytest.mark.skipif(not NGINX.present(), reason=f"nginx is not installed ({NGINX.install})")
def test_requests_alternate_over_the_upstreams(tmp_path):
    servers = [_named_server(name) for name in ("a", "b")]
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(balancer_conf(port, [s.server_address[1] for s in servers], tmp_path))
    child = ChildProcess("balancer", balancer_argv(conf, tmp_path), tmp_path / "nginx.log",
                         f"http://127.0.0.1:{port}/health")
    try:
        child.wait_healthy(10.0)
        with httpx.Client() as client:
            answers = Counter(client.get(f"http://127.0.0.1:{port}/who").text for _ in range(10))
        assert answers == {"a": 5, "b": 5}
    finally:
        child.stop()
        for server in servers:
            server.shutdown()
            server.server_close()


def _named_server(name: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 (http.server's name)
            body = name.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.block_on_close = True  # close every connection's socket before shutdown returns
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
