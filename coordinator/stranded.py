"""When the ledger stops taking writes in the middle of an attempt (a full disk, a read-only remount).

Every control request is recorded before it leaves, so a coordinator that cannot write the ledger
cannot send anything — not even the resumes of a rollback. Whoever it already paused stays paused
until a coordinator that can write the ledger again runs `quiesce recover` (a `quiesce serve`: once
restarted), which asks each participant of the durable `attempt.started` what it saw and resumes
it. `stranded` builds the error that says exactly that: which servers may be left paused, why, and
the command that frees them. `FencedError` is never turned into it (a fenced coordinator stops,
and a newer one recovers).
"""

from __future__ import annotations

from quiesce.coordinator.attempt import Attempt, Context
from quiesce.coordinator.errors import LedgerError

__all__ = ["LedgerStranded", "stranded"]


class LedgerStranded(LedgerError):
    """The ledger failed mid-attempt; `left_paused` lists the servers that may still be paused."""

    def __init__(self, message: str, *, checkpoint_id: str, left_paused: list[str]) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.left_paused = list(left_paused)


def stranded(ctx: Context, attempt: Attempt, error: LedgerError) -> LedgerStranded:
    """The error to raise when `error` (not a `FencedError`) made the ledger unwritable mid-attempt."""
    if isinstance(error, LedgerStranded):
        return error
    touched = list(attempt.touched)
    paused = ", ".join(touched) if touched else "none (no request had left)"
    then = (
        f"restart the `quiesce serve` at {ctx.service} (a `quiesce recover` would find the ledger taken"
        " while it runs): taking the ledger again, it"
        if ctx.service
        else "run `quiesce recover` with this cluster's config: it"
    )
    return LedgerStranded(
        f"{attempt.kind} {attempt.checkpoint_id} stopped: the ledger could not be written ({error})."
        " Nothing can be sent without being recorded first, so no server was resumed; servers that may"
        f" be left paused (sent a request, or about to be): {paused}. Make the ledger writable again"
        f" (free space on its disk), then {then} resumes them and records what happened.",
        checkpoint_id=attempt.checkpoint_id,
        left_paused=touched,
    )
