"""Multi-turn chat: many users on a few shared system prompts; each turn resends the whole history.

The driver can't wait for real answers in open loop, so each turn appends a deterministic stand-in
answer of `answer_tokens` tokens: the next turn's prompt reuses everything up to the previous user
message exactly, and the stand-in answer in place of the model's own (a real client would resend
the real answer, which the worker has cached; here those tokens are a miss).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.text import seeded_text, word_salad
from loadtest.types import RequestSpec
from loadtest.workloads.common import interleave, numbered


@dataclass(frozen=True, slots=True)
class MultiTurnChatConfig:
    """Sizes of the multi-turn chat workload (tokens are approximate: see loadtest.text)."""

    num_users: int = 16
    num_system_prompts: int = 3
    turns_per_user: int = 4
    system_prompt_tokens: int = 800
    user_message_tokens: int = 60
    answer_tokens: int = 120

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"multi_turn_chat.{name} must be >= 1")


def generate(config: MultiTurnChatConfig, seed: int) -> list[RequestSpec]:
    """Every user's turns, interleaved across users at random but in order within a user."""
    rng = random.Random(f"{seed}:multi_turn_chat")
    systems = [seeded_text(f"{seed}:system:{i}", config.system_prompt_tokens) for i in range(config.num_system_prompts)]
    sessions = [_user_turns(config, seed, rng, user, systems) for user in range(config.num_users)]
    return numbered(interleave(sessions, rng))


def _user_turns(config: MultiTurnChatConfig, seed: int, rng: random.Random, user: int,
                systems: list[str]) -> list[RequestSpec]:
    which = rng.randrange(len(systems))
    history = [{"role": "system", "content": systems[which]}]
    ids = [f"system-{which}"]
    turns = []
    for turn in range(config.turns_per_user):
        history.append({"role": "user", "content": word_salad(rng, config.user_message_tokens)})
        ids.append(f"user-{user}-q{turn}")
        turns.append(RequestSpec(index=0, kind="chat", max_tokens=config.answer_tokens, messages=tuple(history),
                                 session_id=f"user-{user}", prefix_group=f"system-{which}", prefix_ids=tuple(ids)))
        answer = seeded_text(f"{seed}:answer:{user}:{turn}", config.answer_tokens)
        history.append({"role": "assistant", "content": answer})
        ids.append(f"user-{user}-a{turn}")
    return turns

