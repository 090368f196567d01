"""Config loading: good files load, bad files fail with the YAML path and the exact reason."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvgate.cli import main
from kvgate.config import ConfigError, KvgateConfig, WorkerConfig, load_config

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
     "gatway: unknown key (expected one of: pools, tenants, gateway, limits, upstream, auth, redis, routing, health, breaker, outliers, tracing, logging)"),
    ("unknown-nested-key",
     f"pools: {{default: {{model: m, workers: [{{name: w0, url: 'http://127.0.0.1:1', lauch: {{}}}}]}}}}",
     "pools.default.workers[0].lauch: unknown key (expected one of: name, url, kv_events_endpoint, block_size, num_blocks, launch)"),
    ("port-not-an-integer",
     MINIMAL + "\ngateway: {port: eighty}",
     "gateway.port: expected an integer, got a string 'eighty'"),
    ("port-out-of-range",
     MINIMAL + "\ngateway: {port: 70000}",
     "gateway.port: must be in 0..65535"),
    ("cors-origin-with-a-path",
     MINIMAL + "\ngateway: {cors_allowed_origins: ['https://app.example.com', 'https://app.example.com/chat']}",
     "gateway.cors_allowed_origins[1]: 'https://app.example.com/chat' is not an origin like "
     "https://app.example.com[:port], or \"*\""),
    ("cors-origin-without-a-scheme",
     MINIMAL + "\ngateway: {cors_allowed_origins: ['app.example.com']}",
     "gateway.cors_allowed_origins[0]: 'app.example.com' is not an origin like "
     "https://app.example.com[:port], or \"*\""),
    ("tls-key-without-a-certificate",
     MINIMAL + "\ngateway: {tls_keyfile: /etc/kvgate/key.pem}",
     "gateway.tls_keyfile: needs tls_certfile (the certificate chain it is the key of)"),
    ("shutdown-grace-negative",
     MINIMAL + "\ngateway: {shutdown_grace_s: -1}",
     "gateway.shutdown_grace_s: must be in 0..3600"),
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
     "pools.default.workers: at least one worker is required (or set redis.url, for a pool whose workers "
     "register themselves)"),
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
     "pools.default.workers[0].url: port 8000 is already used by gateway.port"),
    ("empty-model",
     f"pools: {{default: {{model: '', workers: [{WORKER}]}}}}",
     "pools.default.model: must be a non-empty string"),
    ("kv-endpoint-port-not-a-number",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:9', kv_events_endpoint: 'tcp://h:*'}]}}",
     "pools.default.workers[0].kv_events_endpoint: not a ZMQ endpoint like tcp://HOST:PORT"),
    ("kv-endpoint-without-a-replay-port",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://h:9', kv_events_endpoint: 'tcp://h:65535'}]}}",
     "pools.default.workers[0].kv_events_endpoint: port 65535 leaves no port for the replay socket (PORT + 1)"),
    ("launched-kv-endpoint-over-ipc",
     "pools: {default: {model: m, workers: [{name: a, url: 'http://127.0.0.1:9', launch: {},"
     " kv_events_endpoint: 'ipc:///tmp/kv.sock'}]}}",
     "pools.default.workers[0].kv_events_endpoint: a launched worker needs tcp://HOST:PORT "
     "(it binds its replay socket on PORT + 1)"),
    ("not-a-mapping",
     "- just\n- a list\n",
     "expected a mapping, got a list"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in BAD], ids=[i for i, _, _ in BAD])
def test_bad_config_names_the_yaml_path(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert str(info.value) == message


def launched(name: str, port: int, kv_events_endpoint: str | None = None) -> str:
    kv = f", kv_events_endpoint: '{kv_events_endpoint}'" if kv_events_endpoint else ""
    return f"{{name: {name}, url: 'http://127.0.0.1:{port}', launch: {{executor: sim}}{kv}}}"


def pools_of(*workers: str) -> str:
    return f"pools: {{default: {{model: m, workers: [{', '.join(workers)}]}}}}"


W0 = "pools.default.workers[0]"
W1 = "pools.default.workers[1]"

PORT_CLASHES = [
    ("kv-port-on-another-workers-replay-port",
     pools_of(launched("w0", 8711, "tcp://127.0.0.1:8721"), launched("w1", 8712, "tcp://127.0.0.1:8722")),
     f"{W1}.kv_events_endpoint: port 8722 is already used by {W0}.kv_events_endpoint (replay socket, PORT + 1)"),
    ("replay-port-on-another-workers-kv-port",
     pools_of(launched("w0", 8711, "tcp://127.0.0.1:8722"), launched("w1", 8712, "tcp://127.0.0.1:8721")),
     f"{W1}.kv_events_endpoint: port 8722 (replay socket, PORT + 1) is already used by {W0}.kv_events_endpoint"),
    ("same-kv-port-under-other-local-host-names",
     pools_of(launched("w0", 8711, "tcp://0.0.0.0:8721"), launched("w1", 8712, "tcp://localhost:8721")),
     f"{W1}.kv_events_endpoint: port 8721 is already used by {W0}.kv_events_endpoint"),
    ("kv-port-on-another-workers-http-port",
     pools_of(launched("w0", 8721), launched("w1", 8712, "tcp://127.0.0.1:8721")),
     f"{W1}.kv_events_endpoint: port 8721 is already used by {W0}.url"),
    ("http-port-on-an-earlier-workers-replay-port",
     pools_of(launched("w0", 8711, "tcp://127.0.0.1:8721"), launched("w1", 8722)),
     f"{W1}.url: port 8722 is already used by {W0}.kv_events_endpoint (replay socket, PORT + 1)"),
    ("replay-port-on-its-own-http-port",
     pools_of(launched("w0", 8722, "tcp://127.0.0.1:8721")),
     f"{W0}.kv_events_endpoint: port 8722 (replay socket, PORT + 1) is already used by {W0}.url"),
    ("kv-port-on-the-gateway-port",
     pools_of(launched("w0", 8711, "tcp://127.0.0.1:8000")),
     f"{W0}.kv_events_endpoint: port 8000 is already used by gateway.port"),
    ("replay-port-on-the-gateway-port",
     pools_of(launched("w0", 8711, "tcp://127.0.0.1:7999")),
     f"{W0}.kv_events_endpoint: port 8000 (replay socket, PORT + 1) is already used by gateway.port"),
    ("http-port-on-another-workers-http-port",
     pools_of(launched("w0", 8711), launched("w1", 8711)),
     f"{W1}.url: port 8711 is already used by {W0}.url"),
    ("across-pools",
     f"pools: {{default: {{model: m, workers: [{launched('w0', 8711, 'tcp://127.0.0.1:8721')}]}},"
     f" other: {{model: n, workers: [{launched('w1', 8712, 'tcp://127.0.0.1:8722')}]}}}}",
     "pools.other.workers[0].kv_events_endpoint: port 8722 is already used by "
     f"{W0}.kv_events_endpoint (replay socket, PORT + 1)"),
]


@pytest.mark.parametrize(("text", "message"), [(t, m) for _, t, m in PORT_CLASHES], ids=[i for i, _, _ in PORT_CLASHES])
def test_launched_sockets_on_one_port_are_rejected_naming_both_users(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert str(info.value) == message


@pytest.mark.parametrize(
    "text",
    [
        pools_of(launched("w0", 8711, "tcp://127.0.0.1:8721"), launched("w1", 8712, "tcp://127.0.0.1:8723")),
        pools_of(launched("w0", 8711, "tcp://127.0.0.1:8721"),
                 "{name: remote, url: 'http://127.0.0.1:8722', kv_events_endpoint: 'tcp://127.0.0.1:8721'}"),
    ],
    ids=["adjacent-pairs", "not-launched-workers-are-not-counted"],
)
def test_sockets_on_distinct_ports_load(tmp_path, text):
    load_config(write(tmp_path, text), env={})


def test_replay_port_is_the_one_the_worker_binds_and_the_gateway_subscribes_to():
    from kvgate.kv_endpoints import replay_endpoint
    from worker.kv_publisher import default_replay_endpoint

    endpoint = "tcp://127.0.0.1:8721"
    worker = WorkerConfig(name="w0", url="http://127.0.0.1:8711", kv_events_endpoint=endpoint)
    replay_port = next(port for port, _, note in worker.bound_ports() if note)
    assert f"tcp://127.0.0.1:{replay_port}" == default_replay_endpoint(endpoint) == replay_endpoint(endpoint)


def test_invalid_yaml_is_one_line_with_its_position_and_no_file_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "pools: [unclosed"), env={})
    assert str(info.value) == "not valid YAML at line 1, column 17: expected ',' or ']', but got '<stream end>'"


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml", env={})
    assert str(info.value) == "cannot read the file: No such file or directory"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pools: [unclosed", "not valid YAML at line 1, column 17: expected ',' or ']', but got '<stream end>'"),
        (f"pools: {{default: {{model: m, workers: [{WORKER}], policy: {{type: least_load, parameters: {{slack: 1}}}}}}}}",
         "pools.default.policy.parameters.slack: unknown parameter"),
    ],
    ids=["invalid-yaml", "unknown-policy-parameter"],
)
def test_cli_prints_file_then_yaml_path_then_problem(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    assert main(["gateway", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"kvgate: {path}: {message}\n"


def test_loaded_config_is_frozen(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), env={})
    with pytest.raises(AttributeError):
        config.gateway.port = 1


def test_a_pool_without_configured_workers_loads_with_redis_for_workers_that_register(tmp_path):
    config = load_config(write(tmp_path, "pools: {default: {model: m, workers: []}}\nredis: {url: 'redis://r:6379/0'}"))
    assert config.pools["default"].workers == () and config.pools["default"].prompt_token_limit() is None
    assert config.redis.registry_poll_interval_s == 0.5
