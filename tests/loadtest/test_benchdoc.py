"""docs/benchmarks.md sections: written between their markers, their commands as they reproduce them."""

from __future__ import annotations

import pytest

from loadtest.benchdoc import replace_section


def test_a_section_replaces_its_own_markers_only_and_a_new_one_is_appended(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- bench:a:start -->\nold a\n<!-- bench:a:end -->\n\n"
                   "<!-- bench:b:start -->\nold b\n<!-- bench:b:end -->\n")

    replace_section("a", "new a\n", doc)
    replace_section("c", "new c", doc)

    text = doc.read_text()
    assert "<!-- bench:a:start -->\nnew a\n<!-- bench:a:end -->" in text and "old a" not in text
    assert "old b" in text and text.endswith("<!-- bench:c:start -->\nnew c\n<!-- bench:c:end -->\n")


def test_a_sections_command_drops_no_doc_and_keeps_every_other_flag(tmp_path):
    doc = tmp_path / "benchmarks.md"
    markdown = ("Command: `python -m loadtest.benchmarks.fleet_seeds --engine sim --no-doc`\n"
                "- Command: `python -m loadtest.benchmarks.real_engines --no-doc --rounds 4`\n"
                "Other runs were written with --no-doc as well.")

    replace_section("s", markdown, doc)

    text = doc.read_text()
    assert "Command: `python -m loadtest.benchmarks.fleet_seeds --engine sim`" in text
    assert "- Command: `python -m loadtest.benchmarks.real_engines --rounds 4`" in text
    assert "Other runs were written with --no-doc as well." in text  # prose is left alone


def test_a_section_name_must_be_a_plain_word(tmp_path):
    with pytest.raises(ValueError):
        replace_section("a -->", "x", tmp_path / "benchmarks.md")
