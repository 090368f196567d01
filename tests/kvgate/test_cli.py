"""The `kvgate` command as a user runs it: help for each subcommand, key creation, bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.keys import hash_key
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # every test runs `python -m kvgate` as a child process


def kvgate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgate", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_top_level_help_lists_every_subcommand():
    result = kvgate("--help")
    assert result.returncode == 0
    for command in ("up", "gateway", "worker", "register", "keys", "bench"):
        assert f"    {command} " in result.stdout


@pytest.mark.parametrize(
    ("argv", "expected_flags"),
    [
        (("up",), ["--config", "--port"]),
        (("gateway",), ["--config", "--host", "--port"]),
        (("worker",), ["--model", "--port", "--executor", "--block-size", "--num-blocks", "--max-num-seqs",
                       "--kv-events-endpoint", "--served-model-name"]),
        (("register",), ["--redis", "--pool", "--name", "--url", "--kv-events-endpoint", "--model",
                         "--registry-ttl", "--heartbeat-interval"]),
        (("keys",), ["create"]),
        (("keys", "create"), ["--tenant", "--redis"]),
        (("bench",), ["run ", "fleet ", "report "]),
        (("bench", "run"), ["--url", "--model", "--workload", "--out"]),
    ],
    ids=["up", "gateway", "worker", "register", "keys", "keys-create", "bench", "bench-run"],
)
def test_each_subcommand_has_help(argv, expected_flags):
    result = kvgate(*argv, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: kvgate {' '.join(argv)}")
    for flag in expected_flags:
        assert flag in result.stdout


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_lists_its_subcommands_with_a_line_each(flag):
    result = kvgate("bench", flag)
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert {"run", "fleet", "report"} <= listed
    assert "    run       one workload against an OpenAI-compatible URL" in result.stdout


def test_help_does_not_import_torch():
    code = "import sys; from kvgate.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_keys_create_prints_a_key_once_with_the_hash_for_the_config():
    result = kvgate("keys", "create", "--tenant", "team-a")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    key = lines[1].strip()
    assert key.startswith("kvg-") and len(key) > 40
    assert f"    sha256: {hash_key(key)}" in lines
    assert "  - tenant: team-a" in lines


def test_keys_create_stores_only_the_hash_in_redis():
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url("redis://127.0.0.1:6379/15")
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail("Redis must listen on 127.0.0.1:6379 for the test suite")
    client.delete("kvgate:api_keys")
    result = kvgate("keys", "create", "--tenant", "team-b", "--redis", "redis://127.0.0.1:6379/15")
    assert result.returncode == 0, result.stderr
    key = result.stdout.splitlines()[1].strip()
    assert client.hgetall("kvgate:api_keys") == {hash_key(key).encode(): b"team-b"}
    client.delete("kvgate:api_keys")
    client.close()


def test_keys_revoke_removes_a_redis_key_by_key_or_digest():
    redis = pytest.importorskip("redis")
    url = "redis://127.0.0.1:6379/14"
    client = redis.Redis.from_url(url)
    client.delete("kvgate:api_keys")
    keys = [kvgate("keys", "create", "--tenant", "team-c", "--redis", url).stdout.splitlines()[1].strip()
            for _ in range(2)]
    by_key = kvgate("keys", "revoke", "--key", keys[0], "--redis", url)
    assert by_key.returncode == 0, by_key.stderr
    assert by_key.stdout.startswith(f"revoked the key of tenant team-c (sha256 {hash_key(keys[0])})")
    assert kvgate("keys", "revoke", "--sha256", hash_key(keys[1]).upper(), "--redis", url).returncode == 0
    assert client.hgetall("kvgate:api_keys") == {}
    again = kvgate("keys", "revoke", "--key", keys[0], "--redis", url)
    assert (again.returncode, again.stderr) == (1, f"kvgate keys: no key with sha256 {hash_key(keys[0])} in {url}\n")
    client.close()


@pytest.mark.parametrize(
    ("redis_url", "message"),
    [
        ("redis://127.0.0.1:{port}/9",
         "kvgate keys: cannot reach Redis at redis://127.0.0.1:{port}/9: Connection refused"),
        ("redis://:s3cret@127.0.0.1:{port}/9",
         "kvgate keys: cannot reach Redis at redis://:***@127.0.0.1:{port}/9: Connection refused"),
        ("http://foo", "kvgate keys: --redis http://foo: not a Redis URL (redis://, rediss:// or unix://)"),
    ],
    ids=["nothing-listening", "password-hidden", "not-redis"],
)
def test_keys_create_with_a_bad_redis_says_why_in_one_line(redis_url, message):
    port = free_port()
    result = kvgate("keys", "create", "--tenant", "team-a", "--redis", redis_url.format(port=port))
    assert result.returncode == 2
    assert result.stderr == message.format(port=port) + "\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ("", "kvgate keys: --tenant must not be empty"),
        ("   ", "kvgate keys: --tenant must not be empty"),
        ("team a", "kvgate keys: --tenant 'team a': must be letters, digits, '.', '_' or '-'"),
    ],
    ids=["empty", "whitespace", "space-inside"],
)
def test_keys_create_refuses_a_tenant_the_config_would_not_load(tenant, message):
    result = kvgate("keys", "create", "--tenant", tenant)
    assert result.returncode == 2
    assert result.stderr == message + "\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("worker", "--model", "default", "--port", "http"), "argument --port: expected a port number, got 'http'"),
        (("worker", "--model", "default", "--port", "1", "--block-size", "0"),
         "argument --block-size: expected a positive integer, got '0'"),
        (("worker", "--model", "default", "--port", "1", "--executor", "gpu"), "argument --executor: invalid choice"),
        (("up",), "the following arguments are required: --config"),
        (("worker", "--model", "default", "--port", "1", "--register", "redis://127.0.0.1:1/0"),
         "kvgate: --register needs --pool (the gateway pool to join)"),
        (("worker", "--model", "default", "--port", "1", "--pool", "p"),
         "kvgate: --pool needs --register (the Redis to register in)"),
        (("register", "--redis", "http://x", "--pool", "p", "--name", "n", "--url", "http://127.0.0.1:1"),
         "the registry must be a redis://, rediss:// or unix:// URL"),
        (("register", "--redis", "redis://x", "--pool", "p", "--name", "n/1", "--url", "http://127.0.0.1:1"),
         "kvgate: worker name 'n/1': must be letters, digits, '.', '_' or '-'"),
        (("register", "--redis", "redis://x", "--pool", "p", "--name", "n", "--url", "127.0.0.1:1"),
         "kvgate: --url '127.0.0.1:1': not an http(s) URL"),
        (("register", "--redis", "redis://x", "--pool", "p", "--name", "n", "--url", "http://h:1",
          "--registry-ttl", "1", "--heartbeat-interval", "2"), "must be positive and below the TTL"),
    ],
    ids=["bad-port", "zero-block-size", "bad-executor", "missing-config", "register-without-pool",
         "pool-without-register", "register-not-redis", "register-bad-name", "register-bad-url",
         "register-interval-over-ttl"],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv, message):
    result = kvgate(*argv)
    assert result.returncode == 2
    assert message in result.stderr


def test_up_with_a_bad_config_names_file_and_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("pools: {default: {model: m, workers: [{name: a, url: 'ftp://x'}]}}\n")
    result = kvgate("up", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvgate: {path}: pools.default.workers[0].url: not an http(s) URL"


@pytest.mark.parametrize(("keys", "shown"), [((), "Bearer kvg-dev-x"), (("real",), "Bearer <one of auth.keys>")],
                         ids=["dev-key", "keys-configured"])
def test_up_prints_the_dev_key_only_where_the_gateway_accepts_it(keys, shown):
    import io

    from kvgate.config import KvgateConfig, build
    from kvgate.stack import print_banner

    config = build(KvgateConfig, {"pools": {"default": {"model": "m", "workers": [{"name": "w", "url": "http://w"}]}},
                                  "auth": {"keys": [{"tenant": "team", "sha256": hash_key(k)} for k in keys]}})
    auth = config.auth
    out = io.StringIO()
    print_banner(out, config, 8000, "kvg-dev-x" if auth.dev_key_enabled else None)
    assert shown in out.getvalue()
    assert ("kvg-dev-x" in out.getvalue()) == (not keys)


def test_up_names_and_probes_an_https_gateway_as_https():
    import io

    from kvgate.config import KvgateConfig, build
    from kvgate.stack import print_banner, stack_specs

    config = build(KvgateConfig, {"pools": {"default": {"model": "m", "workers": [{"name": "w", "url": "http://w"}]}},
                                  "gateway": {"tls_certfile": "/etc/kvgate/tls.pem"}})
    out = io.StringIO()
    print_banner(out, config, 8443, "kvg-dev-x")
    assert "OpenAI base URL: https://127.0.0.1:8443/v1" in out.getvalue()
    (gateway,) = stack_specs(config, Path("kvgate.yaml"), 8443, "kvg-dev-x")
    assert gateway.health_url == "https://127.0.0.1:8443/ready"
