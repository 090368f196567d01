"""Config loading: good files load, bad files fail with the YAML path and the exact reason."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvgate.config import ConfigError, KvgateConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

WORKER = "{name: w0, url: 'http://127.0.0.1:8101'}"
MINIMAL = f"pools: {{default: {{model: m, workers: [{WORKER}]}}}}"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("name", ["local.yaml", "example.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name, env={})
    assert isinstance(config, KvgateConfig)
    assert config.pools["default"].model == "SmolLM2-135M-Instruct"


def test_local_config_launches_two_workers_with_kv_events():
    workers = load_config(CONFIGS / "local.yaml", env={}).launched_workers()
    assert [w.name for w in workers] == ["w0", "w1"]
    assert all(w.kv_events_endpoint and w.launch.model == "default" for w in workers)


def test_minimal_config_gets_every_default_from_one_place(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), env={})
    assert config.gateway.port == 8000
    assert config.upstream.max_retries == 2
    assert config.pools["default"].policy.type == "kv_aware"
    assert config.redis.url is None


def test_env_interpolation_fills_secrets_and_defaults(tmp_path):
    text = MINIMAL + "\nauth: {keys: [{tenant: a, sha256: '${KEY_HASH}'}]}\nredis: {url: '${REDIS_URL:-redis://127.0.0.1:6379/0}'}\n"
    config = load_config(write(tmp_path, text), env={"KEY_HASH": "ab" * 32})
    assert config.auth.keys[0].sha256 == "ab" * 32
    assert config.redis.url == "redis://127.0.0.1:6379/0"


BAD = [
    ("bad-worker-url",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:1'}, {name: b, url: 'ftp://x'}]}}",
     "pools.default.workers[1].url: not an http(s) URL"),
    ("unknown-top-level-key",
     MINIMAL + "\ngatway: {port: 1}",
     "gatway: unknown key (expected one of: pools, gateway, limits, upstream, auth, redis, routing, health, breaker, outliers)"),
    ("unknown-nested-key",
     f"pools: {{default: {{model: m, workers: [{{name: w0, url: 'http://127.0.0.1:1', lauch: {{}}}}]}}}}",
     "pools.default.workers[0].lauch: unknown key (expected one of: name, url, kv_events_endpoint, block_size, num_blocks, launch)"),
    ("port-not-an-integer",
     MINIMAL + "\ngateway: {port: eighty}",
     "gateway.port: expected an integer, got a string 'eighty'"),
    ("port-out-of-range",
     MINIMAL + "\ngateway: {port: 70000}",
     "gateway.port: must be in 0..65535"),
    ("missing-pools",
     "gateway: {port: 8000}",
     "pools: required"),
    ("empty-pools",
     "pools: {}",
     "pools: at least one pool is required"),
    ("missing-model",
     f"pools: {{default: {{workers: [{WORKER}]}}}}",
     "pools.default.model: required"),
    ("no-workers",
     "pools: {default: {model: m, workers: []}}",
     "pools.default.workers: at least one worker is required"),
    ("workers-not-a-list",
     "pools: {default: {model: m, workers: {name: a}}}",
     "pools.default.workers: expected a list, got a mapping"),
    ("duplicate-worker-name",
     f"pools: {{default: {{model: m, workers: [{WORKER}, {WORKER}]}}}}",
     "pools.default.workers[1].name: worker name 'w0' also used at pools.default.workers[0]"),
    ("bad-executor",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:9', launch: {executor: gpu}}]}}",
     "pools.default.workers[0].launch.executor: must be one of: torch, sim (got 'gpu')"),
    ("negative-block-size",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:9', launch: {block_size: 0}}]}}",
     "pools.default.workers[0].launch.block_size: must be > 0"),
    ("launch-remote-worker",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://10.1.2.3:9', launch: {}}]}}",
     "pools.default.workers[0].launch: only workers at http://127.0.0.1:PORT can be launched"),
    ("bad-kv-endpoint",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:9', kv_events_endpoint: 'localhost:5557'}]}}",
     "pools.default.workers[0].kv_events_endpoint: not a ZMQ endpoint like tcp://HOST:PORT"),
    ("short-key-hash",
     MINIMAL + "\nauth: {keys: [{tenant: a, sha256: abc}]}",
     "auth.keys[0].sha256: must be 64 lowercase hex characters"),
    ("retry-ratio-zero",
     MINIMAL + "\nupstream: {retry_budget_ratio: 0}",
     "upstream.retry_budget_ratio: must be in (0, 1]"),
    ("bool-is-not-a-number",
     MINIMAL + "\nupstream: {connect_timeout_s: true}",
     "upstream.connect_timeout_s: expected a number, got a boolean True"),
    ("missing-env-var",
     MINIMAL + "\nredis: {url: '${NO_SUCH_VAR}'}",
     "redis.url: environment variable NO_SUCH_VAR is not set"),
    ("port-clash",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:8000', launch: {}}]}}",
     "pools.default.workers[0].url: port 8000 is already used"),
    ("not-a-mapping",
     "- just\n- a list\n",
     "expected a mapping, got a list"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in BAD], ids=[i for i, _, _ in BAD])
def test_bad_config_names_the_yaml_path(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert str(info.value) == message


def test_invalid_yaml_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(write(tmp_path, "pools: [unclosed"), env={})
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml: No such file or directory"):
        load_config(tmp_path / "nope.yaml", env={})


def test_loaded_config_is_frozen(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), env={})
    with pytest.raises(AttributeError):
        config.gateway.port = 1
