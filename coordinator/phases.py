"""The order of calls and the participation rule, as data (Gym's control plane v1, the coordinator's side).

Roles: a participant is in exactly one role group — `policy` (the policy model), `agent`, or
`resources`. Each phase is a sequence of steps `(role, operation)` run left to right; within one
step the role group's servers are called one at a time, or concurrently with `fanout: parallel`.
The order *between* steps never changes.

Participation:
- a model server whose instance role is `policy` always pauses, drains and resumes; it commits
  and restores only when its `checkpoint_mode` is `export_restore` — a `stateless` one is
  drain-only (`Member.exports`);
- a model with role `auxiliary` (a judge) never does — it is skipped;
- agents and resources take part only when their `checkpoint_mode` is `export_restore`;
- a `restart_only` server of any kind takes part in no phase (discovery skips it).

Rollback uses the `resume` order over the servers *touched* by the attempt (a request was sent,
answered or not).

On Gym's unified plane (v2) the role groups are Gym's stages: `environment`, `policy` (kind
`model`), `agent`, `resources`. Prepare runs them in that order (`V2_STAGES`); resume and rollback
run them backwards (`resume_order("v2")`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, Operation

__all__ = [
    "COMPONENT_OF_ROLE",
    "ORDER",
    "ROLES",
    "V2_ROLE_OF_KIND",
    "V2_STAGES",
    "PhaseName",
    "Plane",
    "Role",
    "Step",
    "resume_order",
    "role_of",
    "steps",
]

Role = Literal["policy", "agent", "resources", "environment"]
ROLES: Final[tuple[Role, ...]] = ("policy", "agent", "resources")
Plane = Literal["v1", "v2"]
#: Gym's stage order on the unified plane (prepare): environment → model → agent → resources.
V2_STAGES: Final[tuple[Role, ...]] = ("environment", "policy", "agent", "resources")
#: the role group of each v2 participant kind
V2_ROLE_OF_KIND: Final[dict[str, Role]] = {
    "environment": "environment",
    "model": "policy",
    "agent": "agent",
    "resources": "resources",
}
PhaseName = Literal["prepare", "commit", "resume", "restore"]

COMPONENT_OF_ROLE: Final[dict[Role, str]] = {"policy": MODEL, "agent": AGENT, "resources": RESOURCES}


@dataclass(frozen=True)
class Step:
    """Call `operation` on every participant of role group `role`."""

    role: Role
    operation: Operation


ORDER: Final[dict[PhaseName, tuple[Step, ...]]] = {
    # policy pause -> agents prepare (retry agent_prepare_incomplete) -> resources prepare
    # -> policy status long-poll, repeated until paused with nothing in flight
    "prepare": (
        Step("policy", "pause"),
        Step("agent", "prepare"),
        Step("resources", "prepare"),
        Step("policy", "status"),
    ),
    # agents first: the model needs every agent's continuation index
    "commit": (Step("agent", "commit"), Step("policy", "commit"), Step("resources", "commit")),
    "resume": (Step("resources", "resume"), Step("policy", "resume"), Step("agent", "resume")),
    # all stay paused until resume; then a later agent drops each restored continuation that
    # depends on a `restart_only` resources server (`restore.discards`)
    "restore": (
        Step("policy", "restore"),
        Step("agent", "restore"),
        Step("resources", "restore"),
        Step("agent", "discard"),
    ),
}


def steps(phase: PhaseName) -> tuple[Step, ...]:
    """The steps of `phase`, in order."""
    return ORDER[phase]


def resume_order(plane: Plane = "v1") -> tuple[Role, ...]:
    """Role groups in the order they are resumed (also the rollback order): v1's resources →
    policy → agents; v2's stages backwards."""
    if plane == "v2":
        return tuple(reversed(V2_STAGES))
    return tuple(step.role for step in ORDER["resume"])


def role_of(component: str, checkpoint_mode: str, instance_role: str | None) -> Role | None:
    """The role group of a server, or None when it does not take part (auxiliary, stateless, no role).

    `instance_role` is the effective role (capabilities', else the config's). Callers decide what a
    model without a role means (discovery refuses it); here it simply does not take part.
    """
    if component == MODEL:
        return "policy" if instance_role == "policy" else None
    if checkpoint_mode != "export_restore":
        return None
    if component == AGENT:
        return "agent"
    if component == RESOURCES:
        return "resources"
    return None
