"""Workloads are seeded and reproducible, and have the shapes their docstrings promise."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from loadtest.workloads import build_workload

SMALL = {
    "multi_turn_chat": {"num_users": "4", "turns_per_user": "3", "system_prompt_tokens": "50"},
    "agentic": {"num_sessions": "2", "min_calls": "10", "max_calls": "12", "instructions_tokens": "40",
                "task_context_tokens": "40", "step_tokens": "10"},
    "multi_tenant_long_prefix": {"num_requests": "10", "prefix_tokens": "100"},
    "low_reuse": {"num_requests": "5", "document_tokens": "50"},
}


@pytest.fixture
def trace_path(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]},
            {"timestamp": 2500, "input_length": 300, "output_length": 0, "hash_ids": [5]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _params(name, trace_path):
    return {"path": trace_path} if name == "trace_replay" else SMALL[name]


@pytest.mark.parametrize("name", [*SMALL, "trace_replay"], ids=[*SMALL, "trace_replay"])
def test_same_seed_gives_identical_requests_and_another_seed_different_text(name, trace_path):
    _, first = build_workload(name, 7, _params(name, trace_path))
    _, again = build_workload(name, 7, _params(name, trace_path))
    _, other = build_workload(name, 8, _params(name, trace_path))
    assert first == again
    assert [s.prompt_text() for s in first] != [s.prompt_text() for s in other]
    assert [s.index for s in first] == list(range(len(first)))


def test_multi_turn_chat_turns_extend_the_previous_turn_with_an_answer_and_a_question():
    _, specs = build_workload("multi_turn_chat", 0, SMALL["multi_turn_chat"])
    turns = [s for s in specs if s.session_id == "user-0"]
    assert [len(s.messages) for s in turns] == [2, 4, 6]
    assert turns[1].messages[:2] == turns[0].messages
    assert turns[1].messages[2]["role"] == "assistant"
    assert len(turns[0].messages[0]["content"].split()) == 50


def test_agentic_sessions_have_ten_to_fifty_calls_over_a_growing_context():
    _, specs = build_workload("agentic", 0, SMALL["agentic"])
    session = [s for s in specs if s.session_id == "agent-session-0"]
    assert 10 <= len(session) <= 12
    lengths = [len(s.prompt_text().split()) for s in session]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_trace_replay_gives_equal_text_for_equal_hash_ids_and_keeps_the_clock(trace_path):
    _, specs = build_workload("trace_replay", 0, {"path": trace_path, "block_tokens": "512"})
    first, second, third = (s.prompt.split() for s in specs)
    assert first[:512] == second[:512] and first[512:700] != second[512:700]
    assert [len(first), len(second), len(third)] == [1200, 700, 300]
    assert [s.arrival_offset_s for s in specs] == [0.0, 0.5, 1.5]
    assert [s.max_tokens for s in specs] == [10, 5, 1]


@pytest.mark.parametrize("params, message", [
    ({"num_users": "0"}, "num_users must be >= 1"),
    ({"colour": "red"}, "unknown parameter 'colour'"),
    ({"num_users": "many"}, "expected int"),
], ids=["zero", "unknown", "not-a-number"])
def test_bad_workload_parameters_are_refused_by_name(params, message):
    with pytest.raises(ValueError, match=message):
        build_workload("multi_turn_chat", 0, params)


def test_multi_tenant_zipf_makes_a_few_tenants_hot_and_keeps_every_prefix_its_own():
    params = {"num_tenants": "16", "num_requests": "800", "prefix_tokens": "50", "tenant_zipf": "1.1"}
    _, specs = build_workload("multi_tenant_long_prefix", 0, params)
    counts = Counter(spec.tenant for spec in specs)
    assert counts["tenant-0"] > 4 * counts["tenant-15"] and counts["tenant-0"] > 800 / 8
    prefixes = {spec.tenant: spec.messages[0]["content"] for spec in specs}
    assert len(set(prefixes.values())) == len(prefixes)
    with pytest.raises(ValueError, match="tenant_zipf"):
        build_workload("multi_tenant_long_prefix", 0, {"tenant_zipf": "-1"})
