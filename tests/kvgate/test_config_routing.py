"""The config's routing hardening: the debug header off unless asked for, per-tenant cache isolation,
and each pool's prompt limit, as the gateway hands them to the router (gateway/routing_config.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.routing_config import prompt_token_limits, tenant_cache_salts
from kvgate.config import ConfigError, load_config

WORKER = "{name: w0, url: 'http://127.0.0.1:8101'}"


def load(tmp_path: Path, text: str):
    path = tmp_path / "kvgate.yaml"
    path.write_text(textwrap.dedent(text))
    return load_config(path, env={})


def pool_with(*workers: str, extra: str = "") -> str:
    return f"pools: {{default: {{model: m, workers: [{', '.join(workers)}]{extra}}}}}\n"


def launched(name: str, port: int, launch: str) -> str:
    return f"{{name: {name}, url: 'http://127.0.0.1:{port}', launch: {{{launch}}}}}"


def test_the_route_debug_header_is_off_by_default(tmp_path) -> None:
    routing = load(tmp_path, pool_with(WORKER)).routing
    assert routing.debug_header is False
    assert not routing.debug_header_for("dev") and not routing.debug_header_for(None)


def test_the_route_debug_header_goes_to_the_tenants_listed_or_to_all_when_on(tmp_path) -> None:
    text = pool_with(WORKER) + "tenants: {ops: {}, acme: {}}\nrouting: {debug_header_tenants: [ops]}\n"
    routing = load(tmp_path, text).routing
    assert routing.debug_header_for("ops") and not routing.debug_header_for("acme")
    everyone = load(tmp_path, pool_with(WORKER) + "routing: {debug_header: true}\n").routing
    assert everyone.debug_header_for("acme") and everyone.debug_header_for(None)


@pytest.mark.parametrize(("text", "message"), [
    (pool_with(WORKER) + "tenants: {ops: {}}\nrouting: {debug_header_tenants: [opz]}\n",
     "routing.debug_header_tenants[0]: unknown tenant 'opz' (tenants: dev, ops)"),
    (pool_with(WORKER) + "routing: {debug_header_tenants: ['a b']}\n",
     "routing.debug_header_tenants[0]: must be letters, digits, '.', '_' or '-'"),
    (pool_with(WORKER) + "tenants: {acme: {cache_isolation: [x]}}\n",
     "tenants.acme.cache_isolation: expected a boolean or a string, got a list"),
    (pool_with(WORKER) + "tenants: {acme: {cache_isolation: ''}}\n",
     "tenants.acme.cache_isolation: must be true, false or a non-empty salt string"),
    (pool_with(WORKER, extra=", max_model_len: 0"), "pools.default.max_model_len: must be > 0"),
], ids=["unknown-debug-tenant", "bad-debug-tenant-name", "isolation-not-bool-or-string", "empty-salt",
        "max-model-len-zero"])
def test_bad_routing_hardening_settings_name_the_yaml_path(tmp_path, text, message) -> None:
    with pytest.raises(ConfigError) as error:
        load(tmp_path, text)
    assert str(error.value) == message


def test_cache_isolation_salts_isolated_tenants_only(tmp_path) -> None:
    text = pool_with(WORKER) + textwrap.dedent("""\
        tenants:
          acme: {cache_isolation: true}
          initech-a: {cache_isolation: initech}
          initech-b: {cache_isolation: initech}
          shared: {cache_isolation: false}
          plain: {}
        """)
    config = load(tmp_path, text)
    assert tenant_cache_salts(config) == {"acme": "acme", "initech-a": "initech", "initech-b": "initech"}


@pytest.mark.parametrize(("pool", "limit"), [
    (pool_with(WORKER), None),
    (pool_with(WORKER, extra=", max_model_len: 4096"), 4096),
    (pool_with(launched("a", 8101, "num_blocks: 64, block_size: 16")), 1024),
    (pool_with(launched("a", 8101, "extra_args: ['--max-model-len', '512']")), 512),
    (pool_with(launched("a", 8101, "num_blocks: 64, extra_args: ['--max-model-len=4096']")), 1024),
    (pool_with(launched("a", 8101, "num_blocks: 64"), launched("b", 8102, "num_blocks: 128")), 2048),
    (pool_with(launched("a", 8101, "num_blocks: 64"), WORKER.replace("8101", "8102")), None),
    (pool_with(launched("a", 8101, "num_blocks: 64"), extra=", max_model_len: 100"), 100),
], ids=["unknown", "configured", "launch-blocks", "launch-flag", "launch-smaller-of-both", "largest-worker",
        "a-remote-worker-unknown", "configured-wins"])
def test_a_pools_prompt_limit_comes_from_config_or_its_launched_workers(tmp_path, pool, limit) -> None:
    config = load(tmp_path, pool)
    assert config.pools["default"].prompt_token_limit() == limit
    assert prompt_token_limits(config) == ({} if limit is None else {"default": limit})
