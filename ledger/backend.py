"""What the ledger needs from a database, and the append transaction shared by every backend.

A backend owns the connections. ``append`` runs ``apply_append`` inside one database transaction
whose commit order among every writer's equals seq order (SQLite ``BEGIN IMMEDIATE``; PostgreSQL
revision 0003's insert-at-head trigger with the seq key: a row goes in only right after the
committed head, and two sessions inserting the same seq commit one of them), and returns only
after the commit is durable at the configured level. Backends never interpret payloads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol, TypeAlias

from quiesce.ledger.errors import FencedError, LedgerError
from quiesce.ledger.events import Event
from quiesce.ledger.projections import COUNTED_KIND, UNTOUCHING_KINDS, AttemptRow, fold, touched
from quiesce.ledger.rollout_refs import REF_KINDS, rollout_ids

if TYPE_CHECKING:
    from sqlalchemy import Connection

#: A stored events row, columns in ``quiesce.ledger.layout.EVENT_COLUMNS`` order (``data`` as text).
RawEvent: TypeAlias = tuple[int, str, str, str | None, str | None, str | None, int, str, str, str]

#: Advisory lock key (PostgreSQL): the writer's session claim.
WRITER_LOCK_KEY = 0x7175_6965_7363_0001


class Batch(NamedTuple):
    """Events to append in one transaction; seq, chain hashes and projections precomputed.

    ``expected_last`` is the writer's cached head seq and ``epoch`` the writer's epoch: the
    transaction refuses (``FencedError``) when the stored head differs or carries a newer epoch.
    ``durable`` False (a write-behind batch): committed, so it survives a process crash, but not
    forced to disk; it is on disk no later than the next durable batch's commit (SQLite: the same
    WAL file, fsynced in order; PostgreSQL: WAL flushed up to a later commit record covers every
    earlier one), and when the ledger closes. Immutable (a tuple: built once per transaction, on
    the append path).
    """

    rows: list[RawEvent]
    events: list[Event]
    expected_last: int
    epoch: int
    where: str  # the ledger URL without password, for messages
    durable: bool = True


@dataclass(frozen=True, slots=True)
class LeaseState:
    """The lease row as stored, with the database clock's ``now`` read in the same statement.

    ``expires_at`` and ``now`` are Unix seconds on the database server's clock.
    """

    holder: str
    epoch: int
    expires_at: float
    now: float
    writer_pid: int | None = None

    @property
    def remaining_s(self) -> float:
        """Seconds until the lease expires (negative once it has)."""
        return self.expires_at - self.now


class Tx(Protocol):
    """The statements of an append, inside a transaction the backend opened."""

    def head(self) -> tuple[int, int] | None: ...  # (seq, epoch) of the last row
    def insert_after(self, last: int, rows: list[RawEvent]) -> bool:
        """Insert ``rows`` if the stored head seq is ``last`` (0: empty); False, inserting nothing, if not."""
        ...

    def get_attempt(self, checkpoint_id: str) -> tuple[AttemptRow, int] | None:
        """The stored row and how many ``call.sent`` events of its id, committed before this
        transaction's rows, follow its ``last_seq`` (None: no row)."""
        ...

    def put_attempt(self, row: AttemptRow, before: AttemptRow | None) -> None:
        """Store ``row``; ``before`` is the row stored under its checkpoint id now (None: none is)."""
        ...

    def put_refs(self, refs: list[tuple[str, int]]) -> None:
        """Insert ``rollout_refs`` rows ``(rollout_id, seq)`` (each new: its seq is being inserted)."""
        ...


def fenced_message(where: str, detail: str) -> str:
    return (
        f"ledger {where}: {detail}. Another coordinator or writer owns this ledger now; this one is fenced "
        "and must stop making calls. Start a new coordinator (it takes a new epoch and recovers)."
    )


#: What ``apply_append`` folded: the rows of the ids its events touched (None: no row), and per
#: id the ``call.sent`` events left uncounted after them (for an id it did not touch: its batch's).
Folded: TypeAlias = tuple[dict[str, AttemptRow | None], dict[str, int]]


class ProjectionCache:
    """The writer's copy of recently folded ``attempts`` rows, saving a read per append.

    ``rows[cid]`` is the stored row and ``sent[cid]`` (absent: 0) the committed ``call.sent``
    events of that id after its ``last_seq``, which the next event touching the row counts.
    Valid only for the writer that holds writership (no one else changes ``attempts``); updated
    only after a commit succeeded, cleared after any failure or a projection rebuild.
    """

    MAX_ROWS = 4096

    def __init__(self) -> None:
        self.rows: dict[str, AttemptRow] = {}
        self.sent: dict[str, int] = {}

    def committed(self, written: Folded) -> None:
        rows, sent = written
        if len(self.rows) + len(rows) > self.MAX_ROWS:
            self.clear()
        for cid, row in rows.items():
            if row is not None:
                self.rows[cid] = row
                self.sent[cid] = sent.get(cid, 0)
            else:
                self.rows.pop(cid, None)
                self.sent.pop(cid, None)
        for cid, n in sent.items():
            if cid not in rows and cid in self.rows:
                self.sent[cid] = self.sent.get(cid, 0) + n

    def record_alone(self, event: Event) -> None:
        """After a committed ``records_alone`` batch, per event: a ``call.sent`` waits in ``sent``
        for the next event touching its row (only for a cached row: an uncached one reads its own)."""
        cid = event.checkpoint_id
        if event.kind == COUNTED_KIND and cid is not None and cid in self.rows:
            self.sent[cid] = self.sent.get(cid, 0) + 1

    def clear(self) -> None:
        self.rows.clear()
        self.sent.clear()


assert not UNTOUCHING_KINDS & REF_KINDS, "a record alone names no rollout"


#: The most rows ``records_alone`` takes: one statement's host parameters (10 a row) stay far
#: below SQLite's limit (32,766).
RECORDS_ALONE_MAX: Final = 100


def records_alone(batch: Batch) -> bool:
    """Whether ``batch`` holds only ``call.sent`` and ``call.replied`` events (``UNTOUCHING_KINDS``),
    ``RECORDS_ALONE_MAX`` at most: they write no projection row and name no rollout, so their
    insert is the whole append, one statement (SQLite runs it in its own transaction, without
    BEGIN and COMMIT). The commonest appends: a recorded call's two, and a reply carried by the
    next request's record. The cache then takes each event through ``ProjectionCache.record_alone``."""
    events = batch.events
    if len(events) == 1:  # the commonest: one append, nothing staged before it
        return events[0].kind in UNTOUCHING_KINDS
    if len(events) > RECORDS_ALONE_MAX:
        return False
    return all(event.kind in UNTOUCHING_KINDS for event in events)


def refusal(head: tuple[int, int] | None, batch: Batch) -> FencedError:
    """Why the stored chain refused ``batch``, given its head ``(seq, epoch)`` (None: empty) read
    after the refusal: what the head is now, against the writer's view."""
    last, head_epoch = head if head is not None else (0, 0)
    if head_epoch > batch.epoch:
        detail = f"epoch {head_epoch} exists, newer than this writer's epoch {batch.epoch}"
    elif last != batch.expected_last:
        detail = f"its head is seq {last}, but this writer's last known seq is {batch.expected_last}"
    else:  # the seq is where this writer left it, the row there is not (the trigger checks the hash)
        detail = f"its head (seq {last}) is not the row this writer chained seq {last + 1} on"
    return FencedError(fenced_message(batch.where, detail))


def apply_append(tx: Tx, batch: Batch, cache: ProjectionCache) -> Folded:
    """Check the head, insert the rows, fold the projections: the body of every append transaction.

    Projections written in it: the ``attempts`` rows the events touch (``fold``) and the
    ``rollout_refs`` rows of its lineage events (``quiesce.ledger.rollout_refs.rollout_ids``); an
    event of any other kind costs one membership test there. A ``call.sent`` writes no row: it is
    counted (``fold``'s ``sent``) by the next event touching its row, in this batch or a later
    one — from the cache, or for a row not cached, from the events stored after its ``last_seq``
    (``Tx.get_attempt``). A recorded call is thus the events row and its index entry, nothing more.

    The head check is the insert's own condition: the rows go in only after the writer's last
    known seq. A head that matches is one this writer wrote or loaded, so its epoch was checked
    by the writer already; a newer epoch can only sit at a seq the writer does not know.

    Returns what was folded, for ``cache.committed`` once the transaction committed.
    """
    if not tx.insert_after(batch.expected_last, batch.rows):
        raise refusal(tx.head(), batch)
    pending: dict[str, AttemptRow | None] = {}
    # per id: the call.sent events of this batch not yet counted by a touching event
    sent: dict[str, int] = {}
    stored: dict[str, AttemptRow] = {}
    cached, cached_sent = cache.rows, cache.sent
    refs: list[tuple[str, int]] = []
    for event in batch.events:
        kind = event.kind
        if kind == COUNTED_KIND:
            cid = event.checkpoint_id
            if cid is not None:
                sent[cid] = sent.get(cid, 0) + 1
            continue
        if kind in REF_KINDS:
            seq = event.seq
            refs.extend((rollout_id, seq) for rollout_id in rollout_ids(kind, event.data))
        for cid in touched(event):
            if cid in pending:
                row = pending[cid]
                before = sent.pop(cid, 0)
            else:
                row = cached.get(cid)
                if row is not None:
                    before = cached_sent.get(cid, 0) + sent.pop(cid, 0)
                else:
                    got = tx.get_attempt(cid)
                    row, before = got if got is not None else (None, 0)
                    before += sent.pop(cid, 0)
                if row is not None:
                    stored[cid] = row
            pending[cid] = fold(row, event, cid, before)
    for cid, new in pending.items():
        if new is not None:
            tx.put_attempt(new, stored.get(cid))
    if refs:
        tx.put_refs(refs)
    return pending, sent


class InlineAppend(ABC):
    """A backend that can also commit on the calling thread, without awaiting (SQLite).

    The Ledger builds a batch for ``append_now`` only after ``can_append_now()`` said yes, so
    staged events are never taken into a batch that then goes unwritten.
    """

    @abstractmethod
    def can_append_now(self) -> bool:
        """Whether committing on the calling thread is cheap now."""

    @abstractmethod
    def append_now(self, batch: Batch) -> None:
        """Commit ``batch`` like ``Backend.append`` without leaving the calling thread; raises as it does."""


#: ``AttemptQuery.outcome`` for attempts without a terminal event yet (projection outcome NULL).
OPEN: Final = "open"


@dataclass(frozen=True, slots=True)
class AttemptQuery:
    """Which rows of the ``attempts`` projection: started at or after ``since`` (an ``Event.at``
    string), an exact ``outcome`` (one, several, or ``OPEN``), strictly before ``before`` in
    ``(started_at, checkpoint_id)`` order (a page's keyset), and with ``limit`` > 0 only the
    newest ``limit`` of those."""

    since: str | None = None
    outcome: str | tuple[str, ...] | None = None
    before: tuple[str, str] | None = None
    limit: int = 0


class Backend(ABC):
    """One open ledger database. Methods are called from one event loop; the Ledger serialises appends."""

    where: str
    #: "sqlite" or "postgresql": the key of the dialect's names (``quiesce.ledger.layout``)
    dialect: str

    @abstractmethod
    async def claim_writer(self) -> None:
        """Become the only writer for this process's lifetime, or raise ``FencedError``."""

    @abstractmethod
    async def run_schema(self, fn: Callable[[Connection], object]) -> object:
        """Run ``fn`` on a SQLAlchemy connection inside one transaction (migrations, schema checks)."""

    async def quick_revision(self) -> str | None:
        """The stored schema revision when it can be read cheaply (no alembic), else None.

        None never means "at head": the caller then runs the full alembic check."""
        return None

    @abstractmethod
    async def start(self) -> None:
        """Open the connections used for appends and reads (after the schema is at head)."""

    @abstractmethod
    async def append(self, batch: Batch) -> None:
        """Commit ``batch`` in one transaction (see ``apply_append``); durable when it returns
        (unless ``batch.durable`` is False: then committed, on disk by the next durable batch).

        Not cancellable: once called, it completes (or fails) before returning.
        """

    def staged(self) -> None:
        """The writer staged an event (``Ledger.stage``): a commit will carry it, so the writer is
        still at work. A hint for background upkeep (SQLite's); nothing to do by default."""
        return None

    def operation_ended(self) -> None:
        """The writer's operation has told its caller the outcome (``Ledger.sync``,
        ``Ledger.operation_ended``): background upkeep (SQLite's) may tend the database once the
        writer is quiet. Nothing to do by default."""
        return None

    @abstractmethod
    async def sync(self) -> None:
        """Every transaction committed so far is on disk when this returns (under durability
        "full"; a no-op under "process", which promises no more). It may run while appends go on:
        it holds up none of them. Raises ``LedgerError`` when the database cannot make it durable."""

    @abstractmethod
    async def event_triggers(self) -> frozenset[str]:
        """The names of the triggers defined on ``events`` (user triggers only)."""

    @abstractmethod
    async def head(self) -> RawEvent | None: ...

    @abstractmethod
    async def tail(self, rows: int) -> list[RawEvent]:
        """The last ``rows`` stored rows, in seq order."""

    @abstractmethod
    async def projection_last_seq(self) -> int | None:
        """The largest ``last_seq`` of the ``attempts`` projection (None when it is empty)."""

    @abstractmethod
    async def read_page(
        self, after: int, checkpoint_id: str | None, kinds: Sequence[str] | None, limit: int
    ) -> list[RawEvent]:
        """Up to ``limit`` rows with seq > ``after`` (and the filters), in seq order."""

    @abstractmethod
    async def read_last(self, kind: str, before: int) -> RawEvent | None:
        """The row of ``kind`` with the largest seq below ``before`` (through the (kind, seq) index)."""

    # -- the rollout_refs projection and the reads of one rollout's lineage -----------------------

    @abstractmethod
    async def rollout_ref_seqs(self, rollout_ids: Sequence[str]) -> list[int]:
        """The seqs ``rollout_refs`` holds for any of ``rollout_ids``, ascending, each once (one
        range of its key per rollout)."""

    @abstractmethod
    async def events_at(self, seqs: Sequence[int]) -> list[RawEvent]:
        """The rows at ``seqs`` (those that exist), in seq order (primary-key lookups)."""

    @abstractmethod
    async def checkpoint_rows(self, checkpoint_ids: Sequence[str], kinds: Sequence[str]) -> list[RawEvent]:
        """The rows of ``kinds`` of any of ``checkpoint_ids``, in seq order (``ix_events_checkpoint_id``)."""

    @abstractmethod
    async def first_in_ranges(
        self, kinds: Sequence[str], ranges: Sequence[tuple[int, int | None]]
    ) -> list[int | None]:
        """Per range ``(lo, hi)``: the smallest seq of an event of one of ``kinds`` (marker kinds)
        with ``lo < seq < hi`` (``hi`` None: no bound), or None; one marker-index lookup per kind
        and range, in one query."""

    @abstractmethod
    async def last_before_each(self, kind: str, seqs: Sequence[int]) -> list[int | None]:
        """Per seq: the largest seq below it of an event of ``kind`` (a marker kind), or None."""

    @abstractmethod
    async def rollout_refs_page(self, after: tuple[str, int] | None, limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` ``rollout_refs`` rows after the key ``after``, in key order."""

    @abstractmethod
    async def rollout_refs_between(self, lo: int, hi: int) -> list[tuple[str, int]]:
        """The ``rollout_refs`` rows with ``lo <= seq <= hi`` (a scan: for listing differences)."""

    @abstractmethod
    async def rebuild_rollout_refs(self) -> int:
        """Replace the whole ``rollout_refs`` table with the rows derived from ``events`` (writer
        only), in one transaction, reading the events that name rollouts a page at a time; returns
        the rows written."""

    @abstractmethod
    async def attempts(self, query: AttemptQuery) -> list[AttemptRow]:
        """Projection rows matching ``query``, ordered by ``started_at`` then id (oldest first);
        with ``query.limit``, the newest that many, read from the end of ``ix_attempts_started``."""

    @abstractmethod
    async def attempt(self, checkpoint_id: str) -> AttemptRow | None: ...

    @abstractmethod
    async def calls_after(self, marks: Sequence[tuple[str, int]]) -> list[int]:
        """Per ``(checkpoint_id, seq)``: how many ``call.sent`` events of that id have a larger seq
        (the calls its projection row does not count yet; one range of ``ix_events_checkpoint_id``)."""

    @abstractmethod
    async def unfinished_attempts(self) -> list[AttemptRow]:
        """Projection rows without an outcome, ordered by ``last_seq``: filtered in the database,
        so only unfinished rows are read back, whatever the length of the history."""

    @abstractmethod
    async def replace_attempts(self, rows: Sequence[AttemptRow]) -> None:
        """Replace the whole ``attempts`` table with ``rows`` in one transaction (writer only)."""

    @abstractmethod
    async def close(self) -> None:
        """Close connections and release the writer claim. Idempotent."""

    # -- the coordinator lease (PostgreSQL only; see quiesce.ledger.postgres) ---------------------------

    #: Whether this backend has the coordinator lease (a standby can take over from a holder).
    supports_lease: bool = False

    def _no_lease(self) -> LedgerError:
        return LedgerError(
            f"ledger {self.where}: a coordinator lease (standby takeover) needs a PostgreSQL ledger; "
            "SQLite has one writer per host and no standby"
        )

    async def lease_read(self, name: str) -> LeaseState | None:
        """The lease row ``name``, or None when there is none (or no lease table yet)."""
        raise self._no_lease()

    async def lease_take(self, name: str, holder: str, ttl_s: float, *, force: bool) -> LeaseState | None:
        """Take the lease for ``ttl_s`` when it is free, expired or already ``holder``'s (or ``force``).

        Returns the row after the statement (its ``holder`` says whether it was taken), or None
        when the database has no lease table yet (an empty database: nobody holds anything).
        """
        raise self._no_lease()

    async def lease_renew(self, name: str, holder: str, ttl_s: float, epoch: int) -> bool:
        """Extend ``holder``'s lease by ``ttl_s`` from now; False when ``holder`` no longer holds it."""
        raise self._no_lease()

    async def lease_release(self, name: str, holder: str) -> None:
        """Expire ``holder``'s lease now (a clean stop: a standby may take over at once)."""
        raise self._no_lease()

    async def end_writer_session(self, pid: int) -> bool:
        """End the database session ``pid`` if it holds the writer lock; True when one was ended."""
        raise self._no_lease()
