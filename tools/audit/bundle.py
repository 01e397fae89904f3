"""The audit bundle: ledger events with their hash chain, verifiable offline with no database.

Format (version 1): UTF-8 JSON Lines, one JSON object per line.

1. Header (first line)::

       {"format": "quiesce-audit-bundle", "version": 1,
        "source": {"head_seq": <int>, "head_hash": <hex>},   # the ledger head when exported
        "checkpoint": <checkpoint id> | null}                 # null: the whole ledger

2. The events as runs of consecutive seqs. Each run is preceded by an anchor line stating the hash
   of the event just before the run (for seq 1: seq 0 and the genesis hash ``"0" * 64``)::

       {"type": "anchor", "seq": <first seq of the run - 1>, "hash": <hex>}
       {"type": "event", "seq", "at", "kind", "checkpoint_id", "server", "call_id", "epoch",
        "data", "prev_hash", "hash"}          # the stored row, columns as in the ledger
       ...

3. A trailer (last line)::

       {"type": "end", "events": <number of event lines>, "runs": [[first seq, last seq], ...],
        "last_hash": <hash of the last event> | null}

A bundle of the whole ledger is one run from seq 1 to the head. A bundle of one checkpoint holds
the events whose ``checkpoint_id`` is that id, the ``recovery.completed`` events naming it, and the
``coordinator.started`` of every epoch that wrote one of them.

Verification (``verify_bundle``) recomputes every event's hash with ``quiesce.ledger.canonical`` (the
ledger's own chain function: ``sha256(prev_hash + canonical(row without hash))``), checks each
event's ``prev_hash`` against the hash of the event before it (the previous line, or the run's
anchor), that seqs only skip across an anchor and increase strictly, and that the trailer matches.
A whole-ledger bundle must end at the header's head with the header's head hash, so it proves
the full chain from genesis; a subset bundle proves each included event's content against its
hash and each run's link to the anchor hash — an auditor who holds the ledger (or a trusted copy
of an anchor or head hash) can then tie the anchors to the chain: ``quiesce verify-bundle FILE
--ledger URL`` also compares every hash the bundle states (events and anchors) with the live
ledger's, and recomputes each of the ledger's rows in those ranges from its own content (so a row
edited with its hash columns left as they were is found), reporting seqs the ledger lacks as runs.
Every problem is reported with the seq of the event (or the line) that shows it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from quiesce.ledger.canonical import GENESIS_HASH, canonical, chain_hash
from quiesce.ledger.events import Event
from quiesce.ledger.layout import EVENT_COLUMNS

FORMAT: Final = "quiesce-audit-bundle"
VERSION: Final = 1
#: Coordinator-level kinds a one-checkpoint bundle carries for context.
CONTEXT_KINDS: Final = ("coordinator.started", "recovery.completed")


def event_line(event: Event) -> dict[str, Any]:
    """The bundle line of one event: its stored columns, plus `"type": "event"`."""
    return {"type": "event", **event.columns()}


def _dump(line: dict[str, Any]) -> str:
    return json.dumps(line, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass(slots=True)
class ExportSummary:
    events: int = 0
    runs: list[tuple[int, int]] = field(default_factory=list)
    last_hash: str | None = None
    #: the attempt exported (None: the whole ledger)
    checkpoint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"events": self.events, "runs": [list(r) for r in self.runs], "last_hash": self.last_hash}


async def write_bundle(
    out: IO[str],
    events: AsyncIterator[Event],
    *,
    head_seq: int,
    head_hash: str,
    checkpoint: str | None,
) -> ExportSummary:
    """Write a bundle of `events` (strictly increasing seq, none past `head_seq`) to `out`."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "source": {"head_seq": head_seq, "head_hash": head_hash},
        "checkpoint": checkpoint,
    }
    out.write(_dump(header) + "\n")
    summary = ExportSummary(checkpoint=checkpoint)
    previous: int | None = None
    async for event in events:
        if event.seq > head_seq:
            break
        if previous is None or event.seq != previous + 1:
            out.write(_dump({"type": "anchor", "seq": event.seq - 1, "hash": event.prev_hash}) + "\n")
            summary.runs.append((event.seq, event.seq))
        else:
            summary.runs[-1] = (summary.runs[-1][0], event.seq)
        out.write(_dump(event_line(event)) + "\n")
        summary.events += 1
        summary.last_hash = event.hash
        previous = event.seq
    out.write(_dump({"type": "end", **summary.to_json()}) + "\n")
    return summary


# -- verification ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a bundle: the seq of the event that shows it (None for a whole-file
    problem such as a bad header), the line number, and what is wrong."""

    seq: int | None
    line: int
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "line": self.line, "message": self.message}

    def __str__(self) -> str:
        where = f"seq {self.seq}" if self.seq is not None else f"line {self.line}"
        return f"{where}: {self.message}"


@dataclass(slots=True)
class Verification:
    """The result of `verify_bundle`; `ok` when there is no problem."""

    problems: list[Problem] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    runs: list[tuple[int, int]] = field(default_factory=list)
    last_hash: str | None = None
    #: seq -> (hash the bundle states for that seq, line): every event and every anchor but genesis.
    #: Filled only when asked (`verify_lines(..., keep_claims=True)`), for `cross_check`.
    claims: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: problems found by comparing with a live ledger (`cross_check`), kept apart from `problems`
    ledger_problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.ledger_problems

    @property
    def complete(self) -> bool:
        """A whole-ledger bundle that proves the chain from genesis to the exported head."""
        return self.ok and self.header.get("checkpoint") is None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "complete": self.complete,
            "format": self.header.get("format"),
            "version": self.header.get("version"),
            "source": self.header.get("source"),
            "checkpoint": self.header.get("checkpoint"),
            "events": self.events,
            "runs": [list(r) for r in self.runs],
            "last_hash": self.last_hash,
            "problems": [p.to_json() for p in self.problems],
            "ledger_problems": [p.to_json() for p in self.ledger_problems],
        }


def event_hash(line: dict[str, Any]) -> str:
    """The chain hash of an event line: `sha256(prev_hash + canonical(row without hash))`."""
    row = {name: line[name] for name in EVENT_COLUMNS if name != "hash"}
    return chain_hash(str(row["prev_hash"]), canonical(row))


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _event_shape(line: dict[str, Any]) -> str | None:
    """Why an event line is malformed, or None."""
    missing = [name for name in EVENT_COLUMNS if name not in line]
    if missing:
        return f"event line lacks {', '.join(missing)}"
    extra = sorted(set(line) - {*EVENT_COLUMNS, "type"})
    if extra:
        return f"event line has unknown fields {', '.join(extra)}"
    if not _is_int(line["seq"]) or line["seq"] < 1 or not _is_int(line["epoch"]):
        return "seq and epoch must be integers (seq >= 1)"
    if not isinstance(line["at"], str) or not isinstance(line["kind"], str):
        return "at and kind must be strings"
    for name in ("checkpoint_id", "server", "call_id"):
        if line[name] is not None and not isinstance(line[name], str):
            return f"{name} must be a string or null"
    if not isinstance(line["data"], dict):
        return "data must be an object"
    if not _is_hex64(line["prev_hash"]) or not _is_hex64(line["hash"]):
        return "prev_hash and hash must be 64 lowercase hex characters"
    return None


def _lines(stream: Iterable[str]) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    for number, raw in enumerate(stream, start=1):
        text = raw.rstrip("\n")
        if not text.strip():
            yield number, None, "empty line"
            continue
        try:
            value = json.loads(text)
        except ValueError as error:
            yield number, None, f"not JSON ({error})"
            continue
        if not isinstance(value, dict):
            yield number, None, "not a JSON object"
            continue
        yield number, value, ""


class _Verifier:
    def __init__(self, keep_claims: bool) -> None:
        self.keep_claims = keep_claims
        self.result = Verification()
        self.expected_seq: int | None = None  # seq the next event line must have
        self.expected_prev: str | None = None  # prev_hash the next event line must have
        self.last_seq = 0
        self.pending_anchor: tuple[int, int] | None = None  # (line, seq) of an anchor with no event yet
        self.trailer: tuple[int, dict[str, Any]] | None = None

    def problem(self, seq: int | None, line: int, message: str) -> None:
        self.result.problems.append(Problem(seq, line, message))

    def header(self, number: int, value: dict[str, Any] | None, why: str) -> bool:
        if value is None:
            self.problem(None, number, f"the header is {why}")
            return False
        self.result.header = value
        if value.get("format") != FORMAT:
            self.problem(None, number, f"not a {FORMAT} (format is {value.get('format')!r})")
            return False
        if value.get("version") != VERSION:
            self.problem(None, number, f"unsupported version {value.get('version')!r} (this reads {VERSION})")
            return False
        source = value.get("source")
        if not (isinstance(source, dict) and _is_int(source.get("head_seq")) and "head_hash" in source):
            self.problem(None, number, "the header's source must give head_seq and head_hash")
        checkpoint = value.get("checkpoint")
        if checkpoint is not None and not isinstance(checkpoint, str):
            self.problem(None, number, "the header's checkpoint must be a string or null")
        return True

    def anchor(self, number: int, value: dict[str, Any]) -> None:
        seq, digest = _as_int(value.get("seq")), value.get("hash")
        if seq is None or seq < 0 or not isinstance(digest, str) or not _is_hex64(digest):
            self.problem(None, number, "an anchor needs seq (integer >= 0) and hash (64 hex)")
            return
        if self.pending_anchor is not None:
            self.problem(
                seq + 1, number, f"anchor follows the anchor on line {self.pending_anchor[0]} with no event"
            )
        if seq < self.last_seq:
            self.problem(
                seq + 1, number, f"anchor for seq {seq + 1} goes back (last event was seq {self.last_seq})"
            )
        if seq == 0 and digest != GENESIS_HASH:
            self.problem(1, number, "the anchor of seq 1 must be the genesis hash")
        self.expected_seq, self.expected_prev = seq + 1, digest
        self.pending_anchor = (number, seq)
        if self.keep_claims and seq > 0:
            self.result.claims.setdefault(seq, (digest, number))

    def event(self, number: int, value: dict[str, Any]) -> None:
        seq = value.get("seq") if _is_int(value.get("seq")) else None
        shape = _event_shape(value)
        if shape is not None:
            self.problem(seq, number, shape)
            # keep going from this event's own claims so one bad line does not hide the rest
            if seq is not None and _is_hex64(value.get("hash")):
                self.expected_seq, self.expected_prev, self.last_seq = seq + 1, value["hash"], seq
            return
        assert isinstance(seq, int)
        if self.expected_seq is None:
            self.problem(seq, number, "event before any anchor (the run's preceding hash is missing)")
        elif seq != self.expected_seq:
            if seq <= self.last_seq:
                self.problem(seq, number, f"seq does not increase (after seq {self.last_seq})")
            else:
                self.problem(
                    seq,
                    number,
                    f"seq {self.expected_seq}..{seq - 1} missing with no anchor (events removed?)",
                )
        elif value["prev_hash"] != self.expected_prev:
            what = "the anchor's hash" if self.pending_anchor is not None else f"the hash of seq {seq - 1}"
            self.problem(seq, number, f"prev_hash does not match {what} (chain broken)")
        try:
            recomputed = event_hash(value)
        except (TypeError, ValueError) as error:
            self.problem(seq, number, f"cannot encode the event canonically ({error})")
        else:
            if recomputed != value["hash"]:
                self.problem(seq, number, "hash does not match the event's content (event altered)")
        result = self.result
        if result.runs and self.pending_anchor is None and seq == result.runs[-1][1] + 1:
            result.runs[-1] = (result.runs[-1][0], seq)
        else:
            result.runs.append((seq, seq))
        result.events += 1
        result.last_hash = value["hash"]
        if self.keep_claims:
            result.claims[seq] = (value["hash"], number)
        self.pending_anchor = None
        self.expected_seq, self.expected_prev, self.last_seq = seq + 1, value["hash"], seq

    def finish(self, last_line: int) -> None:
        result = self.result
        if self.pending_anchor is not None:
            self.problem(None, self.pending_anchor[0], "anchor with no event after it")
        if self.trailer is None:
            self.problem(None, last_line, "no end line (the bundle is truncated)")
        else:
            number, trailer = self.trailer
            runs = trailer.get("runs")
            claimed = [tuple(r) for r in runs] if isinstance(runs, list) else None
            if trailer.get("events") != result.events or claimed != result.runs:
                self.problem(
                    None,
                    number,
                    f"the end line claims {trailer.get('events')} events in runs {runs}, the bundle has "
                    f"{result.events} in {[list(r) for r in result.runs]} (lines removed or added?)",
                )
            if trailer.get("last_hash") != result.last_hash:
                self.problem(None, number, "the end line's last_hash is not the last event's hash")
        source = result.header.get("source")
        head_seq = _as_int(source.get("head_seq")) if isinstance(source, dict) else None
        head_hash = source.get("head_hash") if isinstance(source, dict) else None
        if head_seq is None:
            return
        if self.last_seq > head_seq:
            self.problem(self.last_seq, last_line, f"event past the exported head seq {head_seq}")
        if self.last_seq == head_seq and result.last_hash != head_hash:
            self.problem(self.last_seq, last_line, "the head event's hash is not the header's head_hash")
        if result.header.get("checkpoint") is None and result.runs != ([(1, head_seq)] if head_seq else []):
            self.problem(
                None,
                1,
                f"a whole-ledger bundle must hold seq 1..{head_seq} in one run, it holds "
                f"{[list(r) for r in result.runs]}",
            )


def verify_lines(stream: Iterable[str], *, keep_claims: bool = False) -> Verification:
    """Verify a bundle given as lines of text; see the module docstring. `keep_claims` keeps the
    seq -> hash each line states, for `cross_check` against a live ledger."""
    verifier = _Verifier(keep_claims)
    number = 0
    started = False
    for number, value, why in _lines(stream):
        if not started:
            started = True
            if not verifier.header(number, value, why):
                return verifier.result
            continue
        if value is None:
            verifier.problem(None, number, why)
            continue
        if verifier.trailer is not None:
            verifier.problem(
                value.get("seq") if _is_int(value.get("seq")) else None, number, "line after the end line"
            )
            continue
        kind = value.get("type")
        if kind == "event":
            verifier.event(number, value)
        elif kind == "anchor":
            verifier.anchor(number, value)
        elif kind == "end":
            verifier.trailer = (number, value)
        else:
            verifier.problem(None, number, f"unknown line type {kind!r}")
    if not started:
        verifier.problem(None, 1, "the file is empty")
        return verifier.result
    verifier.finish(number)
    return verifier.result


def verify_bundle(path: Path, *, keep_claims: bool = False) -> Verification:
    """Verify the bundle file at `path` (no database needed)."""
    with path.open(encoding="utf-8") as stream:
        return verify_lines(stream, keep_claims=keep_claims)


def claim_ranges(claims: dict[int, tuple[str, int]]) -> list[tuple[int, int]]:
    """The claimed seqs as ascending runs of consecutive seqs `(first, last)`."""
    ranges: list[tuple[int, int]] = []
    for seq in sorted(claims):
        if ranges and seq == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], seq)
        else:
            ranges.append((seq, seq))
    return ranges


def compare_claims(
    result: Verification,
    stored: dict[int, str],
    *,
    rows: Sequence[Sequence[Any]] = (),
    span: tuple[int, int] | None = None,
) -> None:
    """Record in `result.ledger_problems` what the live ledger shows against the bundle's claims.

    `stored` is the ledger's hash per seq; `rows` (optional) are the ledger's stored rows of the
    claimed range `span`, whose hashes are recomputed from their content (`quiesce.ledger.chain`), so a
    ledger row edited with its hash columns left as they were is found too. Claimed seqs the
    ledger lacks are reported as runs. Without `span`, every claim is compared.
    """
    from quiesce.ledger.chain import check_rows

    claims = sorted(
        (seq, claim) for seq, claim in result.claims.items() if span is None or span[0] <= seq <= span[1]
    )
    if rows:
        problem = check_rows(rows, None)
        if problem is not None:
            seq, what = problem
            line = result.claims.get(seq, ("", 0))[1]
            result.ledger_problems.append(
                Problem(seq, line, f"the ledger's row does not verify from its content: {what}")
            )
    missing: list[list[int]] = []  # [first seq, last seq, line of the first] of each run the ledger lacks
    extending = False
    for seq, (digest, line) in claims:
        found = stored.get(seq)
        if found is None:
            if extending and missing[-1][1] == seq - 1:
                missing[-1][1] = seq
            else:
                missing.append([seq, seq, line])
            extending = True
            continue
        extending = False
        if found != digest:
            result.ledger_problems.append(
                Problem(seq, line, "the bundle's hash for this seq differs from the ledger's")
            )
    for first, last, line in missing:
        what = f"seq {first}..{last}" if last != first else "this seq"
        result.ledger_problems.append(
            Problem(first, line, f"the ledger has no event with {what} (rows removed from it?)")
        )
    result.ledger_problems.sort(key=lambda p: (p.seq if p.seq is not None else -1, p.line))
