"""What `kvgate up` tells the workers it starts from the config's tracing: and logging: sections
(kvgate/stack.py), and that `kvgate worker` takes those flags as the settings they name (worker/cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import build_parser
from kvgate.config import KvgateConfig
from kvgate.config.loader import build
from kvgate.stack import stack_specs
from kvgate.tracing import TracingSettings
from tests.conftest import free_port
from worker.cli import _tracing_settings

OTEL_VARIABLES = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
                  "OTEL_SERVICE_NAME")


def launched_worker_argv(**sections) -> tuple[str, ...]:
    """The argv `kvgate up` starts the one launched worker of a config with these extra sections."""
    worker = {"name": "w0", "url": "http://127.0.0.1:8101", "kv_events_endpoint": "tcp://127.0.0.1:5701",
              "launch": {"model": "default", "executor": "sim"}}
    config = build(KvgateConfig, {"pools": {"default": {"model": "m", "workers": [worker]}}, **sections})
    (spec, gateway) = stack_specs(config, Path("kvgate.yaml"), 8000, "key")
    assert gateway.name == "gateway"
    return spec.argv


def observability_flags(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The --tracing-* flags with their values and the request-log switches, in order."""
    flags: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--tracing-"):
            flags += [arg, argv[i + 1]]
        elif arg in ("--no-request-log", "--log-prompt-token-ids"):
            flags.append(arg)
    return tuple(flags)


@pytest.mark.parametrize(("sections", "expected"), [
    ({}, ()),
    ({"tracing": {"exporter": "otlp", "endpoint": "http://collector:4318", "sample_ratio": 0.25}},
     ("--tracing-exporter", "otlp", "--tracing-endpoint", "http://collector:4318", "--tracing-sample-ratio", "0.25")),
    ({"tracing": {"exporter": "console"}}, ("--tracing-exporter", "console")),
    ({"tracing": {"sample_ratio": 0.5}}, ("--tracing-sample-ratio", "0.5")),
    ({"logging": {"requests": False}}, ("--no-request-log",)),
    ({"logging": {"prompt_token_ids": True}}, ("--log-prompt-token-ids",)),
    ({"logging": {"requests": True, "prompt_token_ids": False}}, ()),
], ids=["defaults", "tracing-all", "tracing-exporter-only", "tracing-ratio-only", "request-log-off",
        "prompt-token-ids", "logging-defaults"])
def test_up_passes_only_the_tracing_and_logging_settings_the_config_sets(sections, expected):
    assert observability_flags(launched_worker_argv(**sections)) == expected


def test_the_worker_takes_the_flags_up_passes_as_its_settings(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    argv = launched_worker_argv(tracing={"exporter": "otlp", "endpoint": "http://collector:4318", "sample_ratio": 0.25},
                                logging={"requests": False, "prompt_token_ids": True})

    args = build_parser().parse_args(argv[argv.index("worker"):])

    assert _tracing_settings(args) == TracingSettings("otlp", "http://collector:4318/v1/traces", 0.25, "kvgate-worker")
    assert args.no_request_log is True and args.log_prompt_token_ids is True


def test_tracing_flags_left_out_fall_back_to_the_otel_variables(monkeypatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env-collector:4318")
    argv = launched_worker_argv(tracing={"sample_ratio": 0.5})

    settings = _tracing_settings(build_parser().parse_args(argv[argv.index("worker"):]))

    assert settings == TracingSettings("otlp", "http://env-collector:4318/v1/traces", 0.5, "kvgate-worker")


@pytest.mark.slow  # starts `kvgate worker` as a process
def test_a_tracing_setting_the_worker_cannot_use_stops_it_at_once_with_one_line():
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_TRACES_EXPORTER": "jaeger"}
    result = subprocess.run([sys.executable, "-m", "kvgate", "worker", "--model", "default", "--port", str(free_port())],
                            capture_output=True, text=True, env=env, timeout=60)

    assert result.returncode == 2
    assert result.stderr == "kvgate worker: OTEL_TRACES_EXPORTER='jaeger': expected one of none, console, otlp\n"
