"""The control-plane fence of spec §1.1 — one per server process.

Every POST control operation is keyed `(checkpoint_id, operation)` and goes through
`Fence.run`, which applies these rules in this order:

1. the id is retired: replay the recorded result of this exact key if there is one
   (only a resume can have one), else 409 `stale_checkpoint`;
2. a recorded successful result for the key: return it unchanged (idempotent replay);
3. the same key in flight: wait for it and return its outcome, success or failure (coalescing);
4. another id is active → 409 `checkpoint_conflict`; the phase is not in the
   operation's allowed set → 409 `invalid_phase`;
5. run: phase := the operation's `during` phase (for as long as the operation runs, which a
   `delay` fault `when: during` lengthens); on failure the phase returns to
   where it was (or to the operation's `failure` phase) and nothing is recorded; on
   success the phase becomes `after` (or what the action asks for) and the result is
   recorded. Only resume retires: the fence returns to `idle` with no active id and
   the id is stale forever (its resume result stays replayable).

The fence state (phase, active id, deadline) is in memory: a process that dies
forgets it, which is why a restarted server boots `idle` and restore exists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from quiesce.coordinator.protocol import (
    CHECKPOINT_CONFLICT,
    INVALID_PHASE,
    STALE_CHECKPOINT,
    CommonBody,
    Phase,
)
from quiesce.tools.gymsim.common import INTERNAL_ERROR, ControlRejection
from quiesce.tools.gymsim.faults import OPERATION_DELAY

Result = dict[str, Any]


@dataclass(frozen=True)
class OpRule:
    """One row of the phase table: where the operation may start, and where it leaves the fence."""

    allowed: frozenset[Phase]
    during: Phase | None
    after: Phase
    failure: Phase | None = None
    retires: bool = False


def rule(
    allowed: tuple[Phase, ...],
    during: Phase | None,
    after: Phase,
    failure: Phase | None = None,
    *,
    retires: bool = False,
) -> OpRule:
    return OpRule(frozenset(allowed), during, after, failure, retires)


@dataclass(frozen=True)
class Done:
    """A successful action's reply, optionally overriding the rule's `after` phase."""

    result: Result
    after: Phase | None = None


Action = Callable[[], Awaitable[Result | Done]]


class Fence:
    """Phase, active checkpoint id and recorded results of one server process."""

    def __init__(self, rules: Mapping[str, OpRule]) -> None:
        self.rules = dict(rules)
        self.phase: Phase = "idle"
        self.active_checkpoint_id: str | None = None
        self.deadline_ts: float | None = None
        #: recorded successful results: checkpoint id → operation → result
        self._results: dict[str, dict[str, Result]] = {}
        self._retired: set[str] = set()
        self._inflight: dict[tuple[str, str], asyncio.Future[Result]] = {}

    def snapshot(self) -> dict[str, Any]:
        """The capabilities' fence fields."""
        return {
            "phase": self.phase,
            "active_checkpoint_id": self.active_checkpoint_id,
            "deadline_ts": self.deadline_ts,
        }

    def is_retired(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._retired

    def check_query(self, checkpoint_id: str, allowed: frozenset[Phase] | None) -> None:
        """Rules for a status GET (not recorded): stale id, another active id, phase not allowed."""
        if checkpoint_id in self._retired:
            raise ControlRejection(STALE_CHECKPOINT, f"checkpoint {checkpoint_id} is retired")
        if self.active_checkpoint_id is not None and self.active_checkpoint_id != checkpoint_id:
            raise ControlRejection(
                CHECKPOINT_CONFLICT, f"checkpoint {self.active_checkpoint_id} is active, not {checkpoint_id}"
            )
        if allowed is not None and self.phase not in allowed:
            raise ControlRejection(INVALID_PHASE, f"status is not available in phase {self.phase}")

    def advance(self, from_phase: Phase, to_phase: Phase) -> None:
        """Move `from_phase` → `to_phase` outside an operation (model status observing `paused`)."""
        if self.phase == from_phase:
            self.phase = to_phase

    async def run(self, operation: str, body: CommonBody, action: Action) -> Result:
        """Run `action` under the fence rules; raises `ControlRejection` for every refusal or failure."""
        checkpoint_id = body.checkpoint_id
        key = (checkpoint_id, operation)
        recorded = self._results.get(checkpoint_id, {}).get(operation)
        if checkpoint_id in self._retired:
            if recorded is not None:
                return recorded
            raise ControlRejection(STALE_CHECKPOINT, f"checkpoint {checkpoint_id} is retired")
        if recorded is not None:
            return recorded
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        op_rule = self.rules[operation]
        if self.active_checkpoint_id is not None and self.active_checkpoint_id != checkpoint_id:
            raise ControlRejection(
                CHECKPOINT_CONFLICT, f"checkpoint {self.active_checkpoint_id} is active, not {checkpoint_id}"
            )
        if self.phase not in op_rule.allowed:
            raise ControlRejection(INVALID_PHASE, f"{operation} is not allowed in phase {self.phase}")

        previous_phase, previous_deadline = self.phase, self.deadline_ts
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        self.active_checkpoint_id = checkpoint_id
        self.deadline_ts = body.deadline_ts
        if op_rule.during is not None:
            self.phase = op_rule.during
        try:
            delay = OPERATION_DELAY.get()
            if delay:  # a `delay` fault `when: during`: the operation is slow, its phase shows it
                await asyncio.sleep(delay)
            outcome = await action()
        except BaseException as exc:
            back = op_rule.failure or previous_phase
            self.phase = back
            if back == "idle":
                self.active_checkpoint_id = None
                self.deadline_ts = None
            elif op_rule.failure is None:
                self.deadline_ts = previous_deadline
            rejection = (
                exc
                if isinstance(exc, ControlRejection)
                else ControlRejection(INTERNAL_ERROR, f"{operation} failed: {exc!r}", status=500)
            )
            future.set_exception(rejection)
            future.exception()  # retrieved: a failure nobody coalesced with is not an asyncio warning
            del self._inflight[key]
            raise
        done = outcome if isinstance(outcome, Done) else Done(outcome)
        self._results.setdefault(checkpoint_id, {})[operation] = done.result
        del self._inflight[key]
        if op_rule.retires:
            self._retire(checkpoint_id)
        else:
            self.phase = done.after or op_rule.after
        future.set_result(done.result)
        return done.result

    def _retire(self, checkpoint_id: str) -> None:
        self.phase = "idle"
        self.active_checkpoint_id = None
        self.deadline_ts = None
        self._retired.add(checkpoint_id)
        kept = self._results.get(checkpoint_id, {})
        for operation in [op for op in kept if op != "resume"]:
            del kept[operation]
