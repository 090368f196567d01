"""A round-robin HTTP balancer in front of gateway replicas, for fleet runs (`--gateway-replicas N`):
nginx from the system packages (peers.NGINX), the way a user would put an L7
balancer before several kvgate processes. It streams (no buffering), keeps upstream connections alive,
and passes the client's headers through; used in benchmarks only."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def nginx_head(run_dir: Path, worker_connections: int) -> str:
    """The start of an nginx.conf for a benchmark's own nginx: one worker process in the foreground,
    its pid, error log and temp files under run_dir, no access log; it ends inside `http {`."""
    temp_paths = "\n".join(f"    {name}_temp_path {run_dir / name};" for name in
                           ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""worker_processes 1;
daemon off;
pid {run_dir / 'nginx.pid'};
error_log {run_dir / 'nginx-error.log'} warn;
events {{ worker_connections {worker_connections}; }}
http {{
    access_log off;
{temp_paths}
"""


def balancer_conf(port: int, upstream_ports: Sequence[int], run_dir: Path) -> str:
    """nginx.conf: requests round-robin over the ports (see nginx_head for the rest)."""
    if not upstream_ports:
        raise ValueError("a balancer needs at least one upstream")
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstream_ports)
    return nginx_head(run_dir, 4096) + f"""    upstream gateways {{
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 64m;
        location / {{
            proxy_pass http://gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def balancer_argv(conf: Path, run_dir: Path) -> list[str]:
    """nginx on conf, run_dir its prefix (both made absolute: nginx reads -c relative to -p)."""
    return ["nginx", "-c", str(conf.resolve()), "-p", str(run_dir.resolve())]
