"""Peer routers a fleet run starts itself (loadtest/external_router.py): placeholders filled, bad commands
refused when given."""

from __future__ import annotations

import pytest

from loadtest.external_router import ExternalCommand, parse_external_command

SGLANG = ("results/sglang-venv/bin/python -m sglang_router.launch_router --worker-urls {worker_urls} "
          "--policy cache_aware --port {port} --prometheus-port {metrics_port}")


def test_the_sglang_router_command_gets_one_word_per_worker_and_the_run_ports():
    command = parse_external_command(f"sglang={SGLANG}")
    assert command.name == "sglang"
    assert command.argv(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], 9300, 9302) == [
        "results/sglang-venv/bin/python", "-m", "sglang_router.launch_router", "--worker-urls",
        "http://127.0.0.1:9000", "http://127.0.0.1:9001", "--policy", "cache_aware", "--port", "9300",
        "--prometheus-port", "9302"]


def test_quoted_words_and_ports_inside_words_are_kept():
    command = ExternalCommand("r", "router --listen=127.0.0.1:{port} --name 'a b' {worker_urls}")
    assert command.argv(["http://w0"], 7000, 7001) == ["router", "--listen=127.0.0.1:7000", "--name", "a b",
                                                        "http://w0"]


@pytest.mark.parametrize(("spec", "message"), [
    ("sglang", "takes NAME=COMMAND"),
    ("=router --port {port} {worker_urls}", "takes NAME=COMMAND"),
    ("r=router --port {port}", "{worker_urls} must be a word of its own"),
    ("r=router --port {port} --urls={worker_urls}", "{worker_urls} must be a word of its own"),
    ("r=router {worker_urls}", "{port} is missing"),
], ids=["no-command", "no-name", "no-workers", "workers-inside-a-word", "no-port"])
def test_a_command_that_cannot_front_the_fleet_is_refused(spec, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        parse_external_command(spec)
