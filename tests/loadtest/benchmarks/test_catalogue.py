"""The benchmarks' catalogue (loadtest/benchmarks/__init__.py) against docs/benchmarks.md and the folder:
every section has a command that exists and regenerates it, every benchmark names a section, and `kvgate
bench list` / `kvgate bench NAME` reach each one."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import main as kvgate_main
from loadtest.benchdoc import section_commands
from loadtest.benchmarks import BY_NAME, CATALOGUE
from loadtest.benchmarks.routing import SECTIONS as ROUTING_SECTIONS, recorded_argv
from loadtest.paths import DOC_PATH

BENCHMARKS_DIR = Path(__file__).resolve().parents[3] / "loadtest" / "benchmarks"
DOC = DOC_PATH.read_text()
COMMANDS = section_commands(DOC)


def writer(section: str) -> str:
    """The one benchmark that writes section."""
    writers = [b.name for b in CATALOGUE if section in b.sections]
    assert len(writers) == 1, f"section {section} is written by {writers or 'no benchmark'} in the catalogue"
    return writers[0]


def test_the_doc_has_sections_to_check():
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("section", sorted(COMMANDS))
def test_every_section_says_the_kvgate_bench_command_of_the_benchmark_that_writes_it(section):
    command = COMMANDS[section]
    assert command, f"section {section} shows no `Command:` line"
    words = shlex.split(command)
    assert words[:2] == ["kvgate", "bench"], f"section {section}: {command}"
    name = writer(section)
    if words[2] == "fleet":  # a fleet run whose recorded command the routing benchmark reruns
        assert name == "routing" and section in ROUTING_SECTIONS
        assert recorded_argv(DOC, section)[:2] == ["bench", "fleet"]
    else:
        assert words[2] == name, f"section {section} is written by `kvgate bench {name}`, not {words[2]}"


@pytest.mark.parametrize("benchmark", CATALOGUE, ids=[b.name for b in CATALOGUE])
def test_every_benchmark_names_a_section_of_the_doc_or_says_where_its_figures_go(benchmark):
    if benchmark.sections:
        assert set(benchmark.sections) & set(COMMANDS), f"{benchmark.name}: none of {benchmark.sections} in the doc"
    else:
        assert "no section" in benchmark.notes
    assert benchmark.summary and benchmark.duration


def test_the_catalogue_lists_every_module_of_the_benchmarks_folder_and_nothing_else():
    modules = {p.stem for p in BENCHMARKS_DIR.glob("*.py") if p.stem != "__init__"}
    assert modules == {b.module.rsplit(".", 1)[1] for b in CATALOGUE}


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_kvgate_bench_name_reaches_the_benchmark_and_its_own_options(name, capsys):
    with pytest.raises(SystemExit) as exited:
        kvgate_main(["bench", name, "--help"])
    assert exited.value.code == 0
    assert f"usage: kvgate bench {name}" in capsys.readouterr().out


def test_kvgate_bench_list_prints_each_benchmark_with_its_sections_needs_and_duration():
    result = subprocess.run([sys.executable, "-m", "kvgate", "bench", "list"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for benchmark in CATALOGUE:
        assert f"\n{benchmark.name}: {benchmark.summary}\n" in "\n" + result.stdout
        assert f"    sections: {', '.join(benchmark.sections) or '(none)'}\n" in result.stdout
    assert "    needs: sglang-router" in result.stdout and "    takes: ~" in result.stdout


def test_the_routing_benchmark_reruns_the_commands_its_sections_record(capsys):
    assert kvgate_main(["bench", "routing", "--dry-run", "routing-multi-turn"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("routing-multi-turn: kvgate bench fleet ")
    assert "--bench-doc routing-multi-turn" in out
    with pytest.raises(ValueError, match="no `kvgate bench fleet ...` command in section gateway"):
        recorded_argv(DOC, "gateway")
