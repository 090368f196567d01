"""The default model's cache keeps one converted copy: older ones go, unless a process uses or converts them."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.model import default_model
from worker.model.default_model import remove_old_copies, resolve_model_path

OLD = "smollm2-135m-instruct-0123456789ab"
OLDER = "smollm2-135m-instruct-ba9876543210"


def fake_convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text("{}")
    return out_dir


def make_copy(models_dir: Path, name: str) -> Path:
    """A converted copy as an earlier install left it: folder, weights and its lock file."""
    copy = models_dir / name
    copy.mkdir(parents=True)
    (copy / "config.json").write_text("{}")
    (copy / "model.safetensors").write_bytes(b"\0" * 1024)
    (models_dir / f"{name}.lock").touch()
    return copy


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", fake_convert)
    return tmp_path / "models"


def test_a_conversion_removes_older_copies_and_their_leftovers(tmp_path: Path, models_dir: Path) -> None:
    make_copy(models_dir, OLD)
    make_copy(models_dir, OLDER)
    (models_dir / f".{OLD}.tmp-x1y2z3").mkdir()  # a killed conversion's leftovers
    current = resolve_model_path("default", cache_dir=tmp_path)
    assert sorted(p.name for p in models_dir.iterdir()) == [current.name, f"{current.name}.lock"]


def test_only_what_the_cache_made_is_removed(tmp_path: Path, models_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    models_dir.mkdir()
    keep = {
        "my-model": lambda p: p.mkdir(),
        "smollm2-135m-instruct-mine": lambda p: p.mkdir(),  # not 12 hex digits
        "smollm2-135m-instruct-0123456789AB": lambda p: p.mkdir(),  # upper case: not a name we give
        "smollm2-135m-instruct-aaaaaaaaaaaa": lambda p: p.symlink_to(outside),
        "smollm2-135m-instruct-bbbbbbbbbbbb": lambda p: p.write_text("a file"),
        "notes.lock": lambda p: p.touch(),
    }
    for name, make in keep.items():
        make(models_dir / name)
    current = resolve_model_path("default", cache_dir=tmp_path)
    assert sorted(p.name for p in models_dir.iterdir()) == sorted([*keep, current.name, f"{current.name}.lock"])
    assert (outside / "config.json").exists()


@pytest.mark.slow
def test_the_copy_a_process_uses_is_kept_until_it_exits(tmp_path: Path, models_dir: Path) -> None:
    old = make_copy(models_dir, OLD)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from worker.model import default_model\n"
        f"default_model._fingerprint = lambda gguf_path: {OLD.rsplit('-', 1)[1]!r}\n"
        "print(default_model.prepare_default_model(Path(sys.argv[1])), flush=True)\n"
        "sys.stdin.read()\n"
    )
    user = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert user.stdout.readline().strip() == str(old)
        current = resolve_model_path("default", cache_dir=tmp_path)
        assert (old / "model.safetensors").is_file()
    finally:
        user.communicate("", timeout=30)
    assert remove_old_copies(models_dir, keep=current) == [old]
    assert not old.exists()


def test_a_copy_being_converted_is_kept(tmp_path: Path, models_dir: Path) -> None:
    old = make_copy(models_dir, OLD)
    fd = os.open(models_dir / f"{OLD}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as prepare_default_model holds it while converting
        current = resolve_model_path("default", cache_dir=tmp_path)
        assert (old / "config.json").is_file()
    finally:
        os.close(fd)
    assert remove_old_copies(models_dir, keep=current) == [old]


@pytest.mark.slow
def test_the_current_copy_survives_a_clean_up_run_by_another_install(tmp_path: Path, models_dir: Path) -> None:
    current = resolve_model_path("default", cache_dir=tmp_path)
    other = make_copy(models_dir, OLD)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from worker.model.default_model import remove_old_copies\n"
        "models = Path(sys.argv[1])\n"
        f"print(remove_old_copies(models, keep=models / {OLD!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(models_dir)], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "[]", result.stderr  # this test process holds `current`
    assert (current / "config.json").is_file() and other.is_dir()


def test_a_copy_left_half_deleted_is_converted_again(tmp_path: Path, models_dir: Path) -> None:
    first = resolve_model_path("default", cache_dir=tmp_path)
    os.close(default_model._in_use.pop(first))  # as a fresh process would see it
    (first / "config.json").unlink()
    assert resolve_model_path("default", cache_dir=tmp_path) == first
    assert (first / "config.json").is_file()
