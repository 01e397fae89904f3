"""``Ledger``: the append-only, hash-chained event store.

Invariants:

- **Durable when it returns.** ``append``/``append_many``/``start_epoch`` return only after the
  transaction committed and is on disk (SQLite: the WAL fdatasynced, by default). A cancelled
  caller still waits for the commit to finish, so the writer's view of the head never goes
  stale. An append made with ``durable=False`` (write-behind) is committed when it returns but
  reaches the disk with the next durable append, which holds it too (commit order is seq
  order), or at close — at the latest (SQLite's WAL upkeep syncs it sooner once the writer has
  gone quiet after an operation's end: ``sync``, ``operation_ended``).
- **Staged events ride with the next commit.** ``stage`` validates and chains an event at once
  (its seq and hash are final) but writes nothing: it is committed at the front of the next
  transaction — the next append's, ``flush``, a read by this writer, or ``aclose`` — in seq
  order, and is as durable as that transaction (made durable by any event staged with
  ``durable=True``). Until then it lives only in this process, so a
  crash loses it, exactly as if the crash had come just before it. The committed ledger is
  therefore always a prefix of the chain. A failed transaction that carried staged events (or
  had some chained after it) loses them; the ledger then refuses every later append and stage
  (``LedgerError``): its owner must reopen it.
- **No appends onto a broken chain.** A writer's open verifies the end of the chain (the last
  ``TAIL_ROWS`` rows: consecutive seqs, each linked to the one before, each hash recomputed from
  the row) and that the ``attempts`` projection records no seq past the stored head (which would
  mean rows removed from the end); otherwise it raises ``BrokenChainError`` naming the first bad
  seq and the command that checks the whole chain. It reads only the end, so a ledger of any
  length opens as fast as a short one; ``replay --verify`` and ``quiesce check`` verify it all.
- **One writer.** A non-readonly open claims writership for the ledger's lifetime (see the
  backend modules) or raises ``FencedError``. Every append transaction also checks that the stored
  head is still the writer's last append and that no newer epoch exists; otherwise it raises
  ``FencedError`` and the ledger refuses every later append: the owner must stop acting.
- **Epochs never go down along seq.** ``start_epoch`` appends ``coordinator.started`` with epoch =
  head's epoch + 1 (the largest in the ledger) and makes it this writer's epoch. Until then
  ``ledger.epoch`` is 0, so a writer that never started an epoch can append only to a ledger that
  has none.
- **What is stored is redacted and capped** (``quiesce.ledger.redact``) before it is hashed; ``Event.data``
  returned by ``append`` is exactly what was stored.
- Appends from concurrent tasks of one event loop are serialised; a Ledger belongs to one loop.
- ``after_append`` (optional hook, set at open or as an attribute) is called with the events of
  each append once they are durable, before the append returns; a staged event gets its own call
  once the transaction that carries it committed, before that transaction's own events — the
  coordinator's test-only crash points hang off it. The ledger itself never interprets it.
- **The coordinator lease** (PostgreSQL; ``LeaseTerms``): a writer opened with ``lease=`` takes
  the lease row once it holds writership and keeps it while ``renew_lease`` is called in time. A
  ``standby`` open first waits until the holder's lease has expired (database clock), takes it,
  ends the old holder's writer session (``pg_terminate_backend``: a stopped process loses its
  connection and with it the writer lock), then claims writership. A lease renewal that finds
  another holder fences this ledger like a ``FencedError``. On SQLite ``standby`` is refused.
  A lease holder also checks its lease on its own monotonic clock: once ``ttl_s`` has passed since
  the start of its last successful take or renewal, it fences itself — before an append, and
  after one commits (so a ``call.sent`` written just before a stop, e.g. SIGSTOP, is never
  followed by its request once a standby may have taken over).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio
import anyio.lowlevel

from quiesce.ledger.backend import AttemptQuery, Backend, Batch, InlineAppend, LeaseState, RawEvent
from quiesce.ledger.canonical import GENESIS_HASH, next_hash
from quiesce.ledger.chain import check_rows, truncation
from quiesce.ledger.errors import BrokenChainError, FencedError, LedgerError, require_extra
from quiesce.ledger.events import COLUMN_RULES, KINDS, AppendItem, Event, event_from_raw, new_event
from quiesce.ledger.layout import APPEND_ONLY_TRIGGERS, HEAD_REVISION, indexed_kind
from quiesce.ledger.projections import AttemptRow, replace
from quiesce.ledger.redact import Redactor
from quiesce.ledger.urls import SQLITE_PREFIX, parse, plain_sqlite_path, safe

if TYPE_CHECKING:
    from pydantic import BaseModel

#: The columns each kind must name (``COLUMN_RULES`` resolved per kind, once).
_REQUIRED: dict[str, tuple[str, ...]] = {
    kind: tuple(name for prefix, names in COLUMN_RULES.items() if kind.startswith(prefix) for name in names)
    for kind in KINDS
}

Durability = Literal["full", "process"]
PAGE_SIZE = 1000
#: Rows at the end of the chain a writer's open verifies (several attempts' worth).
TAIL_ROWS = 256
#: Called with the events of each append once they are durable (see the module docstring).
AfterAppend = Callable[[Sequence[Event]], None]


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """How a writer holds the coordinator lease (PostgreSQL; ignored on SQLite unless ``standby``).

    ``holder`` must be unique per process (e.g. host, pid and a uuid). ``ttl_s`` is how long one
    renewal keeps the lease; the holder renews well within it. ``standby`` waits for the current
    holder's lease to expire before taking over. ``poll_s`` bounds how long a standby sleeps
    between looks at the lease.
    """

    holder: str
    ttl_s: float = 10.0
    standby: bool = False
    poll_s: float = 0.25
    name: str = "coordinator"


_second_cache: list[Any] = [-1, ""]


def utc_now() -> str:
    """UTC ISO-8601 with microseconds and a ``Z``: the format of ``Event.at``."""
    seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
    if seconds != _second_cache[0]:
        _second_cache[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second_cache[0] = seconds
    return f"{_second_cache[1]}.{micros:06d}Z"


def make_backend(url: str, *, durability: Durability = "full", readonly: bool = False) -> Backend:
    """The backend for ``url`` (not yet connected)."""
    path = plain_sqlite_path(url)
    if path is not None:  # the common SQLite form, read without importing SQLAlchemy
        from quiesce.ledger.sqlite import SqliteBackend

        driver_url = SQLITE_PREFIX + path
        return SqliteBackend(driver_url, where=driver_url, durability=durability, readonly=readonly)
    backend_name, parsed = parse(url)
    where = safe(parsed)
    if backend_name == "sqlite":
        from quiesce.ledger.sqlite import SqliteBackend

        return SqliteBackend(parsed, where=where, durability=durability, readonly=readonly)
    require_extra("asyncpg", extra="postgres", needed_by=f"the PostgreSQL ledger {where}")
    from quiesce.ledger.postgres import PostgresBackend

    return PostgresBackend(parsed, where=where, durability=durability, readonly=readonly)


async def upgrade_schema(url: str) -> tuple[str | None, str]:
    """``quiesce db upgrade``: bring the schema to head; returns (revision before, revision after).

    Claims writership for the duration, so no coordinator writes while the schema changes.
    A schema ahead of this code is refused (``LedgerError``).
    """
    backend = make_backend(url)
    try:
        await backend.claim_writer()
        from quiesce.ledger import migrate  # alembic: loaded only when the schema is checked or changed

        result = await backend.run_schema(migrate.upgrade_sync)
    finally:
        await backend.close()
    assert isinstance(result, tuple)
    return cast("tuple[str | None, str]", result)


async def restore_triggers(url: str) -> list[str]:
    """``quiesce db upgrade``, after the upgrade: recreate the append-only triggers missing from
    the ledger at ``url`` (at head); returns their names. Claims writership for the duration."""
    backend = make_backend(url)
    try:
        await backend.claim_writer()
        from quiesce.ledger import migrate

        result = await backend.run_schema(migrate.restore_triggers_sync)
    finally:
        await backend.close()
    assert isinstance(result, list)
    return cast("list[str]", result)


async def downgrade_schema(url: str, revision: str) -> None:
    """Downgrade the schema to ``revision`` (``"base"`` drops the ledger's tables). Tests and emergencies."""
    backend = make_backend(url)
    try:
        await backend.claim_writer()
        from quiesce.ledger import migrate

        await backend.run_schema(lambda conn: migrate.downgrade_sync(conn, revision))
    finally:
        await backend.close()


class _Encoded:
    __slots__ = ("call_id", "checkpoint_id", "data", "kind", "server", "text")

    def __init__(
        self,
        kind: str,
        checkpoint_id: str | None,
        server: str | None,
        call_id: str | None,
        data: Any,
        text: str,
    ) -> None:
        self.kind = kind
        self.checkpoint_id = checkpoint_id
        self.server = server
        self.call_id = call_id
        self.data = data
        self.text = text


def _others_ready() -> bool:
    """Whether other callbacks wait to run in this asyncio loop (unknown loops: assume so)."""
    try:
        ready = asyncio.get_running_loop()._ready  # type: ignore[attr-defined]
    except (RuntimeError, AttributeError):
        return True
    return len(ready) > 0


class _Waiter:
    """One append waiting in the group-commit queue."""

    __slots__ = ("done", "durable", "error", "events", "items", "lead")

    def __init__(self, items: list[_Encoded], durable: bool) -> None:
        self.items = items
        self.durable = durable
        self.done = anyio.Event()
        self.lead = False
        self.events: list[Event] = []
        self.error: BaseException | None = None


class Ledger:
    """An open ledger. Create with ``Ledger.open(url)`` (async context manager) or ``Ledger.connect``."""

    def __init__(self, backend: Backend, *, where: str, secrets: Sequence[str], readonly: bool) -> None:
        self._backend = backend
        #: the backend again when it can commit on this thread (``InlineAppend``), else None
        self._inline = backend if isinstance(backend, InlineAppend) else None
        self.url = where  #: the ledger URL with any password hidden
        self.readonly = readonly
        self._redactor = Redactor(secrets)
        self._validate: Callable[[str, Any], tuple[Any, bool]] | None = None
        self._secrets = tuple(s for s in secrets if s)
        self._lock = anyio.Lock(fast_acquire=True)
        self._queue: list[_Waiter] = []
        self._leading = False
        # the committed head: the last stored row as this writer knows it
        self._last_seq = 0
        self._last_hash = GENESIS_HASH
        self._head_epoch = 0
        # the chain's tail: the last event chained (committed, being committed, or staged)
        self._tail_seq = 0
        self._tail_hash = GENESIS_HASH
        self._staged: list[tuple[RawEvent, Event]] = []
        self._staged_durable = False  # a staged event asked for a durable transaction
        self._lost: LedgerError | None = None
        self._fenced: FencedError | None = None
        self._stale = False
        self._closed = False
        self._lease: LeaseTerms | None = None
        self._lease_until = 0.0  # monotonic: the lease is surely ours until then
        #: This writer's epoch: 0 until ``start_epoch``; written into every appended row.
        self.epoch = 0
        #: The hash of this writer's ``coordinator.started`` ("" until ``start_epoch``): it covers
        #: the event's time and payload, so two writers that open copies of one ledger (a backup
        #: and its original) at the same epoch still differ here.
        self.epoch_hash = ""
        #: Called with each append's events once durable (see the module docstring).
        self.after_append: AfterAppend | None = None
        #: After a standby takeover: the lease of the holder it replaced (None otherwise).
        self.took_over_from: LeaseState | None = None
        #: Called after each transaction this writer commits with (seconds it took, rows written);
        #: an observer (``quiesce serve``'s metrics) — the ledger never interprets it.
        self.on_commit: Callable[[float, int], None] | None = None

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        durability: Durability = "full",
        secrets: Sequence[str] = (),
        readonly: bool = False,
        lease: LeaseTerms | None = None,
        after_append: AfterAppend | None = None,
        verify_tail: bool = True,
    ) -> Ledger:
        """Open the ledger at ``url``; the caller must ``await ledger.aclose()``.

        A writer (not ``readonly``) claims writership first, then creates an empty database at
        the schema head. A schema behind or ahead of this code is refused with ``LedgerError``.
        With ``lease`` (PostgreSQL) the writer then holds the coordinator lease; a ``standby``
        lease waits for the current holder's lease to expire first (see the module docstring).
        """
        if durability not in ("full", "process"):
            raise LedgerError(f"durability must be 'full' or 'process', not {durability!r}")
        backend = make_backend(url, durability=durability, readonly=readonly)
        where = backend.where
        if lease is not None and (readonly or not backend.supports_lease):
            if lease.standby:
                await backend.close()
                raise LedgerError(
                    f"ledger {where}: a standby coordinator needs a writable PostgreSQL ledger"
                    " (postgresql+asyncpg://...); with SQLite run one coordinator per ledger, without standby"
                )
            lease = None
        ledger = cls(backend, where=where, secrets=secrets, readonly=readonly)
        ledger.after_append = after_append
        try:
            if lease is not None and lease.standby:
                await ledger._take_over(lease)
            elif not readonly:
                await backend.claim_writer()
            if await backend.quick_revision() != HEAD_REVISION:
                from quiesce.ledger import migrate

                await backend.run_schema(
                    lambda conn: migrate.ensure_schema_sync(conn, url=where, create=not readonly)
                )
            await backend.start()
            await ledger._load_head()
            if not readonly and verify_tail:
                await ledger._verify_tail()  # a broken chain is named first: it says where
            if not readonly:
                await ledger._check_triggers()
            if lease is not None:
                asked = time.monotonic()
                await backend.lease_take(lease.name, lease.holder, lease.ttl_s, force=True)
                ledger._lease, ledger._lease_until = lease, asked + lease.ttl_s
        except BaseException:
            with anyio.CancelScope(shield=True):
                await backend.close()
            raise
        return ledger

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        *,
        durability: Durability = "full",
        secrets: Sequence[str] = (),
        readonly: bool = False,
        lease: LeaseTerms | None = None,
        after_append: AfterAppend | None = None,
        verify_tail: bool = True,
    ) -> AsyncIterator[Ledger]:
        """``async with Ledger.open(url) as ledger:`` — see ``connect``; closed (and writership
        and any lease released) on exit."""
        ledger = await cls.connect(
            url,
            durability=durability,
            secrets=secrets,
            readonly=readonly,
            lease=lease,
            after_append=after_append,
            verify_tail=verify_tail,
        )
        try:
            yield ledger
        finally:
            await ledger.aclose()

    async def aclose(self) -> None:
        """Commit any staged events, close the connections and release writership (and the
        lease, if held). Idempotent. A failure to commit the staged events is raised once closed,
        except that a fenced writer (its lease ran out) writes nothing and drops them quietly."""
        if not self._closed:
            try:
                with anyio.CancelScope(shield=True):
                    await self._flush_staged()
            except FencedError:
                pass
            finally:
                self._closed = True
                await self._close_backend()

    async def _close_backend(self) -> None:
        with anyio.CancelScope(shield=True):
            lease, self._lease = self._lease, None
            if lease is not None and self._fenced is None:
                with contextlib.suppress(LedgerError, OSError), anyio.move_on_after(2.0):
                    await self._backend.lease_release(lease.name, lease.holder)
            await self._backend.close()

    # -- the coordinator lease ---------------------------------------------------------------------

    async def _take_over(self, terms: LeaseTerms) -> None:
        """Standby: wait for the holder's lease to expire, take it, end its writer session, claim."""
        backend = self._backend
        while True:
            while True:
                before = await backend.lease_read(terms.name)
                taken = await backend.lease_take(terms.name, terms.holder, terms.ttl_s, force=False)
                if taken is None or taken.holder == terms.holder:
                    break  # no lease table yet (nobody to wait for), or the lease is ours now
                await anyio.sleep(min(terms.poll_s, max(taken.remaining_s, 0.0) + 0.01))
            self.took_over_from = before if before is not None and before.holder != terms.holder else None
            if self.took_over_from is not None and self.took_over_from.writer_pid is not None:
                await backend.end_writer_session(self.took_over_from.writer_pid)
            try:
                await backend.claim_writer()
                return
            except FencedError:
                # a live writer that is not the expired holder (it just started and will take the
                # lease itself): keep waiting as a standby
                await anyio.sleep(terms.poll_s)

    @property
    def lease(self) -> LeaseTerms | None:
        """The lease this writer holds (None on SQLite, readonly, or without ``lease=``)."""
        return self._lease

    async def lease_state(self) -> LeaseState | None:
        """The lease row as stored now (None without a lease)."""
        if self._lease is None:
            return None
        return await self._backend.lease_read(self._lease.name)

    async def read_lease(self, name: str = "coordinator") -> LeaseState | None:
        """The lease row ``name`` as stored now, whoever holds it; any open ledger may ask (a
        readonly one too: a standby names the active holder this way). None on SQLite, which has
        no lease, or when nobody ever took it."""
        if not self._backend.supports_lease:
            return None
        return await self._backend.lease_read(name)

    @property
    def writable(self) -> bool:
        """Whether this writer may still append: open, not readonly, not fenced, no lost staged
        event, and (with a lease) the lease not run out on this writer's own clock. Asks nothing of
        the database; an append may still find a newer epoch and raise ``FencedError``."""
        try:
            self._check_writable()
        except LedgerError:
            return False
        return True

    async def renew_lease(self) -> bool:
        """Extend this writer's lease by its ``ttl_s``. True without a lease.

        False when another holder has taken it: the ledger is then fenced (every later append
        raises ``FencedError``) and its owner must stop acting. Database errors raise ``LedgerError``.
        """
        lease = self._lease
        if lease is None:
            return True
        if self._fenced is not None:
            return False
        asked = time.monotonic()
        if await self._backend.lease_renew(lease.name, lease.holder, lease.ttl_s, self.epoch):
            self._lease_until = asked + lease.ttl_s
            return True
        self._fenced = FencedError(
            f"ledger {self.url}: the coordinator lease was taken over by another coordinator (this one"
            " did not renew it in time); this coordinator is fenced and must stop making calls"
        )
        return False

    @property
    def fenced_error(self) -> FencedError | None:
        """Why this writer may no longer append (a newer epoch, or its lease taken), once it may not."""
        return self._fenced

    @property
    def backend(self) -> Backend:
        """The database backend (for ``quiesce.ledger.replay``; not for callers outside ``ledger``)."""
        return self._backend

    async def _load_head(self) -> None:
        raw = await self._backend.head()
        if raw is None:
            self._last_seq, self._last_hash, self._head_epoch = 0, GENESIS_HASH, 0
        else:
            self._last_seq, self._last_hash, self._head_epoch = int(raw[0]), raw[9], int(raw[6])
        self._tail_seq, self._tail_hash = self._last_seq, self._last_hash
        self._stale = False

    async def _check_triggers(self) -> None:
        """Refuse to write to a ledger whose append-only triggers were dropped: its database would
        no longer stop a row from being changed or removed."""
        expected = APPEND_ONLY_TRIGGERS[self._backend.dialect]
        missing = sorted(set(expected) - await self._backend.event_triggers())
        if missing:
            url = self.url
            raise LedgerError(
                f"ledger {url}: the append-only trigger{'s' if len(missing) > 1 else ''} "
                f"{', '.join(missing)} on its events table {'are' if len(missing) > 1 else 'is'} missing"
                " (dropped by hand?), so the database no longer stops rows from being changed or removed;"
                " nothing was written. Verify the chain and the projections with"
                f" `quiesce replay --verify --ledger {url}` (and compare its head with an audit bundle"
                f" kept elsewhere), then restore the triggers with `quiesce db upgrade --ledger {url}`"
            )

    async def _verify_tail(self) -> None:
        """Refuse (``BrokenChainError``) a ledger whose chain is broken at its end (module docstring)."""
        rows = await self._backend.tail(TAIL_ROWS)
        problem = None
        head = 0
        if rows:
            head = int(rows[-1][0])
            problem = check_rows(rows, (0, GENESIS_HASH) if int(rows[0][0]) <= 1 else None)
        if problem is None:
            problem = truncation(head, await self._backend.projection_last_seq())
        if problem is not None:
            seq, what = problem
            raise BrokenChainError(
                f"ledger {self.url}: the hash chain is broken at seq {seq}: {what}. A coordinator does not"
                f" append to a ledger whose history it cannot trust. `quiesce replay --verify --ledger"
                f" {self.url}` shows where the whole chain breaks; keep this file as evidence and start a"
                " new ledger (or restore the ledger from a good copy)",
                seq,
            )

    # -- writing -------------------------------------------------------------------------------

    def _encode(
        self, kind: str, checkpoint_id: str | None, server: str | None, call_id: str | None, data: Any
    ) -> _Encoded:
        required = _REQUIRED.get(kind)
        if required is None:
            raise LedgerError(f"unknown event kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")
        if required and (checkpoint_id is None or server is None or call_id is None):
            given = {"checkpoint_id": checkpoint_id, "server": server, "call_id": call_id}
            missing = [name for name in required if given[name] is None]
            if missing:
                raise LedgerError(f"a {kind} event needs {' and '.join(missing)}")
        validate = self._validate
        if validate is None:
            # the payload models (pydantic): loaded by the first append, so readers never build them
            from quiesce.ledger.payloads import validate_plain

            validate = self._validate = validate_plain
        obj, plain = validate(kind, data)
        try:
            stored, text = self._redactor.encode(obj, plain=plain)
        except (ValueError, TypeError) as error:
            raise LedgerError(f"invalid {kind} payload: not storable as JSON ({error})") from None
        if self._secrets:
            checkpoint_id, server, call_id = self._redactor.columns(checkpoint_id, server, call_id)
        return _Encoded(kind, checkpoint_id, server, call_id, stored, text)

    def _check_writable(self) -> None:
        if self._closed:
            raise LedgerError(f"ledger {self.url} is closed")
        if self.readonly:
            raise LedgerError(f"ledger {self.url} was opened readonly; it cannot append")
        if self._fenced is not None:
            raise FencedError(str(self._fenced))
        if self._lost is not None:
            raise self._lost
        self._check_lease()

    def _check_lease(self) -> None:
        if self._lease is not None and time.monotonic() >= self._lease_until:
            self._fenced = FencedError(
                f"ledger {self.url}: this coordinator's lease ran out (not renewed within"
                f" {self._lease.ttl_s:g}s — the process was stopped or starved); a standby may have taken"
                " over, so this coordinator is fenced and must stop making calls"
            )
            raise FencedError(str(self._fenced))

    async def _commit(
        self, items: list[_Encoded], *, new_epoch: bool = False, durable: bool = True
    ) -> list[Event]:
        """Group commit: appends that are waiting at the same time share one transaction.

        A lone append (nothing queued or committing, no other callback ready in the loop) commits
        at once: without awaiting when the backend can commit without a thread hop, else as the
        lead of an empty queue without a waiter of its own (``_commit_alone``). Otherwise
        the first append to arrive leads: it yields once when other callbacks are ready to run
        in the loop (so appends that are ready join it; a lone append does not pay for a loop
        iteration), then commits everything queued in one transaction, and hands the lead to the oldest
        append still queued. Every append still returns only once its own events are committed
        (and durable, unless every append of the transaction is write-behind), in queue order
        (= seq order), with ``after_append`` called per append; a failed transaction fails every
        append in it. Concurrent fan-out thus costs one fsync per batch, not per event.
        """
        self._check_writable()
        if new_epoch:
            return (await self._commit_groups([items], durable=True, new_epoch=True))[0]
        events = self._try_now(items, durable)
        if events is not None:
            return events
        if self._lone():  # alone, but the backend cannot commit on this thread now
            events = await self._commit_alone(items, durable)
            self._check_lease()  # committed, but a caller must not act on it once the lease ran out
            return events
        waiter = _Waiter(items, durable)
        self._queue.append(waiter)
        with anyio.CancelScope(shield=True):  # queued items are committed whatever happens
            if self._leading:
                await waiter.done.wait()
            else:
                self._leading = True
                waiter.lead = True
            if waiter.lead:
                group: list[_Waiter] = []
                try:
                    if _others_ready():
                        await anyio.lowlevel.checkpoint()  # let appends that are ready join
                    group, self._queue = self._queue, []
                    try:
                        results = await self._commit_groups(
                            [w.items for w in group], durable=any(w.durable for w in group)
                        )
                    except BaseException as error:
                        for w in group:
                            w.error = error
                    else:
                        for w, events in zip(group, results, strict=True):
                            w.events = events
                finally:
                    for w in group:
                        if w is not waiter:
                            w.done.set()
                    self._pass_lead()
        if waiter.error is not None:
            raise waiter.error
        self._check_lease()  # committed, but a caller must not act on it once the lease ran out
        return waiter.events

    def _try_now(self, items: list[_Encoded], durable: bool) -> list[Event] | None:
        """Commit ``items`` on this thread, without awaiting, when the append is alone (``_lone``)
        and the backend can commit inline now; None (nothing chained or written) otherwise. The
        caller has just checked that this writer may write (nothing awaited since)."""
        backend = self._inline
        if backend is None or backend is not self._backend:
            return None  # (a backend swapped in after opening takes the awaiting path)
        if not self._lone() or not backend.can_append_now():
            return None
        batch, carried = self._batch(items, durable=durable, new_epoch=False)
        if not batch.rows:
            return []
        observed = self.on_commit is not None
        began = time.perf_counter() if observed else 0.0
        try:
            backend.append_now(batch)
        except BaseException as error:
            self._commit_failed(error, carried)
            raise
        took = time.perf_counter() - began if observed else 0.0
        done = self._committed(batch, carried, [items], new_epoch=False)[0]
        if observed:
            self._observe_commit(took, len(batch.rows))
        self._check_lease()  # committed, but a caller must not act on it once the lease ran out
        return done

    def _lone(self) -> bool:
        """Whether an append would be alone now: nothing queued, leading, stale or holding the
        lock, and no other callback ready in the loop to join it."""
        return not (self._leading or self._queue or self._stale or self._lock.locked() or _others_ready())

    async def _commit_alone(self, items: list[_Encoded], durable: bool) -> list[Event]:
        """Commit a lone append at once: the lead of an empty queue, without a waiter of its own.

        The caller has just checked, without awaiting since, that nothing is queued, leading or
        holding the lock and that this writer may write. It leads (appends that arrive meanwhile
        queue behind it, and the oldest of them leads their group once this commit is done) and
        holds the lock while the backend commits. The only await is ``Backend.append``, which is
        not cancellable, so a cancellation of the caller reaches it after this returns, with its
        events committed — as for an append in a group.
        """
        self._leading = True
        self._lock.acquire_nowait()
        try:
            return (await self._write([items], durable=durable, new_epoch=False))[0]
        finally:
            self._lock.release()
            self._pass_lead()

    def _pass_lead(self) -> None:
        """After a lead's commit: the oldest queued append leads next, or nobody leads."""
        if self._queue:
            self._queue[0].lead = True
            self._queue[0].done.set()
        else:
            self._leading = False

    def _commit_failed(self, error: BaseException, carried: int) -> None:
        """After a backend commit raised ``error``: a ``FencedError`` fences this writer for good;
        any other failure leaves the commit's outcome unknown, so the head is re-read before the
        next one. The caller re-raises.

        Staged events lost with the failure — ``carried`` by it, or chained after it meanwhile —
        make the ledger refuse every later append (see the module docstring)."""
        lost = carried + len(self._staged)
        self._staged, self._staged_durable = [], False
        if isinstance(error, FencedError):
            self._fenced = error
            return
        self._stale = True
        if lost and self._lost is None:
            # named in every later refusal too: the append that failed is not the one told
            cause = str(error) if isinstance(error, LedgerError) else type(error).__name__
            self._lost = LedgerError(
                f"ledger {self.url}: an append failed ({cause}) and {lost} staged"
                f" event{'' if lost == 1 else 's'} of this writer {'was' if lost == 1 else 'were'}"
                " lost with it; close and reopen the ledger (a new coordinator recovers from the"
                " servers' own state)"
            )

    def _batch(self, items: list[_Encoded], *, durable: bool, new_epoch: bool) -> tuple[Batch, int]:
        """The staged events, then ``items`` chained after them: one transaction's batch (nothing
        is written), and how many staged events it carries. The chain's tail moves past it."""
        epoch = self._head_epoch + 1 if new_epoch else self.epoch
        rows, events = self._chain(items, epoch)
        carried = len(self._staged)
        if carried:
            rows = [row for row, _ in self._staged] + rows
            events = [event for _, event in self._staged] + events
            durable = durable or self._staged_durable
            self._staged, self._staged_durable = [], False
        batch = Batch(rows, events, self._last_seq, epoch, self.url, durable)
        return batch, carried

    def _chain(self, items: list[_Encoded], epoch: int) -> tuple[list[RawEvent], list[Event]]:
        """Number and chain ``items`` after the chain's tail, which moves past them."""
        if epoch < self._head_epoch:
            raise FencedError(
                f"ledger {self.url}: epoch {self._head_epoch} exists, newer than this writer's epoch "
                f"{epoch}. Call start_epoch() before appending to a ledger another coordinator wrote; "
                "a coordinator "
                "that was already running is fenced and must stop making calls."
            )
        at = utc_now()
        seq, prev = self._tail_seq, self._tail_hash
        rows: list[RawEvent] = []
        events: list[Event] = []
        for item in items:
            seq += 1
            kind, cid, server, call_id, text = (item.kind, item.checkpoint_id, item.server, item.call_id,
                                                item.text)  # fmt: skip
            unhashed = (seq, at, kind, cid, server, call_id, epoch, text, prev)
            digest = next_hash(unhashed)
            rows.append((*unhashed, digest))
            events.append(new_event(seq, at, kind, cid, server, call_id, epoch, item.data, prev, digest))
            prev = digest
        self._tail_seq, self._tail_hash = seq, prev
        return rows, events

    def _committed(
        self, batch: Batch, carried: int, groups: list[list[_Encoded]], *, new_epoch: bool
    ) -> list[list[Event]]:
        """Advance the writer's head past ``batch`` (committed) and split its events per group
        (after the ``carried`` staged events, each of which is its own group for ``after_append``)."""
        last = batch.events[-1]
        self._last_seq, self._last_hash, self._head_epoch = last.seq, last.hash, batch.epoch
        if new_epoch:
            self.epoch = batch.epoch
        if not carried and len(groups) == 1:  # the commonest: one append, nothing staged before it
            if self.after_append is not None:
                self.after_append(batch.events)
            return [batch.events]
        if self.after_append is not None:
            for event in batch.events[:carried]:
                self.after_append([event])
        out: list[list[Event]] = []
        start = carried
        for group in groups:
            out.append(batch.events[start : start + len(group)])
            start += len(group)
            if self.after_append is not None:
                self.after_append(out[-1])
        return out

    async def _commit_groups(
        self, groups: list[list[_Encoded]], *, durable: bool, new_epoch: bool = False
    ) -> list[list[Event]]:
        """Chain and commit the items of ``groups`` in one transaction; their events, per group."""
        self._check_writable()
        async with self._lock:
            self._check_writable()
            if self._stale:
                with anyio.CancelScope(shield=True):
                    await self._load_head()
            return await self._write(groups, durable=durable, new_epoch=new_epoch)

    async def _write(
        self, groups: list[list[_Encoded]], *, durable: bool, new_epoch: bool
    ) -> list[list[Event]]:
        """Chain the staged events and ``groups`` and commit them in one backend transaction; their
        events, per group. The caller holds the lock (nothing else commits meanwhile)."""
        batch, carried = self._batch(
            [item for group in groups for item in group], durable=durable, new_epoch=new_epoch
        )
        if not batch.rows:
            return [[] for _ in groups]
        observed = self.on_commit is not None
        began = time.perf_counter() if observed else 0.0
        try:
            await self._backend.append(batch)  # shields itself while it awaits
        except BaseException as error:
            self._commit_failed(error, carried)
            raise
        took = time.perf_counter() - began if observed else 0.0
        done = self._committed(batch, carried, groups, new_epoch=new_epoch)
        if observed:
            self._observe_commit(took, len(batch.rows))
        return done

    def _observe_commit(self, seconds: float, rows: int) -> None:
        """Tell ``on_commit`` (if set) about a committed transaction; its failure changes nothing here."""
        if self.on_commit is not None:
            with contextlib.suppress(Exception):
                self.on_commit(seconds, rows)

    async def append(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
        durable: bool = True,
    ) -> Event:
        """Validate, redact, chain and commit one event; durable when it returns.

        ``durable=False`` makes it write-behind: committed when it returns (it survives a crash of
        this process, and readers see it), but on disk only with the next durable append or when
        the ledger closes. Use it only for an event that no outside action waits on — one that
        is always followed by a durable append before the next call, rename or reply to a user.

        Once called it runs to completion: a cancellation of the calling task does not interrupt
        it (the commit is shielded) and reaches the task at its next checkpoint after it returns.

        Raises ``LedgerError`` for an unknown kind or an invalid payload (nothing is written) and
        ``FencedError`` when another writer owns the ledger.
        """
        items = [self._encode(kind, checkpoint_id, server, call_id, data)]
        self._check_writable()
        done = self._try_now(items, durable)  # ``_commit``'s first step, without its coroutine
        if done is None:
            done = await self._commit(items, durable=durable)
        return done[0]

    async def append_many(self, items: Sequence[AppendItem], *, durable: bool = True) -> list[Event]:
        """Commit ``items`` in one transaction (consecutive seqs).

        All are committed (and durable, unless ``durable=False``: see ``append``) when it
        returns, or none was written.
        """
        if not items:
            return []
        encoded = [self._encode(i.kind, i.checkpoint_id, i.server, i.call_id, i.data) for i in items]
        return await self._commit(encoded, durable=durable)

    async def stage(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
        durable: bool = False,
    ) -> Event:
        """Validate, redact and chain one event now; commit it with the next transaction.

        The returned event is final (seq, hash, stored data). Nothing is written: the event is
        committed at the front of the next append's transaction (in seq order, and as durable as
        that append), or by ``flush``, a read through this ledger, or ``aclose``. A crash before
        then loses it. Use it only for an event whose loss would leave the ledger as if the
        process had died just before it — an outcome, a phase boundary — and never for one an
        outside action must follow (a ``call.sent`` before its request, a record before a
        rename): such an action is preceded by an append, which carries every staged event.

        ``durable=True`` makes the transaction that carries it durable, even when the append it
        rides with is write-behind: for an event that must be on disk before the action that
        follows the *next* append (``attempt.started``, before the attempt's first request), at
        the price of no transaction of its own.

        Raises like ``append`` for an invalid event, or when the ledger is fenced.
        """
        encoded = self._encode(kind, checkpoint_id, server, call_id, data)
        self._check_writable()
        if self._stale:  # the head is unknown after a failed commit: read it before chaining on it
            async with self._lock:
                if self._stale:
                    with anyio.CancelScope(shield=True):
                        await self._load_head()
            self._check_writable()
        rows, events = self._chain([encoded], self.epoch)
        self._staged.append((rows[0], events[0]))
        self._staged_durable = self._staged_durable or durable
        self._backend.staged()
        return events[0]

    async def flush(self) -> None:
        """Commit every event staged before this call (write-behind: see ``append``).

        Returns at once when nothing is staged or being committed.
        """
        if self._staged or self._leading or self._lock.locked():
            await self._commit([], durable=False)  # durable after all if a staged event asks for it

    async def sync(self, *, ending: bool = True) -> None:
        """Everything appended or staged before this call is on disk when it returns (durability
        "full"; under "process" it is committed, which is all that mode promises).

        The staged events are committed first; the disk sync itself holds up no other append (it
        runs beside them), so a caller can start it and go on making calls, and await it before
        telling anyone an outcome. ``ending``: the operation is telling its caller the outcome
        (``operation_ended`` follows the sync); False when it goes on writing (a save syncs its
        outcome while its servers resume), and calls ``operation_ended`` itself once done."""
        self._check_writable()
        await self.flush()
        await self._backend.sync()
        if ending:
            self._backend.operation_ended()

    def operation_ended(self) -> None:
        """The operation under way is over: the backend may tend the database in the background
        once the writer is quiet (SQLite: the write-behind tail synced and the WAL checkpointed,
        ``quiesce.ledger.sqlite_upkeep``), so neither lands inside the next operation's commits."""
        self._backend.operation_ended()

    async def _flush_staged(self) -> None:
        """Commit the staged events, if any and if this writer may still write: a writer's reads
        see its own staged events, and closing keeps them."""
        if self._staged and self._fenced is None and self._lost is None and not self._closed:
            await self.flush()

    async def start_epoch(self, data: Mapping[str, Any] | BaseModel) -> Event:
        """Append ``coordinator.started`` with epoch = the ledger's largest epoch + 1.

        That epoch becomes ``self.epoch`` and is written into every later append; the event's hash
        becomes ``self.epoch_hash``.
        """
        started = (
            await self._commit([self._encode("coordinator.started", None, None, None, data)], new_epoch=True)
        )[0]
        self.epoch_hash = started.hash
        return started

    # -- reading -------------------------------------------------------------------------------

    async def read(
        self,
        after: int = 0,
        checkpoint_id: str | None = None,
        kinds: Sequence[str] | None = None,
        *,
        page_size: int = PAGE_SIZE,
    ) -> AsyncIterator[Event]:
        """Events with seq > ``after`` (optionally one checkpoint id, some kinds), in seq order.

        Streams one page (``page_size`` rows) per query; events appended while iterating appear.
        """
        if self._closed:
            raise LedgerError(f"ledger {self.url} is closed")
        await self._flush_staged()
        kind_list = list(kinds) if kinds is not None else None
        if kind_list is not None and not kind_list:
            return
        while True:
            page = await self._backend.read_page(after, checkpoint_id, kind_list, page_size)
            for raw in page:
                yield event_from_raw(raw)
            if len(page) < page_size:
                return
            after = int(page[-1][0])

    async def read_pages(
        self,
        after: int = 0,
        checkpoint_id: str | None = None,
        kinds: Sequence[str] | None = None,
        *,
        page_size: int = PAGE_SIZE,
    ) -> AsyncIterator[list[RawEvent]]:
        """The stored rows of ``read`` (same filters, same order), a page at a time, as stored:
        for checking their hashes (``quiesce.ledger.chain``); ``event_from_raw`` makes an ``Event`` of one."""
        if self._closed:
            raise LedgerError(f"ledger {self.url} is closed")
        await self._flush_staged()
        kind_list = list(kinds) if kinds is not None else None
        if kind_list is not None and not kind_list:
            return
        while True:
            page = await self._backend.read_page(after, checkpoint_id, kind_list, page_size)
            if page:
                yield page
            if len(page) < page_size:
                return
            after = int(page[-1][0])

    async def recorded_last_seq(self) -> int | None:
        """The largest seq the ``attempts`` projection records (``quiesce.ledger.chain.truncation``)."""
        await self._flush_staged()
        return await self._backend.projection_last_seq()

    async def last_seq(self) -> int:
        """The seq of this writer's last event — committed, or staged (0 for an empty ledger).

        The single writer knows its chain, so this costs no query — unless a commit failed with an
        unknown outcome, in which case the head is read again first. A readonly ledger reads it.
        """
        if self.readonly:
            head = await self._backend.head()
            return int(head[0]) if head is not None else 0
        if self._stale:
            async with self._lock:
                if self._stale:
                    await self._load_head()
        return self._tail_seq

    async def last_before(self, kind: str, seq: int) -> Event | None:
        """The last event of ``kind`` stored before ``seq`` (None if there is none).

        For a marker kind (anything but ``call.*`` and ``phase.*``: ``quiesce.ledger.layout.indexed_kind``)
        one lookup in the kind index, whatever the length of the history: what recovery reads about
        an old attempt must not grow with the ledger. A ``call.*`` or ``phase.*`` kind is not in
        that index (nine events in ten): it is found by scanning back from ``seq``.
        """
        await self._flush_staged()
        raw = await self._backend.read_last(kind, seq)
        return event_from_raw(raw) if raw is not None else None

    # -- one rollout's lineage (``quiesce.ledger.rollout_refs.read_rollout_lineage``) -------------------

    async def rollout_ref_seqs(self, rollout_ids: Sequence[str]) -> list[int]:
        """The seqs of the lineage events that name any of ``rollout_ids`` (the ``rollout_refs``
        projection), ascending: one key range per rollout, whatever the ledger's length."""
        await self._flush_staged()
        return await self._backend.rollout_ref_seqs(list(rollout_ids))

    async def events_at(self, seqs: Sequence[int]) -> list[Event]:
        """The events at ``seqs`` (those that exist), in seq order."""
        if not seqs:
            return []
        await self._flush_staged()
        return [event_from_raw(raw) for raw in await self._backend.events_at(list(seqs))]

    async def checkpoint_events(self, checkpoint_ids: Sequence[str], kinds: Sequence[str]) -> list[Event]:
        """The events of ``kinds`` of any of ``checkpoint_ids``, in seq order (the checkpoint index)."""
        if not checkpoint_ids or not kinds:
            return []
        await self._flush_staged()
        rows = await self._backend.checkpoint_rows(list(checkpoint_ids), list(kinds))
        return [event_from_raw(raw) for raw in rows]

    async def first_in_ranges(
        self, kinds: Sequence[str], ranges: Sequence[tuple[int, int | None]]
    ) -> list[int | None]:
        """Per range ``(lo, hi)``: the seq of the first event of one of ``kinds`` (marker kinds only:
        ``quiesce.ledger.layout.indexed_kind``) with ``lo < seq < hi`` (``hi`` None: no bound), or
        None. One kind-index lookup per kind and range, in one query."""
        if not ranges:
            return []
        if not all(indexed_kind(kind) for kind in kinds):
            raise LedgerError(f"first_in_ranges reads marker kinds only, not {list(kinds)}")
        await self._flush_staged()
        return await self._backend.first_in_ranges(list(kinds), list(ranges))

    async def last_before_each(self, kind: str, seqs: Sequence[int]) -> list[int | None]:
        """Per seq of ``seqs``: the seq of the last event of ``kind`` (a marker kind) before it, or None."""
        if not seqs:
            return []
        if not indexed_kind(kind):
            raise LedgerError(f"last_before_each reads a marker kind only, not {kind!r}")
        await self._flush_staged()
        return await self._backend.last_before_each(kind, list(seqs))

    async def head(self) -> Event | None:
        """The last stored event, or ``None`` for an empty ledger."""
        await self._flush_staged()
        raw = await self._backend.head()
        return event_from_raw(raw) if raw is not None else None

    async def attempts(
        self,
        since: str | datetime | None = None,
        outcome: str | Sequence[str] | None = None,
        *,
        limit: int = 0,
        before: tuple[str, str] | None = None,
        stored: bool = False,
    ) -> list[AttemptRow]:
        """Rows of the ``attempts`` projection, oldest first by ``(started_at, checkpoint_id)``.

        ``since`` is an ``Event.at`` string or a datetime; ``outcome`` an exact outcome, several,
        or ``"open"`` (no terminal event yet); ``before`` a ``(started_at, checkpoint_id)`` key that
        every row precedes (the keyset of the next page back); ``limit`` > 0 keeps the newest that
        many, and costs that many rows of the index (``ix_attempts_started``), not the history.

        ``calls`` is every ``call.sent`` of the attempt so far: the stored count plus those after
        the row's ``last_seq`` (``quiesce.ledger.projections``; one indexed range per row, empty
        for a finished attempt). ``stored=True``: the rows exactly as stored, for comparing them
        with a fold of the events (``check``, ``replay``).
        """
        if isinstance(since, datetime):
            since = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        if limit < 0:
            raise ValueError(f"limit must be >= 0, not {limit}")
        chosen = outcome if outcome is None or isinstance(outcome, str) else tuple(outcome)
        await self._flush_staged()
        rows = await self._backend.attempts(AttemptQuery(since, chosen, before, limit))
        return rows if stored else await self._live_calls(rows)

    async def attempt(self, checkpoint_id: str, *, stored: bool = False) -> AttemptRow | None:
        """The projection row of one attempt, or ``None``; ``calls`` and ``stored`` as in ``attempts``."""
        await self._flush_staged()
        row = await self._backend.attempt(checkpoint_id)
        if row is None or stored:
            return row
        return (await self._live_calls([row]))[0]

    async def _live_calls(self, rows: list[AttemptRow]) -> list[AttemptRow]:
        """``rows`` with the ``call.sent`` events after each one's ``last_seq`` counted in ``calls``."""
        if not rows:
            return rows
        later = await self._backend.calls_after([(row.checkpoint_id, row.last_seq) for row in rows])
        return [
            row if n == 0 else replace(row, calls=row.calls + n) for row, n in zip(rows, later, strict=True)
        ]

    async def start_key(self, checkpoint_id: str) -> tuple[str, str] | None:
        """Attempt ``checkpoint_id``'s place in ``attempts``' order, ``(started_at, checkpoint_id)``:
        the ``before`` of the page before it; ``None`` when the ledger has no such attempt."""
        row = await self.attempt(checkpoint_id)
        return None if row is None else (row.started_at, row.checkpoint_id)

    async def unfinished_attempts(self) -> list[AttemptRow]:
        """The attempts without a terminal event (``outcome`` is None), oldest ``last_seq`` first.

        Recovery's question on every open: the database filters the rows, so what comes back —
        and what is built in Python — grows with the unfinished attempts, not with the history.
        """
        await self._flush_staged()
        return await self._backend.unfinished_attempts()
