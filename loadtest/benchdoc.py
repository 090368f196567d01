"""Writes benchmark results into docs/benchmarks.md between `<!-- bench:NAME:start/end -->` markers.

Every figure in that file comes from a script calling this; nobody edits figures by hand.
"""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


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
