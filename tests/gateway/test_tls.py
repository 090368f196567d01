"""The gateway over HTTPS (gateway.tls_certfile / tls_keyfile): the openai SDK served through it, streams
included; plain HTTP refused on that port; a certificate that does not load stops `kvgate gateway` at
once with the key at fault; `kvgate up` probes its HTTPS gateway."""

from __future__ import annotations

import shutil
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.cli import main
from kvgate.supervisor import _is_healthy
from tests.gateway.conftest import API_KEY, MODEL, gateway_config, worker_entry
from tests.processes import fake_worker_process, gateway_process, running

pytestmark = pytest.mark.slow  # gateway and worker processes


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command, to make a self-signed certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def https_gateway(certificate, tmp_path_factory):
    """A gateway over HTTPS in front of a worker that answers at once; yields its https:// base URL."""
    cert, key = certificate
    with ExitStack() as stack:
        worker = stack.enter_context(running(fake_worker_process("answer")))
        config = gateway_config([worker_entry("w0", worker.url)], None,
                                gateway={"tls_certfile": str(cert), "tls_keyfile": str(key)})
        process = gateway_process(config, tmp_path_factory.mktemp("https-gateway"), api_key=API_KEY)
        stack.callback(process.stop)
        url = process.url.replace("http://", "https://")
        deadline = time.monotonic() + 60
        while not _is_healthy(f"{url}/ready"):  # as `kvgate up` probes it
            assert process.proc.poll() is None, process.output()[-2000:]
            assert time.monotonic() < deadline, "the HTTPS gateway did not get ready"
            time.sleep(0.1)
        yield url, process


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_the_openai_sdk_is_served_over_https(https_gateway, certificate, stream):
    url, _ = https_gateway
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                       http_client=httpx.Client(verify=str(certificate[0]))) as client:
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].text


def test_plain_http_is_not_served_on_the_https_port(https_gateway):
    url, process = https_gateway
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url.replace('https://', 'http://')}/health", timeout=5)
    assert "gateway listening on https://127.0.0.1:" in process.output()


def test_a_certificate_that_does_not_load_stops_the_gateway_at_once(tmp_path, capsys, certificate):
    config = tmp_path / "kvgate.yaml"
    config.write_text(f"pools: {{default: {{model: m, workers: [{{name: w0, url: 'http://127.0.0.1:9'}}]}}}}\n"
                      f"gateway: {{tls_certfile: {tmp_path / 'missing.pem'}}}\n")
    assert main(["gateway", "--config", str(config)]) == 2
    assert (f"gateway.tls_certfile: cannot load the certificate chain {tmp_path / 'missing.pem'}: "
            "No such file or directory") in capsys.readouterr().err
    cert, _ = certificate  # a certificate without its key
    config.write_text(f"pools: {{default: {{model: m, workers: [{{name: w0, url: 'http://127.0.0.1:9'}}]}}}}\n"
                      f"gateway: {{tls_certfile: {cert}}}\n")
    assert main(["gateway", "--config", str(config)]) == 2
    assert f"gateway.tls_certfile: cannot load the certificate chain {cert}: " in capsys.readouterr().err
