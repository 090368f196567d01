"""Agentic sessions: 10-50 calls each over a long context that grows by every step's tool output.

Each call sends the agent's instructions (shared by sessions of the same agent), the session's
task context, then every earlier step (a stand-in action of `output_tokens` and a tool result of
`step_tokens`); outputs are short.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.text import seeded_text, word_salad
from loadtest.types import RequestSpec
from loadtest.workloads.common import interleave, numbered


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """Sizes of the agentic workload (tokens are approximate: see loadtest.text)."""

    num_sessions: int = 6
    num_agents: int = 2
    min_calls: int = 10
    max_calls: int = 50
    instructions_tokens: int = 1500
    task_context_tokens: int = 2000
    step_tokens: int = 150
    output_tokens: int = 32

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"agentic.{name} must be >= 1")
        if self.max_calls < self.min_calls:
            raise ValueError("agentic.max_calls must be >= agentic.min_calls")


def generate(config: AgenticConfig, seed: int) -> list[RequestSpec]:
    """Every session's calls, interleaved across sessions at random but in order within a session."""
    rng = random.Random(f"{seed}:agentic")
    agents = [seeded_text(f"{seed}:agent:{i}", config.instructions_tokens) for i in range(config.num_agents)]
    sessions = [_session_calls(config, seed, rng, s, agents) for s in range(config.num_sessions)]
    return numbered(interleave(sessions, rng))


def _session_calls(config: AgenticConfig, seed: int, rng: random.Random, session: int,
                   agents: list[str]) -> list[RequestSpec]:
    agent = rng.randrange(len(agents))
    history = [{"role": "system", "content": agents[agent]},
               {"role": "user", "content": word_salad(rng, config.task_context_tokens)}]
    ids = [f"agent-{agent}", f"task-{session}"]
    calls = []
    for step in range(rng.randint(config.min_calls, config.max_calls)):
        calls.append(RequestSpec(index=0, kind="chat", max_tokens=config.output_tokens, messages=tuple(history),
                                 session_id=f"agent-session-{session}", prefix_group=f"agent-{agent}",
                                 prefix_ids=tuple(ids)))
        history.append({"role": "assistant", "content": seeded_text(f"{seed}:act:{session}:{step}", config.output_tokens)})
        history.append({"role": "user", "content": word_salad(rng, config.step_tokens)})
        ids += [f"act-{session}-{step}", f"tool-{session}-{step}"]
    return calls
