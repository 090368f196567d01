"""Contract tests run both sides for real: a tiny model for the worker side."""

from pathlib import Path

import pytest

from tests.worker.conftest import build_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("contract-tiny-llama"))
