"""What the audit commands share beyond their flags (`tools/cli/flags.py`): the ledger-wide check."""

from __future__ import annotations

from collections.abc import Sequence

from quiesce.ledger import event_from_raw
from quiesce.ledger.backend import RawEvent
from quiesce.ledger.chain import ChainCheck
from quiesce.ledger.lineage import LineageFold, LineageViolation, expect_difference
from quiesce.ledger.projections import AttemptRow, FoldFeed, fold_items
from quiesce.ledger.replay import compare_projection, compare_rollout_refs
from quiesce.tools.audit.check import ChainVerdict, CheckReport, ProjectionVerdict, ProtocolChecker, Violation
from quiesce.tools.audit.source import open_readonly


async def check_ledger(url: str, expect: Sequence[tuple[str, int]] | None = None) -> CheckReport:
    """The protocol check over every event of the ledger at `url`, streamed (read-only), and in
    the same pass the whole hash chain (`quiesce.ledger.chain.ChainCheck`): every row's hash recomputed
    from its content, every link, no seq missing — at the end too — the `attempts` and
    `rollout_refs` projections against the events, and the rollout lineage (`quiesce.ledger.lineage`: rules
    reported as `lineage-<rule>`; with `expect`, the trainer's live (rollout id, attempt) pairs,
    every difference from the lineage too).

    The projection is read first and the fold stops at the largest seq it records: a coordinator
    appending meanwhile commits each event with the rows it changes, so the events past that seq
    changed none of the rows read, and an honest live ledger compares equal."""
    checker = ProtocolChecker()
    lineage = LineageFold()
    chain = ChainCheck()
    feed = FoldFeed()
    rebuilt: dict[str, AttemptRow] = {}
    sent: dict[str, int] = {}
    async with open_readonly(url) as ledger:
        live = await ledger.attempts(stored=True)
        upto = max((row.last_seq for row in live), default=0)
        async for page in ledger.read_pages():
            chain.feed(page)
            for row in page:
                event = event_from_raw(row)
                checker.feed(event)
                lineage.feed(event)
            folded = page if int(page[-1][0]) <= upto else [row for row in page if int(row[0]) <= upto]
            if folded:
                feed.add(folded)
                fold_items(rebuilt, feed.take(), sent)
        problem = chain.finish(await ledger.recorded_last_seq())
        refs = await compare_rollout_refs(ledger, upto)
    report = checker.finish()
    report.chain = ChainVerdict(
        "chain", problem is None, problem[0] if problem else None, problem[1] if problem else None, chain.rows
    )
    report.projection = ProjectionVerdict(True, len(live), compare_projection(live, rebuilt) + refs)
    found = lineage.finish()
    report.rollouts = found.counts()
    report.violations += [_as_violation(v) for v in found.violations]
    report.warnings += [_as_violation(v) for v in found.warnings]
    if expect is not None:
        report.violations += [_as_violation(v) for v in expect_difference(found, expect)]
    return report


def _as_violation(v: LineageViolation) -> Violation:
    return Violation(v.seq, f"lineage-{v.rule}", v.checkpoint_id, None, v.message, v.rollout_id)


def attempt_projection(
    checkpoint_id: str, live: AttemptRow | None, rows: list[RawEvent]
) -> ProjectionVerdict:
    """One attempt's projection row against a fold of its events (`rows`: `attempt_rows`, which
    holds every event that can change the row), up to the seq the row records."""
    upto = live.last_seq if live is not None else max((int(row[0]) for row in rows), default=0)
    feed = FoldFeed()
    feed.add([row for row in rows if int(row[0]) <= upto])
    rebuilt: dict[str, AttemptRow] = {}
    fold_items(rebuilt, feed.take(), {})
    mine = {checkpoint_id: rebuilt[checkpoint_id]} if checkpoint_id in rebuilt else {}
    compared = [live] if live is not None else []
    return ProjectionVerdict(True, len(compared), compare_projection(compared, mine))
