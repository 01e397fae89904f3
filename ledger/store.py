"""``Ledger``: the append-only, hash-chained event store.

Invariants:

- **Durable when it returns.** ``append``/``append_many``/``start_epoch`` return only after the
  transaction committed (SQLite ``synchronous=FULL`` by default). A cancelled caller still waits
  for the commit to finish, so the writer's view of the head never goes stale.
- **One writer.** A non-readonly open claims writership for the ledger's lifetime (see the
  backend modules) or raises ``FencedError``. Every append transaction also checks that the stored
  head is still the writer's last append and that no newer epoch exists; otherwise it raises
  ``FencedError`` and the ledger refuses every later append: the owner must stop acting.
- **Epochs never go down along seq.** ``start_epoch`` appends ``coordinator.started`` with epoch =
  head's epoch + 1 (the largest in the ledger) and makes it this writer's epoch. Until then
  ``ledger.epoch`` is 0, so a writer that never started an epoch can append only to a ledger that
  has none.
- **What is stored is redacted and capped** (``ledger.redact``) before it is hashed; ``Event.data``
  returned by ``append`` is exactly what was stored.
- Appends from concurrent tasks of one event loop are serialised; a Ledger belongs to one loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Literal, cast

import anyio
from pydantic import BaseModel, ValidationError

from ledger import migrate
from ledger.backend import Backend, Batch, RawEvent
from ledger.canonical import GENESIS_HASH, chain_hash, row_bytes
from ledger.errors import FencedError, LedgerError
from ledger.events import COLUMN_RULES, PAYLOADS, AppendItem, Event
from ledger.projections import AttemptRow
from ledger.redact import Redactor
from ledger.urls import parse, safe

Durability = Literal["full", "process"]
PAGE_SIZE = 1000


_second_cache: list[Any] = [-1, ""]


def utc_now() -> str:
    """UTC ISO-8601 with microseconds and a ``Z``: the format of ``Event.at``."""
    seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
    if seconds != _second_cache[0]:
        _second_cache[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second_cache[0] = seconds
    return f"{_second_cache[1]}.{micros:06d}Z"


def event_from_raw(raw: RawEvent | Sequence[Any]) -> Event:
    seq, at, kind, cid, server, call_id, epoch, data, prev_hash, digest = raw
    parsed = json.loads(data)
    return Event(
        seq=int(seq),
        at=at,
        kind=kind,
        checkpoint_id=cid,
        server=server,
        call_id=call_id,
        epoch=int(epoch),
        data=parsed if isinstance(parsed, dict) else {"value": parsed},
        prev_hash=prev_hash,
        hash=digest,
    )


def make_backend(url: str, *, durability: Durability = "full", readonly: bool = False) -> Backend:
    """The backend for ``url`` (not yet connected)."""
    backend_name, parsed = parse(url)
    where = safe(parsed)
    if backend_name == "sqlite":
        from ledger.sqlite import SqliteBackend

        return SqliteBackend(parsed, where=where, durability=durability, readonly=readonly)
    from ledger.postgres import PostgresBackend

    return PostgresBackend(parsed, where=where, durability=durability, readonly=readonly)


async def upgrade_schema(url: str) -> tuple[str | None, str]:
    """``quiesce db upgrade``: bring the schema to head; returns (revision before, revision after).

    Claims writership for the duration, so no coordinator writes while the schema changes.
    A schema ahead of this code is refused (``LedgerError``).
    """
    backend = make_backend(url)
    try:
        await backend.claim_writer()
        result = await backend.run_schema(migrate.upgrade_sync)
    finally:
        await backend.close()
    assert isinstance(result, tuple)
    return cast("tuple[str | None, str]", result)


async def downgrade_schema(url: str, revision: str) -> None:
    """Downgrade the schema to ``revision`` (``"base"`` drops the ledger's tables). Tests and emergencies."""
    backend = make_backend(url)
    try:
        await backend.claim_writer()
        await backend.run_schema(lambda conn: migrate.downgrade_sync(conn, revision))
    finally:
        await backend.close()


def _format_validation(kind: str, error: ValidationError) -> str:
    # Never include the input: it may hold a secret the redactor has not seen yet.
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(payload)'}: {e['msg']}"
        for e in error.errors(include_input=False, include_url=False)
    )
    return f"invalid {kind} payload: {problems}"


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


class Ledger:
    """An open ledger. Create with ``Ledger.open(url)`` (async context manager) or ``Ledger.connect``."""

    def __init__(self, backend: Backend, *, where: str, secrets: Sequence[str], readonly: bool) -> None:
        self._backend = backend
        self.url = where  #: the ledger URL with any password hidden
        self.readonly = readonly
        self._redactor = Redactor(secrets)
        self._secrets = tuple(s for s in secrets if s)
        self._lock = anyio.Lock(fast_acquire=True)
        self._last_seq = 0
        self._last_hash = GENESIS_HASH
        self._head_epoch = 0
        self._fenced: FencedError | None = None
        self._stale = False
        self._closed = False
        #: This writer's epoch: 0 until ``start_epoch``; written into every appended row.
        self.epoch = 0

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        durability: Durability = "full",
        secrets: Sequence[str] = (),
        readonly: bool = False,
    ) -> Ledger:
        """Open the ledger at ``url``; the caller must ``await ledger.aclose()``.

        A writer (not ``readonly``) claims writership first, then creates an empty database at
        the schema head. A schema behind or ahead of this code is refused with ``LedgerError``.
        """
        if durability not in ("full", "process"):
            raise LedgerError(f"durability must be 'full' or 'process', not {durability!r}")
        backend = make_backend(url, durability=durability, readonly=readonly)
        where = backend.where
        ledger = cls(backend, where=where, secrets=secrets, readonly=readonly)
        try:
            if not readonly:
                await backend.claim_writer()
            await backend.run_schema(
                lambda conn: migrate.ensure_schema_sync(conn, url=where, create=not readonly)
            )
            await backend.start()
            await ledger._load_head()
        except BaseException:
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
    ) -> AsyncIterator[Ledger]:
        """``async with Ledger.open(url) as ledger:`` — see ``connect``; closed (and writership
        released) on exit."""
        ledger = await cls.connect(url, durability=durability, secrets=secrets, readonly=readonly)
        try:
            yield ledger
        finally:
            await ledger.aclose()

    async def aclose(self) -> None:
        """Close the connections and release writership. Idempotent."""
        if not self._closed:
            self._closed = True
            await self._backend.close()

    @property
    def backend(self) -> Backend:
        """The database backend (for ``ledger.replay``; not for callers outside ``ledger``)."""
        return self._backend

    async def _load_head(self) -> None:
        raw = await self._backend.head()
        if raw is None:
            self._last_seq, self._last_hash, self._head_epoch = 0, GENESIS_HASH, 0
        else:
            self._last_seq, self._last_hash, self._head_epoch = int(raw[0]), raw[9], int(raw[6])
        self._stale = False

    # -- writing -------------------------------------------------------------------------------

    def _encode(
        self, kind: str, checkpoint_id: str | None, server: str | None, call_id: str | None, data: Any
    ) -> _Encoded:
        model = PAYLOADS.get(kind)
        if model is None:
            raise LedgerError(f"unknown event kind {kind!r}; known kinds: {', '.join(sorted(PAYLOADS))}")
        for prefix, required in COLUMN_RULES.items():
            if kind.startswith(prefix):
                given = {"checkpoint_id": checkpoint_id, "server": server, "call_id": call_id}
                missing = [name for name in required if given[name] is None]
                if missing:
                    raise LedgerError(f"a {kind} event needs {' and '.join(missing)}")
        try:
            if isinstance(data, model):
                obj = data.model_dump(mode="json")
            elif isinstance(data, BaseModel):
                obj = model.model_validate(data.model_dump(mode="json")).model_dump(mode="json")
            elif isinstance(data, Mapping):
                obj = model.model_validate(data).model_dump(mode="json")
            else:
                raise LedgerError(
                    f"a {kind} payload must be a mapping or a {model.__name__}, not {type(data).__name__}"
                )
        except ValidationError as error:
            raise LedgerError(_format_validation(kind, error)) from None
        try:
            stored, text = self._redactor.encode(obj)
        except (ValueError, TypeError) as error:
            raise LedgerError(f"invalid {kind} payload: not storable as JSON ({error})") from None
        if self._secrets:
            checkpoint_id, server, call_id = (
                self._redactor.text(v) if v is not None else None for v in (checkpoint_id, server, call_id)
            )
        return _Encoded(kind, checkpoint_id, server, call_id, stored, text)

    def _check_writable(self) -> None:
        if self._closed:
            raise LedgerError(f"ledger {self.url} is closed")
        if self.readonly:
            raise LedgerError(f"ledger {self.url} was opened readonly; it cannot append")
        if self._fenced is not None:
            raise FencedError(str(self._fenced))

    async def _commit(self, items: list[_Encoded], *, new_epoch: bool = False) -> list[Event]:
        self._check_writable()
        async with self._lock:
            self._check_writable()
            if self._stale:
                with anyio.CancelScope(shield=True):
                    await self._load_head()
            epoch = self._head_epoch + 1 if new_epoch else self.epoch
            if epoch < self._head_epoch:
                raise FencedError(
                    f"ledger {self.url}: epoch {self._head_epoch} exists, newer than this writer's epoch "
                    f"{epoch}. Call start_epoch() before appending to a ledger another coordinator wrote; "
                    "a coordinator "
                    "that was already running is fenced and must stop making calls."
                )
            at = utc_now()
            seq, prev = self._last_seq, self._last_hash
            rows: list[RawEvent] = []
            events: list[Event] = []
            for item in items:
                seq += 1
                digest = chain_hash(
                    prev,
                    row_bytes(
                        seq=seq,
                        at=at,
                        kind=item.kind,
                        checkpoint_id=item.checkpoint_id,
                        server=item.server,
                        call_id=item.call_id,
                        epoch=epoch,
                        data_text=item.text,
                        prev_hash=prev,
                    ),
                )
                rows.append(
                    (
                        seq,
                        at,
                        item.kind,
                        item.checkpoint_id,
                        item.server,
                        item.call_id,
                        epoch,
                        item.text,
                        prev,
                        digest,
                    )
                )
                events.append(
                    Event(
                        seq,
                        at,
                        item.kind,
                        item.checkpoint_id,
                        item.server,
                        item.call_id,
                        epoch,
                        item.data,
                        prev,
                        digest,
                    )
                )
                prev = digest
            batch = Batch(rows=rows, events=events, expected_last=self._last_seq, epoch=epoch, where=self.url)
            try:
                await self._backend.append(batch)  # shields itself while it awaits
            except FencedError as error:
                self._fenced = error
                raise
            except BaseException:
                self._stale = True  # the commit may or may not have happened; re-read the head next time
                raise
            self._last_seq, self._last_hash, self._head_epoch = seq, prev, epoch
            if new_epoch:
                self.epoch = epoch
            return events

    async def append(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        server: str | None = None,
        call_id: str | None = None,
        data: Mapping[str, Any] | BaseModel,
    ) -> Event:
        """Validate, redact, chain and commit one event; durable when it returns.

        Raises ``LedgerError`` for an unknown kind or an invalid payload (nothing is written) and
        ``FencedError`` when another writer owns the ledger.
        """
        return (await self._commit([self._encode(kind, checkpoint_id, server, call_id, data)]))[0]

    async def append_many(self, items: Sequence[AppendItem]) -> list[Event]:
        """Commit ``items`` in one transaction (consecutive seqs).

        All are durable when it returns, or none was written.
        """
        if not items:
            return []
        encoded = [self._encode(i.kind, i.checkpoint_id, i.server, i.call_id, i.data) for i in items]
        return await self._commit(encoded)

    async def start_epoch(self, data: Mapping[str, Any] | BaseModel) -> Event:
        """Append ``coordinator.started`` with epoch = the ledger's largest epoch + 1.

        That epoch becomes ``self.epoch`` and is written into every later append.
        """
        return (
            await self._commit([self._encode("coordinator.started", None, None, None, data)], new_epoch=True)
        )[0]

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

    async def head(self) -> Event | None:
        """The last stored event, or ``None`` for an empty ledger."""
        raw = await self._backend.head()
        return event_from_raw(raw) if raw is not None else None

    async def attempts(
        self, since: str | datetime | None = None, outcome: str | None = None
    ) -> list[AttemptRow]:
        """Rows of the ``attempts`` projection, by start time.

        ``since`` is an ``Event.at`` string or a datetime; ``outcome`` an exact outcome.
        """
        if isinstance(since, datetime):
            since = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return await self._backend.attempts(since, outcome)

    async def attempt(self, checkpoint_id: str) -> AttemptRow | None:
        """The projection row of one attempt, or ``None``."""
        return await self._backend.attempt(checkpoint_id)
