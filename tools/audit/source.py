"""The reads the audit tools make, all through `ledger.Ledger` opened read-only.

Opening read-only claims no writership and never appends, so every tool here can run beside a
live coordinator, on SQLite or PostgreSQL. Reads use the ledger's indexes: events of one
checkpoint id (`checkpoint_id, seq`) and events of a few kinds (`kind, seq`); history reads only
the `attempts` projection. The attempt model (which loads the wire routes) and the bundle format
are imported by the functions that use them, so `quiesce history` loads only what a read needs.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from quiesce.ledger import GENESIS_HASH, Ledger, LedgerError, event_from_raw
from quiesce.ledger.backend import RawEvent
from quiesce.ledger.chain import check_each
from quiesce.ledger.events import Event

if TYPE_CHECKING:
    from quiesce.tools.audit.attempts import AttemptView
    from quiesce.tools.audit.bundle import ExportSummary, Verification
    from quiesce.tools.audit.check import ChainVerdict
    from quiesce.tools.audit.operations import EpisodeOperation

#: Coordinator-level events that give an attempt's events their context: who wrote them (epochs)
#: and how recovery ended them.
CONTEXT_KINDS: tuple[str, ...] = ("coordinator.started", "recovery.completed")


@asynccontextmanager
async def open_readonly(url: str) -> AsyncIterator[Ledger]:
    """`Ledger.open(url, readonly=True)`."""
    async with Ledger.open(url, readonly=True) as ledger:
        yield ledger


#: The name that stands for the most recently started attempt wherever an attempt id is asked for.
LATEST_ATTEMPT = "latest"


async def resolve_attempt_id(ledger: Ledger, checkpoint_id: str) -> str:
    """`checkpoint_id` itself, or for `latest` the id of the most recently started attempt (the last
    row `quiesce history` lists). Raises `LedgerError` for `latest` on a ledger without attempts."""
    if checkpoint_id != LATEST_ATTEMPT:
        return checkpoint_id
    ids = await recent_attempt_ids(ledger, 1)
    if not ids:
        raise LedgerError(f"no attempt in ledger {ledger.url} yet, so no latest one")
    return ids[0]


async def attempt_rows(ledger: Ledger, checkpoint_id: str, *, head_seq: int | None = None) -> list[RawEvent]:
    """The stored rows of one attempt plus its context, in seq order, up to `head_seq` (if given).

    Context: every `coordinator.started` (so an epoch check knows every newer epoch), each
    `recovery.completed` naming the attempt, and the last `discovery.completed` before it: its
    participants' kinds (the stage order a v2 attempt is judged by) and modes (a drain-only
    policy model is paused and resumed, never committed), as the whole-ledger check sees them.
    Raises `LedgerError` when no event names the id.
    """
    own = [row async for page in ledger.read_pages(checkpoint_id=checkpoint_id) for row in page]
    if not own:
        raise LedgerError(
            f"no attempt {checkpoint_id!r} in ledger {ledger.url}; `quiesce history` lists them"
        )
    context: list[RawEvent] = await _discovery_before(ledger, own)
    async for page in ledger.read_pages(kinds=CONTEXT_KINDS):
        for row in page:
            if row[3] == checkpoint_id:
                continue  # already in `own`
            if row[2] == "recovery.completed":
                outcomes = event_from_raw(row).data.get("outcomes")
                if not (isinstance(outcomes, dict) and checkpoint_id in outcomes):
                    continue
            context.append(row)
    context.sort(key=lambda r: int(r[0]))
    merged = list(heapq.merge(own, context, key=lambda r: int(r[0])))
    if head_seq is not None:
        merged = [r for r in merged if int(r[0]) <= head_seq]
    return merged


async def _discovery_before(ledger: Ledger, own: list[RawEvent]) -> list[RawEvent]:
    """The last `discovery.completed` before the attempt's `attempt.started` (none without one)."""
    started = next((row for row in own if row[2] == "attempt.started"), None)
    if started is None:
        return []
    last: RawEvent | None = None
    async for page in ledger.read_pages(kinds=("discovery.completed",)):
        for row in page:
            if int(row[0]) > int(started[0]):
                return [last] if last is not None else []
            last = row
    return [last] if last is not None else []


async def load_operations(ledger: Ledger, *, since_seq: int = 0) -> list[EpisodeOperation]:
    """The retires and forgets recorded outside any attempt (Gym's unified plane), oldest first:
    `episodes.retired` without a checkpoint id, and every `rollouts.forgotten` (a forget names no
    attempt even when sent under a restore's id). Reads those two kinds only (their index)."""
    from quiesce.tools.audit.operations import episode_operation

    out: list[EpisodeOperation] = []
    async for event in ledger.read(after=since_seq, kinds=("episodes.retired", "rollouts.forgotten")):
        if event.kind == "episodes.retired" and event.checkpoint_id is not None:
            continue
        operation = episode_operation(event)
        if operation is not None:
            out.append(operation)
    return out


async def read_operations(url: str, since_at: str | None = None) -> list[EpisodeOperation]:
    """`load_operations` of the ledger at `url` (read-only), those recorded at or after `since_at`
    (an ISO time, compared as the events' UTC `at`) when given."""
    async with open_readonly(url) as ledger:
        found = await load_operations(ledger)
    return [op for op in found if since_at is None or op.at >= since_at]


async def attempt_events(ledger: Ledger, checkpoint_id: str, *, head_seq: int | None = None) -> list[Event]:
    """The events of `attempt_rows`."""
    return [event_from_raw(row) for row in await attempt_rows(ledger, checkpoint_id, head_seq=head_seq)]


async def checked_attempt_events(
    ledger: Ledger, checkpoint_id: str
) -> tuple[list[Event], ChainVerdict, list[RawEvent]]:
    """The events of `attempt_rows`, the verdict of recomputing each one's hash from its content,
    and the stored rows themselves.

    The rows of one attempt are not consecutive: their links to the rows between them are not
    checked here (the verdict says so); `check_ledger` checks the whole chain.
    """
    from quiesce.tools.audit.check import ChainVerdict

    rows = await attempt_rows(ledger, checkpoint_id)
    problem = check_each(rows)
    verdict = ChainVerdict(
        "rows",
        problem is None,
        problem[0] if problem else None,
        problem[1] if problem else None,
        len(rows),
    )
    return [event_from_raw(row) for row in rows], verdict, rows


async def load_attempt(ledger: Ledger, checkpoint_id: str) -> tuple[AttemptView, list[Event]]:
    """The `AttemptView` of one attempt (`latest`: the newest) and the events it was built from
    (with context)."""
    from quiesce.tools.audit.attempts import build_attempt

    checkpoint_id = await resolve_attempt_id(ledger, checkpoint_id)
    events = await attempt_events(ledger, checkpoint_id)
    return build_attempt(checkpoint_id, events), events


async def recent_attempt_ids(ledger: Ledger, limit: int) -> list[str]:
    """Ids of the `limit` most recently started attempts, oldest first: the projection's order,
    the same as `quiesce history`'s (`Ledger.attempts`)."""
    if limit <= 0:
        return []
    return [r.checkpoint_id for r in await ledger.attempts(limit=limit)]


async def export_bundle(url: str, out: Path, checkpoint_id: str | None) -> ExportSummary:
    """Write the audit bundle of the ledger at `url` (or of one attempt; `latest`: the newest) to `out`.

    The head is read first and nothing after it is exported, so a bundle is a consistent prefix
    even while a coordinator appends. Written to a temporary file beside `out`, then renamed:
    a failed export leaves no partial bundle.
    """
    from quiesce.tools.audit.bundle import write_bundle

    async with open_readonly(url) as ledger:
        head = await ledger.head()
        head_seq, head_hash = (head.seq, head.hash) if head is not None else (0, GENESIS_HASH)
        if checkpoint_id is None:
            events: AsyncIterator[Event] = ledger.read()
        else:
            checkpoint_id = await resolve_attempt_id(ledger, checkpoint_id)
            events = _aiter(await attempt_events(ledger, checkpoint_id, head_seq=head_seq))
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            with tmp.open("w", encoding="utf-8") as stream:
                summary = await write_bundle(
                    stream, events, head_seq=head_seq, head_hash=head_hash, checkpoint=checkpoint_id
                )
                stream.flush()
                os.fsync(stream.fileno())
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
    return summary


async def _aiter(events: list[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def load_views(url: str, checkpoint_id: str | None, limit: int) -> list[AttemptView]:
    """Views of one attempt, or of the `limit` most recently started ones (oldest first)."""
    async with open_readonly(url) as ledger:
        ids = [checkpoint_id] if checkpoint_id is not None else await recent_attempt_ids(ledger, limit)
        return [(await load_attempt(ledger, cid))[0] for cid in ids]


async def cross_check(url: str, result: Verification) -> None:
    """Compare a verified bundle with the ledger at `url`, reading only the claimed seq ranges:
    every ledger row there must verify from its own content (its hash recomputed, each linked to
    the row before it), and every hash the bundle states (`result.claims`) must be the ledger's.
    Differences go to `result.ledger_problems`, each at the seq that shows it."""
    from quiesce.tools.audit.bundle import claim_ranges, compare_claims

    stored: dict[int, str] = {}
    async with open_readonly(url) as ledger:
        for first, last in claim_ranges(result.claims):
            rows: list[RawEvent] = []
            async for page in ledger.read_pages(after=first - 1, page_size=min(1000, last - first + 1)):
                rows.extend(r for r in page if int(r[0]) <= last)
                if int(page[-1][0]) >= last:
                    break
            for row in rows:
                stored[int(row[0])] = row[9]
            compare_claims(result, stored, rows=rows, span=(first, last))
