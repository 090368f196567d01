"""Peers in one place (loadtest/peers/__init__.py): where each is installed, and what a benchmark says of
the ones that are missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.paths import RESULTS_DIR
from loadtest.peers import LITELLM, SGLANG_ROUTER, SystemTool, VLLM, VenvPeer, missing, require

PRESENT = SystemTool("sh", ("dash",))
ABSENT = SystemTool("no-such-tool-kvgate", ("no-such-package",))
ABSENT_FILE = SystemTool("a module file", ("libmod",), file=Path("/nonexistent/mod.so"))
ABSENT_VENV = VenvPeer("a router", "no-such-venv-kvgate", ("router-pkg>=1",), "router-pkg")


def test_python_peers_live_each_in_a_venv_of_its_own_under_results():
    for peer in (SGLANG_ROUTER, LITELLM, VLLM):
        assert peer.venv.parent == RESULTS_DIR and peer.python == peer.venv / "bin" / "python"
    assert SGLANG_ROUTER.install == ("python3 -m venv results/sglang-venv && "
                                     "results/sglang-venv/bin/pip install sglang-router")


def test_only_missing_peers_are_named_each_with_the_command_that_installs_it():
    assert missing(PRESENT) == []
    assert missing(PRESENT, ABSENT, ABSENT_FILE, ABSENT_VENV) == [
        "no-such-tool-kvgate (install: apt-get update && apt-get install -y no-such-package)",
        "a module file (install: apt-get update && apt-get install -y libmod)",
        "a router (install: python3 -m venv results/no-such-venv-kvgate && "
        "results/no-such-venv-kvgate/bin/pip install router-pkg>=1)",
    ]
    assert ABSENT_VENV.version() is None


def test_require_exits_before_anything_starts_listing_every_missing_peer():
    require(PRESENT)
    with pytest.raises(SystemExit) as exited:
        require(ABSENT, PRESENT, ABSENT_VENV)
    message = str(exited.value.code)
    assert message.startswith("missing:\n  no-such-tool-kvgate (install: ")
    assert "\n  a router (install: " in message and "sh (" not in message
