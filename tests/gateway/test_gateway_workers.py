"""`kvgate gateway --workers N` as a real parent process: N gateways on one port, each serving and
reloading, metrics of all at /metrics, a clean stop, a killed process replaced, and failures that stop
at once with a message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.multiprocess import PAGE_END, merge_pages, process_config
from kvgate.config import KvgateConfig, build
from tests.conftest import free_port
from tests.gateway.conftest import API_KEY, MODEL, gateway_config, worker_entry
from tests.processes import Process, fake_worker_process, running

AUTH = {"Authorization": f"Bearer {API_KEY}"}
UNREACHABLE_WORKER = "http://127.0.0.1:1"  # for gateways that stop before they call a worker
RULES = "rules:\n  - {{name: default, pool: default, policy: {{type: {policy}}}}}\n"


@pytest.fixture(scope="module")
def worker() -> Iterator[Process]:
    with running(fake_worker_process("answer")) as process:
        yield process


def write_config(tmp_path: Path, config: dict, port: int | None = None) -> Path:
    port = port or free_port()
    path = tmp_path / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump({**config, "gateway": {"host": "127.0.0.1", "port": port}}))
    return path


def kvgate_gateway(config_path: Path, workers: int = 2) -> list[str]:
    return [sys.executable, "-m", "kvgate", "gateway", "--config", str(config_path), "--workers", str(workers)]


class Gateways:
    """A `kvgate gateway --workers N` parent, its output in a log file."""

    def __init__(self, config_path: Path, workers: int = 2) -> None:
        self.config_path = config_path
        self.url = f"http://127.0.0.1:{yaml.safe_load(config_path.read_text())['gateway']['port']}"
        self.process = Process(kvgate_gateway(config_path, workers), self.url, env={**os.environ,
                                                                                     "KVGATE_API_KEY": API_KEY})
        self.parent = self.process.proc

    def wait_listening(self, timeout_s: float = 60.0) -> None:
        """The parent says it listens once every process serves."""
        deadline = time.monotonic() + timeout_s
        while "kvgate: gateway listening on" not in self.process.output():
            assert self.parent.poll() is None, f"exited {self.parent.returncode}:\n{self.process.output()}"
            assert time.monotonic() < deadline, f"not listening after {timeout_s} s:\n{self.process.output()}"
            time.sleep(0.05)

    def children(self) -> dict[int, int]:
        """process index -> pid of the parent's live processes."""
        found = {}
        for pid in running_pids(str(self.config_path)):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--process-index" in argv:
                found[int(argv[argv.index(b"--process-index") + 1])] = pid
        return found

    def output(self) -> str:
        return self.process.output()


def running_pids(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains marker."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def gateways(worker, redis_server, tmp_path) -> Iterator[Gateways]:
    """Two gateway processes on one port, sharing a Redis, in front of a fake worker."""
    config = gateway_config([worker_entry("w", worker.url)], None, redis={"url": redis_server.url})
    with ExitStack() as stack:
        started = Gateways(write_config(tmp_path, config))
        stack.callback(started.process.stop)
        started.wait_listening()
        yield started


def complete(url: str) -> httpx.Response:
    """One completion on a connection of its own (the kernel picks a process per connection)."""
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=10,
                      json={"model": MODEL, "prompt": "p", "max_tokens": 1})


def per_process(url: str, sample: str, **labels: str) -> dict[str, float]:
    """gateway_process -> the sum of the sample's series with these labels, from the shared port's /metrics."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                process = s.labels["gateway_process"]
                totals[process] = totals.get(process, 0.0) + s.value
    return totals


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow
def test_two_processes_answer_on_one_port_and_metrics_show_both(gateways):
    statuses = [complete(gateways.url).status_code for _ in range(30)]
    assert statuses == [200] * 30
    served = per_process(gateways.url, "kvgate_requests_total", status="200")
    assert set(served) == {"0", "1"} and all(count > 0 for count in served.values()), served
    assert sum(served.values()) == 30
    assert per_process(gateways.url, "kvgate_gateway_process_up") == {"0": 1.0, "1": 1.0}
    pids = gateways.children()
    assert len(pids) == 2
    for pid in pids.values():  # each process's log lines name it
        assert f"gateway[{pid}] INFO gateway process" in gateways.output()


@pytest.mark.slow
def test_sighup_reloads_the_policy_file_in_every_process(worker, redis_server, tmp_path):
    policies = tmp_path / "policies.yaml"
    policies.write_text(RULES.format(policy="round_robin"))
    config = gateway_config([worker_entry("w", worker.url)], None, redis={"url": redis_server.url},
                            routing={"policies_file": str(policies), "policies_watch_interval_s": 3600})
    gateways = Gateways(write_config(tmp_path, config))
    try:
        gateways.wait_listening()
        policies.write_text(RULES.format(policy="least_load"))
        gateways.parent.send_signal(signal.SIGHUP)
        wait_until(lambda: per_process(gateways.url, "kvgate_policy_reloads_total", outcome="ok") == {"0": 1, "1": 1},
                   10, "not every process reloaded the policy file")
        routes = {complete(gateways.url).headers["x-kvgate-route"].split()[0] for _ in range(10)}
        assert routes == {"policy=least_load"}
    finally:
        gateways.process.stop()


@pytest.mark.slow
def test_sigterm_stops_every_process_and_the_parent_exits_0(gateways):
    pids = gateways.children()
    assert len(pids) == 2
    gateways.parent.send_signal(signal.SIGTERM)
    assert gateways.parent.wait(timeout=15) == 0, gateways.output()
    assert running_pids(str(gateways.config_path)) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateways.url}/health", timeout=2)
    assert "ignored SIGTERM" not in gateways.output(), gateways.output()


@pytest.mark.slow
def test_a_killed_process_is_replaced_while_the_port_keeps_answering(gateways):
    before = gateways.children()
    index, victim = min(before.items())
    os.kill(victim, signal.SIGKILL)
    # connections queued at a process as it dies are reset (see gateway/multiprocess.py): send after its end
    wait_until(lambda: victim not in running_pids(str(gateways.config_path)), 5, "the killed process lingers")
    statuses = []

    def replaced() -> bool:
        statuses.append(complete(gateways.url).status_code)
        now = gateways.children()
        return len(now) == 2 and now[index] != victim and f"gateway-{index} is healthy again" in gateways.output()

    wait_until(replaced, 30, "the killed process was not replaced")
    assert set(statuses) == {200}, statuses  # the other process took every connection meanwhile
    assert f"kvgate: gateway-{index} was killed by signal 9" in gateways.output()
    assert per_process(gateways.url, "kvgate_gateway_process_up") == {"0": 1.0, "1": 1.0}
    wait_until(lambda: complete(gateways.url).status_code == 200
               and per_process(gateways.url, "kvgate_requests_total").get(str(index), 0) > 0,
               10, "the new process served nothing")
    assert gateways.parent.poll() is None


@pytest.mark.slow
def test_a_process_that_cannot_start_stops_the_gateway_at_once_with_its_error(tmp_path):
    broken = tmp_path / "broken-tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")  # there (the parent's check), but no tokenizer
    config = gateway_config([worker_entry("w", UNREACHABLE_WORKER)], broken, redis={"url": "redis://127.0.0.1:1/0"})
    config_path = write_config(tmp_path, config)
    started = time.monotonic()
    result = subprocess.run(kvgate_gateway(config_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert time.monotonic() - started < 30
    assert "exited with code 1; last log lines:" in result.stderr
    assert "RoutingTokenizer.from_dir" in result.stderr and "restarting" not in result.stderr
    assert running_pids(str(config_path)) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("redis_url", "port_taken", "status", "message"),
    [(None, False, 2, "kvgate: --workers 2 needs redis.url in the config"),
     ("redis://127.0.0.1:1/0", True, 3, "kvgate: cannot listen on 127.0.0.1:{port}: Address already in use")],
    ids=["without_redis", "port_taken"],
)
def test_a_gateway_that_cannot_serve_says_why_and_starts_no_process(redis_url, port_taken, status, message, tmp_path):
    config = gateway_config([worker_entry("w", UNREACHABLE_WORKER)], None)
    if redis_url is not None:
        config["redis"] = {"url": redis_url}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] if port_taken else free_port()
        result = subprocess.run(kvgate_gateway(write_config(tmp_path, config, port)), capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == status
    assert result.stderr.startswith(message.format(port=port)), result.stderr
    assert "[gateway-" not in result.stderr  # no process was started


def test_merged_metrics_label_every_series_with_its_process_and_say_whose_page_is_missing():
    page = (b"# HELP kvgate_requests_total Requests.\n# TYPE kvgate_requests_total counter\n"
            b'kvgate_requests_total{tenant="a"} 3.0\n')
    merged = merge_pages({0: page, 1: page.replace(b"3.0", b"4.0"), 2: None})
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}
    requests = {s.labels["gateway_process"]: s.value for s in families["kvgate_requests"].samples}
    assert requests == {"0": 3.0, "1": 4.0}
    assert all(s.labels["tenant"] == "a" for s in families["kvgate_requests"].samples)
    up = {s.labels["gateway_process"]: s.value for s in families["kvgate_gateway_process_up"].samples}
    assert up == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert merged.count(b"# TYPE kvgate_requests_total counter") == 1
    assert PAGE_END.startswith(b"#")  # a comment to the parser, so a page may carry it


def test_each_process_keeps_its_share_of_the_tenant_limits_while_redis_is_down():
    config = build(KvgateConfig, {"pools": {"p": {"model": "m", "workers": [{"name": "w", "url": "http://w:1"}]}},
                                  "redis": {"url": "redis://r:6379/0", "replicas": 3}})
    assert process_config(config, 4).redis.replicas == 12
    assert process_config(config, 4).pools == config.pools
