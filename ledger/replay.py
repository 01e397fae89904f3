"""Replay: recompute the hash chain and rebuild the projections from ``events``.

``replay_url(url)`` streams every event in seq order (``PAGE_SIZE`` rows per query; memory is one
page plus one projection row per checkpoint id), and

- checks the chain (``ledger.canonical``): seqs start at 1 without gaps, each ``prev_hash`` is the
  previous row's ``hash``, each ``hash`` recomputes from the stored row. The first bad seq is
  reported with what is wrong with it. Limitation: a chain cannot reveal rows removed from its
  end; compare ``head_seq``/``head_hash`` with a copy kept elsewhere for that.
- folds ``ledger.projections.fold`` over the stream and compares the result with the live
  ``attempts`` table, column by column;
- with ``rebuild=True`` (needs writership; refused when the chain is broken) replaces the live
  ``attempts`` table with the rebuilt rows in one transaction.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from json.encoder import encode_basestring
from typing import Any

import anyio
import anyio.lowlevel

from ledger.backend import RawEvent
from ledger.canonical import GENESIS_HASH
from ledger.errors import LedgerError
from ledger.events import Event
from ledger.projections import COLUMNS, KINDS_READ_BY_FOLD, AttemptRow, fold, touched
from ledger.store import Ledger

PAGE_SIZE = 5000


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

    def _bad(self, seq: int, problem: str) -> None:
        report = self.report
        if report.chain_ok:
            report.chain_ok = False
            report.first_bad_seq = seq
            report.problem = problem

    def feed(self, page: Iterable[RawEvent]) -> None:
        rows = self.rows
        report = self.report
        enc = encode_basestring
        sha256 = hashlib.sha256
        last_seq, last_hash = self._last_seq, self._last_hash
        count = 0
        for raw in page:
            seq, at, kind, cid, server, call_id, epoch, data_text, prev_hash, digest = raw
            count += 1
            if report.chain_ok:
                if seq != last_seq + 1:
                    if seq > last_seq + 1:
                        missing = f"{last_seq + 1}" if seq == last_seq + 2 else f"{last_seq + 1}..{seq - 1}"
                        self._bad(last_seq + 1, f"seq {missing} missing (rows deleted); next seq is {seq}")
                    else:
                        self._bad(seq, f"seq {seq} out of order after seq {last_seq}")
                elif prev_hash != last_hash:
                    self._bad(seq, "prev_hash does not match the hash of the previous row")
                # ledger.canonical.row_bytes + chain_hash, inlined (tests check they agree)
                elif (
                    sha256(
                        (
                            f'{prev_hash}{{"at":{enc(at)},'
                            f'"call_id":{"null" if call_id is None else enc(call_id)},'
                            f'"checkpoint_id":{"null" if cid is None else enc(cid)},"data":{data_text},'
                            f'"epoch":{int(epoch)},"kind":{enc(kind)},"prev_hash":{enc(prev_hash)},'
                            f'"seq":{int(seq)},"server":{"null" if server is None else enc(server)}}}'
                        ).encode()
                    ).hexdigest()
                    != digest
                ):
                    self._bad(seq, "hash mismatch: the stored row differs from what was hashed (row edited)")
            last_seq, last_hash = seq, digest
            if cid is None and kind != "recovery.completed":
                continue
            data: dict[str, Any] = {}
            if kind in KINDS_READ_BY_FOLD:
                try:
                    parsed = json.loads(data_text)
                except ValueError:
                    parsed = {}
                data = parsed if isinstance(parsed, dict) else {}
            event = Event(seq, at, kind, cid, server, call_id, epoch, data, prev_hash, digest)
            for touched_id in touched(event):
                new = fold(rows.get(touched_id), event, touched_id)
                if new is not None:
                    rows[touched_id] = new
        self._last_seq, self._last_hash = last_seq, last_hash
        report.events += count
        if count:
            report.head_seq, report.head_hash = last_seq, last_hash

    def compare(self, live: Iterable[AttemptRow]) -> None:
        """Record every difference between ``live`` rows and the rebuilt ones."""
        diffs = self.report.differences
        seen: set[str] = set()
        for row in live:
            seen.add(row.checkpoint_id)
            rebuilt = self.rows.get(row.checkpoint_id)
            if rebuilt is None:
                diffs.append(Difference(row.checkpoint_id, "(row)", "present", None))
                continue
            for column in COLUMNS:
                a, b = getattr(row, column), getattr(rebuilt, column)
                if a != b:
                    diffs.append(Difference(row.checkpoint_id, column, _plain(a), _plain(b)))
        for cid in sorted(self.rows.keys() - seen):
            diffs.append(Difference(cid, "(row)", None, "present"))


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


async def replay_open(ledger: Ledger, *, rebuild: bool = False, page_size: int = PAGE_SIZE) -> ReplayReport:
    """Replay an open ledger (a writer, when ``rebuild``)."""
    if rebuild and ledger.readonly:
        raise LedgerError(f"ledger {ledger.url} is open readonly; rebuilding projections needs the writer")
    backend = ledger.backend
    replayer = Replayer()
    # Read the next page while this one is checked: two pages in memory at most.
    page = await backend.read_page(0, None, None, page_size)
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
    replayer.compare(await backend.attempts(None, None))
    report = replayer.report
    if rebuild:
        if not report.chain_ok:
            raise LedgerError(
                f"ledger {ledger.url}: refusing to rebuild the projections from a broken chain "
                f"(first bad seq {report.first_bad_seq}: {report.problem})"
            )
        rows = sorted(replayer.rows.values(), key=lambda r: r.checkpoint_id)
        await backend.replace_attempts(rows)
        report.rebuilt = True
    return report


async def replay_url(url: str, *, rebuild: bool = False, page_size: int = PAGE_SIZE) -> ReplayReport:
    """Open ``url`` (readonly unless ``rebuild``) and replay it; see the module docstring."""
    async with Ledger.open(url, readonly=not rebuild) as ledger:
        return await replay_open(ledger, rebuild=rebuild, page_size=page_size)
