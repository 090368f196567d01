"""The prompt-cpu benchmark's pure parts: the prompts of each cell and the docs section (no processes)."""

from __future__ import annotations

from loadtest.benchmarks.prompt_cpu import markdown
from loadtest.harness.prompt_cells import CELLS, REQUESTS_PER_CELL, request_bodies


def test_a_cells_prompts_share_their_start_and_end_in_their_own_question():
    bodies = request_bodies("completion", 50, 5, seed=1)
    assert len(bodies) == REQUESTS_PER_CELL + 1 and all(b["stream"] and b["max_tokens"] == 16 for b in bodies)
    shared = bodies[0]["prompt"].split("\n")[0]
    assert len(shared.split()) == 50 and all(b["prompt"].startswith(shared + "\nQuestion ") for b in bodies)
    assert len({b["prompt"] for b in bodies}) == len(bodies)
    chats = request_bodies("chat", 50, 5, seed=1)
    assert {c["messages"][0]["content"] for c in chats} == {shared}
    assert request_bodies("completion", 0, 5, seed=2)[0]["prompt"].startswith("Question 0: ")
    assert request_bodies("completion", 50, 5, seed=3)[0]["prompt"] != bodies[0]["prompt"]  # a new text each round


def test_the_section_shows_each_tree_and_the_ratio():
    trees = {name: {cell: {"cpu_ms_per_request": cpu, "rounds_cpu_ms_per_request": [cpu, cpu]} for cell in CELLS}
             for name, cpu in (("baseline (abc)", 4.0), ("this checkout", 2.0))}
    text = markdown({"command": "cmd", "machine": "m", "date": "d", "rounds": 2, "trees": trees})
    assert "| completions, ~6,000-token shared context | 4.00 (4.00 / 4.00) | 2.00 (2.00 / 2.00) | 0.50x |" in text
    assert text.count("0.50x") == len(CELLS)
