"""Writes benchmark results into docs/benchmarks.md between `<!-- bench:NAME:start/end -->` markers.

Every figure in that file comes from a script calling this; nobody edits figures by hand.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any, Sequence

from loadtest.paths import DOC_PATH


def machine_description() -> str:
    """CPU model, core count and memory, e.g. for the 'Machine:' line of a section."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {mem_kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        memory = ""
    import os

    return f"{cpu}, {os.cpu_count()} cores{memory}"


def gpu_description() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


_SECTION = re.compile(r"<!-- bench:([A-Za-z0-9_.-]+):start -->(.*?)<!-- bench:\1:end -->", re.S)
_COMMAND = re.compile(r"^(?:- )?Command: `([^`]+)`", re.M)


def section_commands(doc: str) -> dict[str, str | None]:
    """Each bench section of doc -> the command its first `Command:` line shows (None where it shows none)."""
    commands = {}
    for section in _SECTION.finditer(doc):
        command = _COMMAND.search(section.group(2))
        commands[section.group(1)] = command.group(1) if command else None
    return commands


# a flag that only says where a run's figures are written: a section's command shows how they were measured
_DOC_ONLY_FLAGS = re.compile(r"(?<=\S) --no-doc(?=[ `])")


def replace_section(name: str, markdown: str, doc_path: Path = DOC_PATH) -> None:
    """Replace (or append) the section between the bench:NAME markers with markdown (its `Command:`
    lines without --no-doc: the command that reproduces the figures, docs included)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError("benchmark section names are letters, digits, '.', '_' or '-'")
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    markdown = "\n".join(_DOC_ONLY_FLAGS.sub("", line) if "Command: `" in line else line
                         for line in markdown.strip().splitlines())
    body = f"{start}\n{markdown}\n{end}"
    text = doc_path.read_text() if doc_path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: body, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    doc_path.write_text(text)


def number(value: float | None, digits: int = 2) -> str:
    """A figure with thousands separators; "-" where there is none."""
    return "-" if value is None else f"{value:,.{digits}f}"


def bench_command(name: str, argv: Sequence[str] = ()) -> str:
    """The command a section shows as the one that regenerated it: `kvgate bench NAME ARGS...`."""
    return shlex.join(["kvgate", "bench", name, *argv])


def save_result(path: Path, result: Any) -> None:
    """A run's result as JSON at path (results/...), its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
