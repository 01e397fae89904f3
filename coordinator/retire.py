"""Retire and forget on Gym's unified plane: stop attempts everywhere, then stop refusing them.

Rules:
- Order is callers before callees, as Gym's coordination orders them: environment → agent →
  {model, resources} (the last two together). A stage's servers are called in parallel; every
  stage is called even when one before it failed (a retire that reached some servers must reach
  all, or a later request could still run there), and the failures are reported together.
- Retire raises each rollout's mark to the attempt given (and stops every earlier attempt), so a
  request from a retired attempt is refused (`stale_attempt`) until `forget`; forget sends the
  rollout ids deduplicated and sorted.
- Both are legal only while a server is idle or restored: a server holding a save answers
  `invalid_phase`, and the coordinator refuses before sending anything while an attempt of its own
  is open (the error says to resume first).
- Every call is recorded (`call.sent` before it leaves, its outcome after); then
  `episodes.retired` / `rollouts.forgotten` records what was asked, of whom, and who failed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from pydantic import BaseModel

from quiesce.coordinator.attempt import Attempt, Context, anyio_deadline, send_call
from quiesce.coordinator.calls import CallResult, encode_body
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.protocol_v2 import (
    INVALID_PHASE,
    ROUTES,
    EpisodeId,
    ForgetReply,
    ForgetRequest,
    RetireReply,
    RetireRequest,
    unique_episodes,
)

#: Gym's order of retire and forget: callers before callees (model and resources together).
ORDER: Final[tuple[frozenset[str], ...]] = (
    frozenset({"environment"}),
    frozenset({"agent"}),
    frozenset({"model", "resources"}),
)


@dataclass(frozen=True)
class RetireOutcome:
    """What a retire or forget did: the servers called (in order), and those that failed, why."""

    operation: str
    checkpoint_id: str
    items: tuple[str, ...]
    servers: tuple[str, ...]
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def as_json(self) -> dict[str, Any]:
        return {
            "operation": self.operation,
            "checkpoint_id": self.checkpoint_id,
            "items": list(self.items),
            "servers": list(self.servers),
            "failed": dict(self.failed),
        }


def in_order(members: Sequence[Member]) -> list[list[Member]]:
    """`members` grouped by the retire order (empty stages left out)."""
    return [group for stage in ORDER if (group := [m for m in members if m.component in stage])]


def resume_first(failed: dict[str, str]) -> bool:
    """Whether a failure is a server holding a checkpoint (it answered `invalid_phase`)."""
    return any(INVALID_PHASE in why for why in failed.values())


async def _fan(
    ctx: Context,
    attempt: Attempt,
    operation: str,
    body: Any,
    reply_model: type,
    deadline_ts: float,
) -> tuple[list[str], dict[str, str]]:
    called: list[str] = []
    failed: dict[str, str] = {}
    if isinstance(body, BaseModel):
        body = encode_body(body)  # the same request to every server: encoded once

    async def one(m: Member) -> None:
        called.append(m.name)
        result: CallResult
        if attempt.kind == "restore":  # cleaning up a restore: its calls are the restore's
            result = await send_call(
                ctx, attempt, m, operation, operation, body=body, deadline_ts=deadline_ts
            )
        else:  # an operation of its own: recorded outside any attempt (`e<epoch>-retire/<n>`)
            result = await ctx.caller.call(
                m.target,
                ROUTES[operation],
                phase=operation,
                checkpoint_id=None,
                deadline_ts=deadline_ts,
                body=body,
            )
        if not (result.ok and isinstance(result.reply, reply_model)):
            failed[m.name] = result.describe()

    with anyio.CancelScope(deadline=anyio_deadline(deadline_ts)):
        for group in in_order(attempt.participants):
            async with anyio.create_task_group() as tg:
                for m in group:
                    tg.start_soon(one, m)
    for m in attempt.participants:
        if m.name not in called:
            failed.setdefault(m.name, "not called: the deadline passed first")
    return called, failed


async def retire(
    ctx: Context, attempt: Attempt, episodes: Sequence[EpisodeId], *, deadline_ts: float, reason: str
) -> RetireOutcome:
    """Retire `episodes` on every participant of `attempt` (its id is the request's); records
    `episodes.retired`. Never raises for a server's failure: the outcome names it."""
    chosen = unique_episodes(episodes)
    body = RetireRequest(checkpoint_id=attempt.checkpoint_id, deadline_ts=deadline_ts, episode_ids=chosen)
    called, failed = await _fan(ctx, attempt, "retire", body, RetireReply, deadline_ts)
    keys = [e.capture_key for e in chosen]
    await ctx.ledger.append(
        "episodes.retired",
        checkpoint_id=attempt.checkpoint_id if attempt.kind == "restore" else None,
        data={"episodes": keys, "servers": called, "reason": reason, "failed": failed},
    )
    return RetireOutcome("retire", attempt.checkpoint_id, tuple(keys), tuple(called), failed)


async def forget(
    ctx: Context, attempt: Attempt, rollout_ids: Sequence[str], *, deadline_ts: float
) -> RetireOutcome:
    """Forget the retire marks of `rollout_ids` on every participant; records `rollouts.forgotten`."""
    chosen = sorted(set(rollout_ids))
    body = ForgetRequest(checkpoint_id=attempt.checkpoint_id, deadline_ts=deadline_ts, rollout_ids=chosen)
    called, failed = await _fan(ctx, attempt, "forget", body, ForgetReply, deadline_ts)
    await ctx.ledger.append(
        "rollouts.forgotten", data={"rollout_ids": chosen, "servers": called, "failed": failed}
    )
    return RetireOutcome("forget", attempt.checkpoint_id, tuple(chosen), tuple(called), failed)


def operation_attempt(checkpoint_id: str, participants: Sequence[Member], budget_s: float) -> Attempt:
    """A transient attempt that carries a retire or forget outside any save or restore: its id is
    the one the requests carry; its calls are recorded outside any attempt (no `attempt.started`)."""
    return Attempt(
        checkpoint_id=checkpoint_id,
        kind="save",
        deadline_ts=time.time() + budget_s,
        participants=tuple(participants),
    )
