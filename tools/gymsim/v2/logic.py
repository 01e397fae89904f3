"""The deterministic arithmetic of a v2 episode: every value is a digest of the values before it.

Rule: nothing here reads a rollout id, an attempt, a clock or a random number, so an episode's result
is a pure function of its task — `reference_result(task)` computes it without any server. A restored
episode finishes with the same result only if every piece of state it continues from (the
environment's boundary, the agent's session, the model's ledger, the resources session) came back
exactly; a missing or stale piece changes the digest chain.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def digest(*parts: object) -> str:
    """sha256 hex of the parts joined by `|`."""
    return hashlib.sha256("|".join(str(p) for p in parts).encode("utf-8")).hexdigest()


def task_digest(task: Any) -> str:
    """sha256 of the sort-keyed compact JSON of a task (Gym's environment task digest)."""
    return hashlib.sha256(json.dumps(task, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def turns_of(task: Any) -> int:
    """How many turns an episode of `task` runs (`task["turns"]`, default 3)."""
    if isinstance(task, dict) and isinstance(task.get("turns"), int) and task["turns"] >= 0:
        return int(task["turns"])
    return 3


def initial_state(task: Any) -> str:
    return digest("env", task_digest(task))


def env_step(state: str, turn: int, action: str) -> str:
    """The environment's state after `turn`, given the agent's action."""
    return digest("env-step", state, turn, action)


def agent_prompt(session_digest: str, observation: str) -> str:
    return digest("prompt", session_digest, observation)[:24]


def model_output(prompt: str, calls_before: int) -> str:
    """The policy's answer: depends on how many calls its ledger holds for the episode already."""
    return digest("model", prompt, calls_before)[:24]


def resources_seed(observation: str) -> str:
    return digest("seed", observation)


def resources_step(state_digest: str | None, action: str) -> tuple[str | None, str]:
    """(new state digest, output); a stateless session (None) answers from the action alone."""
    if state_digest is None:
        return None, digest("stateless", action)[:24]
    new = digest("res", state_digest, action)
    return new, new[:24]


def agent_update(session_digest: str, reply: str, tool_output: str) -> tuple[str, str]:
    """(new session digest, the action the agent returns to the environment)."""
    return digest("session", session_digest, reply, tool_output), digest("action", reply, tool_output)[:24]


def initial_session(observation: str) -> str:
    return digest("agent", observation)


def reference_result(task: Any, *, stateless_resources: bool = False) -> str:
    """The result an uninterrupted episode of `task` reaches (one agent, one policy model, one
    resources server), computed here without servers."""
    state = initial_state(task)
    session = initial_session(state)
    resource: str | None = None if stateless_resources else resources_seed(state)
    for turn in range(turns_of(task)):
        reply = model_output(agent_prompt(session, state), turn)
        resource, tool = resources_step(resource, reply)
        session, action = agent_update(session, reply, tool)
        state = env_step(state, turn, action)
    return state
