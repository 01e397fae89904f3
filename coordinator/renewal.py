"""Lease renewal on Gym's unified plane: what keeps a save's servers paused while its caller works.

A v2 participant holds a lease (`deadline_ts + lease_grace_seconds` of its last prepare, commit or
renew) and resumes by itself when it runs out. While the caller's block inside `save()` runs and
while publication runs, `renewing` sends `renew` to every participant every
`min(horizon/3, 10 s)`, each with `deadline_ts = now + horizon` (the attempt's budget), so a
block that outlasts the deadline — or a lease grace — keeps its servers paused.

A renewal that comes back refused (`stale_checkpoint`: the id was resumed; `invalid_phase`: the
server is idle; `checkpoint_conflict`: another id holds it) means the server let go of the save
(its lease had already expired, or someone resumed it): its state has run on since the commit,
so the snapshot must not be published. `Attempt.lease_lost` then says which server and how, and
the save fails on leaving the block (rolled back, nothing published). A renewal that gets no
reply is retried at the next tick. Every renewal is a recorded call (phase `renew`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio

from quiesce.coordinator.attempt import Attempt, Context, send_call
from quiesce.coordinator.calls import encode_body
from quiesce.coordinator.protocol_v2 import CheckpointRequest, RenewReply

#: The longest pause between two renewals.
MAX_INTERVAL_S: Final = 10.0
#: The shortest (a tiny budget must not turn renewals into a busy loop).
MIN_INTERVAL_S: Final = 0.05


def interval_s(horizon_s: float) -> float:
    """How often a save's participants are renewed: every min(horizon/3, 10 s)."""
    return max(MIN_INTERVAL_S, min(horizon_s / 3, MAX_INTERVAL_S))


async def renew_all(ctx: Context, attempt: Attempt, horizon_s: float) -> None:
    """Renew every participant once (in parallel); the first refusal sets `attempt.lease_lost`."""
    deadline_ts = time.time() + horizon_s
    body = encode_body(CheckpointRequest(checkpoint_id=attempt.checkpoint_id, deadline_ts=deadline_ts))
    call_deadline = time.time() + min(horizon_s, ctx.config.control_timeout_s)

    async def one(name: str) -> None:
        member = attempt.member(name)
        if member is None:
            return
        result = await send_call(ctx, attempt, member, "renew", "renew", body=body, deadline_ts=call_deadline)
        if result.ok and isinstance(result.reply, RenewReply):
            return
        refused = result.error == "http" and result.status is not None and 400 <= result.status < 500
        if refused and attempt.lease_lost is None:
            attempt.lease_lost = (
                f"{name} no longer holds checkpoint {attempt.checkpoint_id}: its renewal was refused"
                f" ({result.describe()}) — its lease had run out, or something resumed it, so its"
                " state has moved on since the commit"
            )

    async with anyio.create_task_group() as tg:
        for name in attempt.names:
            tg.start_soon(one, name)


@asynccontextmanager
async def renewing(ctx: Context, attempt: Attempt, horizon_s: float) -> AsyncIterator[None]:
    """Renew every participant of a v2 `attempt` in the background while the body runs (a v1
    attempt: nothing). The renewals stop before the body's exit returns."""
    if attempt.plane != "v2":
        yield
        return
    pause = interval_s(horizon_s)

    async def loop() -> None:
        while True:
            await anyio.sleep(pause)
            await renew_all(ctx, attempt, horizon_s)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # what the body raised (the caller's block, a failed save) goes on as itself, never
        # wrapped by the renewals' task group: the renewal loop raises nothing of its own but a
        # ledger failure, which is then the one exception
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
