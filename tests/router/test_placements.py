"""Placements: where a prefix went last, at depths 1, 2, 4, 8, ... blocks, the deepest shared one winning."""

from __future__ import annotations

import pytest

from router.placements import Placements, _depths


def test_depths_are_blocks_one_two_four_eight():
    assert _depths(0) == [] and _depths(1) == [0] and _depths(8) == [0, 1, 3, 7] and _depths(16) == [0, 1, 3, 7, 15]


def test_the_deepest_shared_depth_names_the_home():
    placements = Placements()
    placements.record([1, 2, 3, 4, 5, 6, 7, 8], "system-prompt-worker")  # another user on the same system prompt
    placements.record([1, 2, 3, 4, 50, 60, 70, 80], "w-user")  # this user's earlier turn
    assert placements.home([1, 2, 3, 4, 50, 60, 70, 80, 90, 100]) == "w-user"  # shares block 8 with it
    assert placements.home([1, 2, 3, 4, 5, 6, 7, 8, 9]) == "system-prompt-worker"
    assert placements.home([1, 2, 99]) == "w-user"  # only block 2 shared: its last placement
    assert placements.home([42]) is None


def test_the_memory_is_bounded_and_a_departed_worker_is_no_home():
    placements = Placements(max_entries=4)
    placements.record([1, 2, 3, 4], "a")  # depths 0, 1, 3: three entries
    placements.record([10, 20], "b")  # two more: key 1 (the oldest) goes
    assert len(placements) == 4 and placements.home([1]) is None and placements.home([1, 2]) == "a"
    placements.forget_worker("a")
    assert placements.home([1, 2, 3, 4]) is None and placements.home([10, 20]) == "b"
    with pytest.raises(ValueError):
        Placements(max_entries=0)


def test_each_worker_counts_the_prefixes_that_call_it_home_among_the_most_recent():
    placements = Placements(max_prefixes=3)
    placements.record([1, 2, 3], "a")
    placements.record([1, 2, 4], "a")  # the same prefix (first block) again: still one
    placements.record([5, 6], "b")
    assert placements.prefixes_per_worker() == {"a": 1, "b": 1}
    placements.record([1, 9], "b")  # prefix 1 moved
    placements.record([7], "a")
    assert placements.prefixes_per_worker() == {"a": 1, "b": 2}
    placements.record([8], "a")  # a fourth prefix: the least recently placed (5, at b) is no longer counted
    assert placements.prefixes_per_worker() == {"a": 2, "b": 1}
    placements.forget_worker("a")
    assert placements.prefixes_per_worker() == {"b": 1}
    placements.record([], "a")  # nothing to place: nothing counted
    assert placements.prefixes_per_worker() == {"b": 1}


def test_a_conversation_counts_as_one_prefix_of_its_own_wherever_its_turns_go():
    placements = Placements()
    placements.record([1, 2], "a", session_id="user-1")  # two conversations on one system prompt (block 1)
    placements.record([1, 3], "b", session_id="user-2")
    placements.record([1, 2, 4], "a", session_id="user-1")  # user-1's next turn: still one
    assert placements.prefixes_per_worker() == {"a": 1, "b": 1}
    placements.record([1, 3, 5], "a", session_id="user-2")  # user-2 moved
    assert placements.prefixes_per_worker() == {"a": 2, "b": 0}


def test_a_conversations_home_is_where_its_last_turn_went():
    placements = Placements()
    placements.record([1, 2, 3, 4], "a", session_id="user-1")
    placements.record([1, 2, 3, 4], "b", session_id="user-2")  # the same depths (a shared system prompt)
    assert placements.home([1, 2, 3, 4, 5], "user-1") == "a"
    assert placements.home([1, 2, 3, 4, 5]) == "b"  # without the session: the depths' last placement
    assert placements.home([1, 2, 3, 4, 5], "user-3") == "b"  # a session not remembered: the same
