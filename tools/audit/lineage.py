"""The rollout lineage as every face shows it: `quiesce rollouts`, `GET /v1/rollouts`, the report
and the service's rollout counters share what is here, so each shows the same rollouts the same
way. The lineage itself is `quiesce.ledger.lineage` (a fold of the ledger's events).

- `chosen` — which rollouts a selection (`--rollout`, `--state`) shows, and in what order: by
  rollout id, or in the order asked, each once; an id the ledger never saw is left out.
- `document` — `{"rollouts", "counts", "violations", "warnings"}` (+ `unknown`), what `quiesce
  rollouts --json` prints and `GET /v1/rollouts` answers: counts over every rollout, violations
  and warnings of the rollouts shown.
- `strip` — a rollout's steps in one line.
- `StepFold` — a lineage fold that hands each step to a callback instead of keeping it, so a
  count per step kind costs no memory per step (the service's counters, the report's per-save
  figures).
- `report_lineage` — what the report shows: per published save its figures, the rollouts shown
  (the first `cap` by id and every lost one) with their steps, and how many were left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from quiesce.ledger.lineage import LINEAGE_KINDS, LineageFold, LineageReport, Rollout, Step

if TYPE_CHECKING:
    from quiesce.ledger import Ledger

__all__ = [
    "REPORT_CAP",
    "ReportLineage",
    "SaveFigures",
    "StepFold",
    "chosen",
    "document",
    "report_lineage",
    "strip",
    "unknown",
]

#: The rollouts the report shows steps of, beyond the lost ones (which it always shows).
REPORT_CAP: Final = 200


def chosen(report: LineageReport, only: Sequence[str] | None, state: str | None) -> list[Rollout]:
    """The rollouts to show: every one by rollout id (`only` None), else those of `only` the
    ledger saw, in `only`'s order, each once; with `state`, only those in it."""
    rollouts = report.rollouts
    ids = sorted(rollouts) if only is None else [r for r in dict.fromkeys(only) if r in rollouts]
    return [rollouts[r] for r in ids if state is None or rollouts[r].state == state]


def unknown(report: LineageReport, only: Sequence[str] | None) -> list[str]:
    """The ids of `only` the ledger never recorded, each once, in `only`'s order."""
    return [r for r in dict.fromkeys(only or ()) if r not in report.rollouts]


def document(report: LineageReport, rows: Sequence[Rollout], missing: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON of a selection `rows` of `report`: `counts` over every rollout read; `violations` and
    `warnings` only of the rollouts in `rows`; `unknown` (only when some) the ids never recorded."""
    wanted = {r.rollout_id for r in rows}
    return {
        "rollouts": [r.to_json() for r in rows],
        "counts": report.counts(),
        "violations": [v.to_json() for v in report.violations if v.rollout_id in wanted],
        "warnings": [v.to_json() for v in report.warnings if v.rollout_id in wanted],
        **({"unknown": list(missing)} if missing else {}),
    }


def strip(steps: Sequence[Step], *, seqs: bool = False) -> str:
    """A rollout's steps in one line: `captured a0 @c1 → continued a1 @c2 → lost a1 @c3`."""
    parts = []
    for s in steps:
        text = s.what if s.attempt is None else f"{s.what} a{s.attempt}"
        if s.checkpoint_id:
            text += f" @{s.checkpoint_id}"
        elif s.servers:
            text += f" on {', '.join(s.servers)}"
        if seqs:
            text += f" (seq {s.seq})"
        parts.append(text)
    return " → ".join(parts)


OnStep = Callable[[Rollout, Step], None]


class StepFold(LineageFold):
    """A `LineageFold` that keeps no steps: each step it makes goes to `on_step` (None: dropped),
    in seq order, as it is made (the fold's own `on_step` hook). States, violations and warnings
    are the plain fold's."""

    def __init__(self, on_step: OnStep | None = None) -> None:
        super().__init__(steps=False, on_step=on_step)


@dataclass(slots=True)
class SaveFigures:
    """One published save's rollout figures: the attempts it `captured`, those it left out as
    restarts (`restarted`), those it showed `lost`, and the attempts `retired` after the previous
    published save and up to this one."""

    checkpoint_id: str
    seq: int
    captured: int = 0
    restarted: int = 0
    lost: int = 0
    retired: int = 0


@dataclass(slots=True)
class ReportLineage:
    """What the report shows of the lineage: `report` (every rollout's state; steps only of the
    rollouts in `shown`), `shown` (the first `cap` by id, then every lost one after them),
    `left_out` (how many rollouts are not shown) and `saves` (each published save's figures, by
    checkpoint id, in seq order)."""

    report: LineageReport
    shown: list[Rollout] = field(default_factory=list)
    left_out: int = 0
    saves: dict[str, SaveFigures] = field(default_factory=dict)
    cap: int = REPORT_CAP


async def report_lineage(ledger: Ledger, *, cap: int = REPORT_CAP) -> ReportLineage:
    """The report's lineage of `ledger`, in two reads of the lineage's event kinds: the first
    folds every rollout's state and counts each published save's figures without keeping steps;
    the second, up to the same seq, keeps the steps of the rollouts shown only."""
    saves: dict[str, SaveFigures] = {}
    save_ids: set[str] = set()
    retired_at: list[int] = []
    at: dict[str, int] = {"captured": 0, "restart": 0, "lost": 0}

    def counted(rollout: Rollout, step: Step) -> None:
        if step.what == "retired":
            retired_at.append(step.seq)
        elif step.what in at and step.checkpoint_id is not None:
            figures = saves.get(step.checkpoint_id)
            if figures is not None and figures.seq == step.seq:
                if step.what == "captured":
                    figures.captured += 1
                elif step.what == "restart":
                    figures.restarted += 1
                else:
                    figures.lost += 1

    fold = StepFold(counted)
    last = 0
    async for event in ledger.read(kinds=LINEAGE_KINDS):
        last, cid = event.seq, event.checkpoint_id
        if event.kind == "attempt.started" and event.data.get("kind") == "save" and cid is not None:
            save_ids.add(cid)
        elif event.kind == "attempt.published" and cid in save_ids and cid is not None:
            saves[cid] = SaveFigures(cid, event.seq)  # before the fold: its steps carry this seq
        fold.feed(event)
    report = fold.finish()
    previous = 0
    for figures in saves.values():
        figures.retired = sum(1 for seq in retired_at if previous < seq <= figures.seq)
        previous = figures.seq
    ids = sorted(report.rollouts)
    first = ids[:cap]
    lost = [r for r in ids[cap:] if report.rollouts[r].state == "lost"]
    shown_ids = first + lost
    if shown_ids:
        stepped = LineageFold(steps=True, only=shown_ids)
        async for event in ledger.read(kinds=LINEAGE_KINDS):
            if event.seq > last:
                break  # appended since the first read: not in the states above either
            stepped.feed(event)
        for rollout_id in shown_ids:
            report.rollouts[rollout_id].steps = stepped.report.rollouts[rollout_id].steps
    return ReportLineage(
        report=report,
        shown=[report.rollouts[r] for r in shown_ids],
        left_out=len(ids) - len(shown_ids),
        saves=saves,
        cap=cap,
    )
