"""Replay: recompute the hash chain and rebuild the projections from ``events``.

``replay_url(url)`` reads every event in seq order, and

- checks the chain (``quiesce.ledger.chain``, which follows ``quiesce.ledger.canonical``): seqs
  start at 1 without gaps, each ``prev_hash`` is the previous row's ``hash``, each ``hash``
  recomputes from the stored row. The first bad seq is reported with what is wrong with it. Rows
  removed from the end are found when the ``attempts`` projection records a seq past the head
  (``quiesce.ledger.chain.truncation``); a tamperer who also rewrites the projection is found
  only against a copy kept elsewhere — an audit bundle (``quiesce verify-bundle --ledger``) or
  ``head_seq``/``head_hash``.
- folds ``quiesce.ledger.projections.fold`` over the stream (through ``FoldFeed``) and compares the result
  with the live ``attempts`` table, column by column;
- compares the live ``rollout_refs`` projection with the rows derived from the events that name
  rollouts (``compare_rollout_refs``: per bucket of seqs an order-free digest of each side, then
  the differing buckets row by row), up to the head seq the replay read;
- with ``rebuild=True`` (needs writership; refused when the chain is broken) replaces the live
  ``attempts`` table with the rebuilt rows in one transaction, and ``rollout_refs`` with the rows
  derived from the events in another — also a projection that records
  seqs past the head (``--verify`` reports that as rows removed from the end: the events cannot
  tell it from an edited projection, and rebuilding is the operator's explicit call).

Reading: PostgreSQL, and SQLite ledgers under ``PARALLEL_MIN_EVENTS`` events, are read in this
process, ``PAGE_SIZE`` rows per query (memory: two pages plus one projection row per checkpoint
id). A larger SQLite ledger is split into seq ranges of ``CHUNK_EVENTS`` checked by worker
processes (``quiesce.ledger.replay_worker``, one per CPU, each holding one page at a time); this process
links the ranges to each other (``quiesce.ledger.chain.link``) and folds their items in seq order, so the
verdict, first bad seq included, is the one a single pass gives. The items are the same either way
(``FoldFeed`` makes them, here or in a worker) and fold to the rows ``fold`` over every whole
event gives. The ranges end at the head seq read when the replay starts: events appended
meanwhile are left for the next replay.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.streams.buffered import BufferedByteReceiveStream

from quiesce.ledger import replay_worker
from quiesce.ledger.backend import AttemptQuery, RawEvent
from quiesce.ledger.canonical import GENESIS_HASH
from quiesce.ledger.chain import check_rows, link, truncation
from quiesce.ledger.errors import LedgerError
from quiesce.ledger.projections import COLUMNS, AttemptRow, FoldFeed, fold_items
from quiesce.ledger.replay_worker import Chunk
from quiesce.ledger.rollout_refs import REF_KINDS, RefsDigest, refs_of_rows
from quiesce.ledger.store import Ledger
from quiesce.ledger.urls import parse, plain_sqlite_path

PAGE_SIZE = 5000
#: With ``workers`` left automatic, a SQLite ledger spanning fewer seqs is replayed in-process
#: (starting worker processes would cost more than they save).
PARALLEL_MIN_EVENTS: Final = 50_000
#: The seqs one worker request covers; smaller ranges balance the workers on a busy machine.
CHUNK_EVENTS: Final = 25_000
MIN_CHUNK_EVENTS: Final = 4_000
_BEFORE_ALL: Final = -(2**63)  # below every BIGINT seq


@dataclass
class Difference:
    """One disagreement between the live projection and the rebuilt one."""

    checkpoint_id: str
    column: str  # "(row)" when the whole row is missing on one side
    live: Any
    rebuilt: Any


@dataclass
class ReplayReport:
    events: int = 0
    head_seq: int | None = None
    head_hash: str | None = None
    chain_ok: bool = True
    first_bad_seq: int | None = None
    problem: str | None = None
    differences: list[Difference] = field(default_factory=list)
    rebuilt: bool = False
    #: Worker processes that checked the chain (0: read in this process). Not part of ``to_json``.
    workers: int = 0

    @property
    def projections_ok(self) -> bool:
        return not self.differences

    @property
    def ok(self) -> bool:
        return self.chain_ok and self.projections_ok

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "head_seq": self.head_seq,
            "head_hash": self.head_hash,
            "chain": {"ok": self.chain_ok, "first_bad_seq": self.first_bad_seq, "problem": self.problem},
            "projections": {"ok": self.projections_ok, "differences": [asdict(d) for d in self.differences]},
            "rebuilt": self.rebuilt,
        }


class Replayer:
    """Feeds on stored rows in seq order; accumulates the chain verdict and the rebuilt projection."""

    def __init__(self) -> None:
        self.report = ReplayReport()
        self.rows: dict[str, AttemptRow] = {}
        self._last_seq = 0
        self._last_hash = GENESIS_HASH
        self._feed = FoldFeed()
        self._sent: dict[str, int] = {}  # call.sent not yet counted by a touching event

    def _bad(self, seq: int, problem: str) -> None:
        report = self.report
        if report.chain_ok:
            report.chain_ok = False
            report.first_bad_seq = seq
            report.problem = problem

    def feed(self, page: Iterable[RawEvent]) -> None:
        """Take the next stored rows (``quiesce.ledger.chain`` checks them; the fold takes them)."""
        rows = page if isinstance(page, list) else list(page)
        if not rows:
            return
        if self.report.chain_ok:
            problem = check_rows(rows, (self._last_seq, self._last_hash))
            if problem is not None:
                self._bad(*problem)
        self._advance(len(rows), rows[-1][0], rows[-1][9])
        self._feed.add(rows)
        fold_items(self.rows, self._feed.take(), self._sent)

    def feed_chunk(self, chunk: Chunk) -> None:
        """Take the next range of rows, as checked and reduced by a worker (``ledger.replay_worker``)."""
        if chunk.first is None or chunk.last is None:
            return
        if self.report.chain_ok:
            problem = link((self._last_seq, self._last_hash), *chunk.first) or chunk.problem
            if problem is not None:
                self._bad(*problem)
        self._advance(chunk.count, *chunk.last)
        fold_items(self.rows, chunk.items, self._sent)

    def _advance(self, count: int, last_seq: int, last_hash: str) -> None:
        self._last_seq, self._last_hash = last_seq, last_hash
        report = self.report
        report.events += count
        report.head_seq, report.head_hash = last_seq, last_hash

    def compare(self, live: Iterable[AttemptRow]) -> None:
        """Record every difference between ``live`` rows and the rebuilt ones."""
        self.report.differences.extend(compare_projection(live, self.rows))


def compare_projection(live: Iterable[AttemptRow], rebuilt: dict[str, AttemptRow]) -> list[Difference]:
    """Every difference between the ``live`` projection rows and ``rebuilt`` (checkpoint id -> row,
    folded from the events): per column of a row both have, or a row only one side has."""
    diffs: list[Difference] = []
    seen: set[str] = set()
    for row in live:
        seen.add(row.checkpoint_id)
        other = rebuilt.get(row.checkpoint_id)
        if other is None:
            diffs.append(Difference(row.checkpoint_id, "(row)", "present", None))
            continue
        if other == row:
            continue
        for column in COLUMNS:
            a, b = getattr(row, column), getattr(other, column)
            if a != b:
                diffs.append(Difference(row.checkpoint_id, column, _plain(a), _plain(b)))
    for cid in sorted(rebuilt.keys() - seen):
        diffs.append(Difference(cid, "(row)", None, "present"))
    return diffs


#: ``Difference.checkpoint_id`` of a ``rollout_refs`` row present on one side only.
REFS_TABLE: Final = "(rollout_refs)"
_REFS_PAGE: Final = 20_000


async def compare_rollout_refs(ledger: Ledger, upto: int) -> list[Difference]:
    """Every difference between the live ``rollout_refs`` rows and those derived from the events
    (``quiesce.ledger.rollout_refs``), both up to seq ``upto``: a row present on one side only, as
    ``Difference(REFS_TABLE, "rollout R, seq S", live, rebuilt)`` with ``"present"`` or None.

    Both sides are summed per bucket of seqs (``RefsDigest``: memory independent of the rows); only
    the buckets whose sums differ are read again, row by row. The events are read through the
    marker index (only the kinds that name rollouts); the table a page at a time, in key order. The
    caller reads ``upto`` before this: the rows of every event up to it were committed with it, and
    rows past it are taken for those of events appended meanwhile (not compared)."""
    kinds = sorted(REF_KINDS)
    rebuilt = RefsDigest(upto)
    async for page in ledger.read_pages(kinds=kinds, page_size=_REFS_PAGE):
        rebuilt.add(refs_of_rows((row[0], row[2], row[7]) for row in page if row[0] <= upto))
    live = RefsDigest(upto)
    backend = ledger.backend
    after: tuple[str, int] | None = None
    while True:
        rows = await backend.rollout_refs_page(after, _REFS_PAGE)
        live.add(rows)
        if len(rows) < _REFS_PAGE:
            break
        after = rows[-1]
    diffs: list[Difference] = []
    for lo, hi in live.differing(rebuilt):
        hi = min(hi, upto)
        stored = set(await backend.rollout_refs_between(lo, hi))
        derived: set[tuple[str, int]] = set()
        async for page in ledger.read_pages(lo - 1, kinds=kinds, page_size=_REFS_PAGE):
            derived.update(refs_of_rows((row[0], row[2], row[7]) for row in page if row[0] <= hi))
            if page[-1][0] > hi:
                break
        for rollout_id, seq in sorted(stored ^ derived, key=lambda ref: (ref[1], ref[0])):
            present = (rollout_id, seq) in stored
            diffs.append(
                Difference(
                    REFS_TABLE,
                    f"rollout {rollout_id}, seq {seq}",
                    "present" if present else None,
                    None if present else "present",
                )
            )
    return diffs


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _sqlite_file(ledger: Ledger) -> Path | None:
    """The file of a SQLite ledger (None for PostgreSQL)."""
    from quiesce.ledger.sqlite import SqliteBackend

    if not isinstance(ledger.backend, SqliteBackend):
        return None
    database = plain_sqlite_path(ledger.url) or parse(ledger.url)[1].database
    return Path(database).resolve() if database else None


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


async def _plan(path: Path, workers: int | None, chunk_events: int) -> tuple[int, list[tuple[int, int]]]:
    """How many worker processes check which seq ranges ``(lo, hi]``; (0, []): replay in-process."""
    automatic = workers is None
    count = _available_cpus() if workers is None else workers
    if count < (2 if automatic else 1) or not sys.executable:  # no interpreter to start: in-process
        return 0, []

    def read_bounds() -> tuple[int, int] | None:
        conn = replay_worker.connect(str(path))
        try:
            return replay_worker.bounds(conn)
        finally:
            conn.close()

    found = await anyio.to_thread.run_sync(read_bounds)
    if found is None:
        return 0, []
    low, high = found
    if automatic and high - low + 1 < PARALLEL_MIN_EVENTS:
        return 0, []
    # Ranges of chunk_events seqs, shrinking towards the end (down to MIN_CHUNK_EVENTS) so that
    # the workers finish close together.
    largest = max(1, chunk_events)
    smallest = min(largest, MIN_CHUNK_EVENTS)
    ranges: list[tuple[int, int]] = []
    start = low - 1
    while start < high:
        size = min(largest, max(smallest, (high - start) // (2 * count)))
        ranges.append((start, min(high, start + size)))
        start += size
    return min(count, len(ranges)), ranges


async def _check_in_workers(
    where: str, path: Path, workers: int, ranges: list[tuple[int, int]], take: Callable[[Chunk], None]
) -> None:
    """Each range checked by one of ``workers`` processes (``quiesce.ledger.replay_worker``); ``take`` gets
    the chunks in range order, each as soon as those before it have come."""
    arrived: dict[int, Chunk] = {}
    queue = iter(range(len(ranges)))
    taken = 0

    def arrive(index: int, chunk: Chunk) -> None:
        nonlocal taken
        arrived[index] = chunk
        while taken in arrived:
            take(arrived.pop(taken))
            taken += 1

    async def work() -> None:
        try:
            async with await anyio.open_process(
                replay_worker.command(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None
            ) as process:
                assert process.stdin is not None
                assert process.stdout is not None
                answers = BufferedByteReceiveStream(process.stdout)
                for index in queue:
                    try:
                        await process.stdin.send(json.dumps(ranges[index]).encode() + b"\n")
                        (size,) = replay_worker.HEADER.unpack(
                            await answers.receive_exactly(replay_worker.HEADER.size)
                        )
                        status, value = pickle.loads(await answers.receive_exactly(size))
                    except (anyio.BrokenResourceError, anyio.IncompleteRead, anyio.EndOfStream):
                        raise LedgerError(
                            f"ledger {where}: a replay worker process ended without answering"
                        ) from None
                    if status != "ok":
                        raise LedgerError(f"ledger {where}: a replay worker failed:\n{value}")
                    arrive(index, value)
                await process.stdin.aclose()
        except OSError as error:
            raise LedgerError(f"ledger {where}: could not run a replay worker process: {error}") from error

    await _together(*[work] * workers)
    if taken != len(ranges):
        raise LedgerError(f"ledger {where}: replay workers left seq ranges unchecked")


async def _together(*functions: Callable[[], Awaitable[None]]) -> None:
    """Run ``functions`` concurrently; the first ``LedgerError`` cancels the others and is raised as is."""
    errors: list[LedgerError] = []

    async def run(function: Callable[[], Awaitable[None]], cancel: anyio.CancelScope) -> None:
        try:
            await function()
        except LedgerError as error:
            errors.append(error)
            cancel.cancel()

    async with anyio.create_task_group() as tg:
        for function in functions:
            tg.start_soon(run, function, tg.cancel_scope)
    if errors:
        raise errors[0]


async def _read_in_process(replayer: Replayer, ledger: Ledger, page_size: int) -> None:
    backend = ledger.backend
    # Read the next page while this one is checked: two pages in memory at most.
    page = await backend.read_page(_BEFORE_ALL, None, None, page_size)  # seqs <= 0 are problems too
    while True:
        if len(page) < page_size:
            replayer.feed(page)
            break
        next_page: list[RawEvent] = []

        async def fetch(after: int, into: list[RawEvent]) -> None:
            into.extend(await backend.read_page(after, None, None, page_size))

        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch, int(page[-1][0]), next_page)
            await anyio.lowlevel.checkpoint()
            replayer.feed(page)
        page = next_page


async def replay_open(
    ledger: Ledger,
    *,
    rebuild: bool = False,
    page_size: int = PAGE_SIZE,
    workers: int | None = None,
    chunk_events: int = CHUNK_EVENTS,
) -> ReplayReport:
    """Replay an open ledger (a writer, when ``rebuild``).

    ``workers``: worker processes checking a SQLite ledger (None: as many as CPUs once it holds
    ``PARALLEL_MIN_EVENTS``; 0: none). A PostgreSQL ledger is always read in this process.
    """
    if rebuild and ledger.readonly:
        raise LedgerError(f"ledger {ledger.url} is open readonly; rebuilding projections needs the writer")
    backend = ledger.backend
    replayer = Replayer()
    path = _sqlite_file(ledger)
    count, ranges = (0, []) if path is None else await _plan(path, workers, chunk_events)
    live: list[AttemptRow] = []
    if path is not None and count:

        async def read_live() -> None:
            live.extend(await backend.attempts(AttemptQuery()))

        async def check() -> None:
            await _check_in_workers(ledger.url, path, count, ranges, replayer.feed_chunk)

        await _together(read_live, check)  # this process reads while the workers check
        replayer.report.workers = count
    else:
        await _read_in_process(replayer, ledger, page_size)
        live = await backend.attempts(AttemptQuery())
    replayer.compare(live)
    report = replayer.report
    if report.head_seq is not None:
        report.differences.extend(await compare_rollout_refs(ledger, report.head_seq))
    cut = truncation(report.head_seq or 0, max((row.last_seq for row in live), default=None))
    if cut is not None and report.chain_ok and not rebuild:
        # rows removed from the end — or a projection edited: only the events can tell, and they
        # end at the head; `--rebuild` (an operator's explicit choice) replaces that projection
        replayer._bad(*cut)
    if rebuild:
        if not report.chain_ok:
            raise LedgerError(
                f"ledger {ledger.url}: refusing to rebuild the projections from a broken chain "
                f"(first bad seq {report.first_bad_seq}: {report.problem})"
            )
        rows = sorted(replayer.rows.values(), key=lambda r: r.checkpoint_id)
        await backend.replace_attempts(rows)
        await backend.rebuild_rollout_refs()
        report.rebuilt = True
    return report


async def replay_url(
    url: str,
    *,
    rebuild: bool = False,
    page_size: int = PAGE_SIZE,
    workers: int | None = None,
    chunk_events: int = CHUNK_EVENTS,
) -> ReplayReport:
    """Open ``url`` (readonly unless ``rebuild``) and replay it; see the module docstring."""
    async with Ledger.open(url, readonly=not rebuild, verify_tail=False) as ledger:
        return await replay_open(
            ledger, rebuild=rebuild, page_size=page_size, workers=workers, chunk_events=chunk_events
        )
