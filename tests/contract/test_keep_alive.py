"""Gateway <-> worker connections: the gateway drops an idle pooled connection before the worker
closes it, so a request never races the worker's close (the gateway still retries one that does)."""

from gateway.upstream_http import KEEPALIVE_EXPIRY_S
from worker.cli import DEFAULT_TIMEOUT_KEEP_ALIVE_S


def test_the_gateway_expires_idle_connections_before_the_worker_closes_them():
    assert KEEPALIVE_EXPIRY_S < DEFAULT_TIMEOUT_KEEP_ALIVE_S
