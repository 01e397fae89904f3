"""Terminal rendering of audit results with rich.

Ledger-derived text (server names, ids, reasons, reply details) is always wrapped in
`rich.text.Text`, never interpolated into markup, so a hostile server reply cannot inject markup.
Colours reach the terminal only (the shared console drops them when stdout is not a terminal).
An id, a server name or a path is never cut in a table: its column is added with `whole_column`
(not wrapped, as wide as its longest value), so the other columns wrap instead. `wide` tables add
columns (`quiesce show -o wide`).

The attempt model and the wire routes (`quiesce.coordinator.protocol`, pydantic) are imported by the
functions that use them: `quiesce history` needs only `duration`, `short_at` and `widened`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from rich.cells import cell_len
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.table import Table
from rich.text import Text

from quiesce.tools.audit.timefmt import duration, short_at

if TYPE_CHECKING:
    from quiesce.tools.audit.attempts import AttemptView, Call, V2Facts
    from quiesce.tools.audit.check import CheckReport
    from quiesce.tools.audit.operations import EpisodeOperation

OUTCOME_STYLE: Final = {
    "acknowledged": "green",
    "failed": "red",
    "unknown": "yellow",
    "compensated": "cyan",
    "not sent": "magenta",
}
RESULT_STYLE: Final = {
    "published": "green",
    "restored": "green",
    "resumed": "green",
    "aborted": "red",
    "abandoned": "red",
}
#: One letter per phase in the compact timeline.
PHASE_LETTER: Final = {
    "prepare": "p",
    "commit": "c",
    "restore": "r",
    "resume": "s",
    "rollback": "b",
    "recovery": "v",
}
#: The letters of the phases only Gym's unified plane (v2) has, added for its attempts.
V2_PHASE_LETTER: Final = {"renew": "n", "retire": "x", "forget": "f"}
#: What each plane is, for people.
PLANES: Final = {"v1": "Gym's control plane v1", "v2": "Gym's unified checkpoint plane"}
#: Episodes named in a line before the rest are counted.
NAMED: Final = 5


def whole_column(
    table: Table, header: str, values: Iterable[str | Text], justify: JustifyMethod = "left"
) -> None:
    """Add column `header` whose values (ids, names, paths) are never cut: not wrapped, at least as
    wide as the longest; should the table still not fit, rich folds the value onto the next line
    rather than eliding it."""
    width = max([cell_len(header), *(cell_len(v.plain if isinstance(v, Text) else v) for v in values)])
    table.add_column(header, no_wrap=True, overflow="fold", min_width=width, justify=justify)


#: The least width a wrapping column is planned with (`add_columns`).
_FREE_MIN: Final = 8


@dataclass(frozen=True)
class ColumnSpec:
    """One column of `add_columns`: `kind` `whole` (ids, paths: never cut), `compact` (short
    values, kept on one line while the table fits) or `free` (wraps)."""

    header: str
    values: Sequence[str | Text]
    kind: Literal["whole", "compact", "free"] = "free"
    justify: JustifyMethod = "left"


def add_columns(table: Table, specs: Sequence[ColumnSpec], width: int) -> None:
    """Add `specs` to `table` for a console `width` wide: `whole` columns never cut; `compact`
    ones on one line when, with the `whole` ones and `_FREE_MIN` per `free` one, the table fits
    `width`; everything else wraps (folds), never elides."""

    def longest(spec: ColumnSpec) -> int:
        words = [cell_len(word) for word in spec.header.split()]
        return max([1, *words, *(cell_len(v.plain if isinstance(v, Text) else v) for v in spec.values)])

    planned = sum(longest(s) for s in specs if s.kind != "free") + 2 * (len(specs) - 1)
    planned += _FREE_MIN * sum(1 for s in specs if s.kind == "free")
    for spec in specs:
        if spec.kind == "whole":
            whole_column(table, spec.header, spec.values, spec.justify)
        elif spec.kind == "compact" and planned <= width:
            table.add_column(
                spec.header, justify=spec.justify, no_wrap=True, overflow="fold", min_width=longest(spec)
            )
        else:
            table.add_column(spec.header, justify=spec.justify, overflow="fold")


def count(n: int, noun: str) -> str:
    """`1 attempt`, `2 attempts` (`quiesce.coordinator.wording.count`)."""
    from quiesce.coordinator.wording import count as counted

    return counted(n, noun)


def short_route(call: Call) -> str:
    from quiesce.coordinator.protocol import PREFIX

    path = call.path.split("?", 1)[0]
    return f"{call.method} {path[len(PREFIX) :] if path.startswith(PREFIX) else path}"


def _cell(text: str | None, style: str = "") -> Text:
    return Text(text if text is not None else "-", style=style)


#: The columns of the calls table; `wide` adds the last three.
CALL_COLUMNS: Final = ("sent", "outcome", "phase", "server", "route", "result", "elapsed", "epoch")
WIDE_CALL_COLUMNS: Final = ("sent at (UTC)", "url", "detail")
_WHOLE_CALL_COLUMNS: Final = frozenset({"server", "route", "url"})


def calls_table(view: AttemptView, *, wide: bool = False) -> Table:
    from quiesce.tools.audit.attempts import call_duration

    table = Table(title="calls", title_justify="left", expand=False)
    rows = [
        [
            Text(str(call.sent_seq)),
            _cell(str(call.outcome_seq) if call.outcome_seq is not None else None),
            _cell(call.phase),
            _cell(call.server),
            _cell(short_route(call)),
            _cell(call.result, OUTCOME_STYLE.get(call.outcome, "")),
            _cell(duration(call_duration(call))),
            Text(str(call.epoch)),
            *([_cell(short_at(call.sent_at)), _cell(call.url), _cell(call.detail)] if wide else []),
        ]
        for call in view.calls
    ]
    for i, name in enumerate(CALL_COLUMNS + (WIDE_CALL_COLUMNS if wide else ())):
        justify: JustifyMethod = "right" if name in ("sent", "outcome", "elapsed", "epoch") else "left"
        if name in _WHOLE_CALL_COLUMNS:
            whole_column(table, name, [row[i] for row in rows], justify)
        else:
            table.add_column(name, justify=justify)
    for row in rows:
        table.add_row(*row)
    return table


def matrix_table(view: AttemptView) -> Table:
    matrix = view.matrix()
    phases = list(next(iter(matrix.values()), {}).keys())
    table = Table(title="participant × phase", title_justify="left")
    whole_column(table, "server", list(matrix))
    for phase in phases:
        table.add_column(phase)
    for server, row in matrix.items():
        cells: list[RenderableType] = [Text(server)]
        for phase in phases:
            cell = row[phase]
            label = cell.state or ("·" if not cell.intended else "")
            if cell.sent > 1:
                label += f" ×{cell.sent}"
            if cell.failed and cell.state != "failed":
                label += f" ({cell.failed} failed)"
            cells.append(Text(label, style=OUTCOME_STYLE.get(cell.state, "dim")))
        table.add_row(*cells)
    return table


def recovery_table(view: AttemptView) -> Table:
    table = Table(title="recovery evidence", title_justify="left")
    for name in ("seq", "epoch", "server", "reported phase", "active checkpoint", "action", "result"):
        if name == "server":
            whole_column(table, name, [item.server or "-" for item in view.recovery])
        elif name == "active checkpoint":
            whole_column(table, name, [item.active_checkpoint_id or "-" for item in view.recovery])
        else:
            table.add_column(name)
    for item in view.recovery:
        table.add_row(
            Text(str(item.seq)),
            Text(str(item.epoch)),
            _cell(item.server),
            _cell(item.reported_phase),
            _cell(item.active_checkpoint_id),
            _cell(item.action),
            _cell(item.result),
        )
    return table


def timeline(view: AttemptView, width: int = 60) -> Group:
    """One line per server: each call drawn over its time span with its phase letter, coloured by
    outcome (green acknowledged, red failed, yellow unknown, cyan compensating); `|` marks the
    deadline when it falls inside the drawn span."""
    lines: list[Text] = []
    if not view.calls or view.start_ts is None:
        return Group(Text("(no calls)", style="dim"))
    t0 = view.start_ts
    t1 = max([view.end_ts or t0] + [c.outcome_ts or c.sent_ts for c in view.calls])
    span = max(t1 - t0, 1e-6)

    def col(ts: float) -> int:
        return min(width - 1, max(0, int((ts - t0) / span * (width - 1))))

    letters = {**PHASE_LETTER, **(V2_PHASE_LETTER if view.plane == "v2" else {})}
    servers = view.servers()
    label_width = max(len(s) for s in servers)
    deadline_col = col(view.deadline_ts) if view.deadline_ts is not None and view.deadline_ts <= t1 else None
    for server in servers:
        chars = [" "] * width
        styles = [""] * width
        if deadline_col is not None:
            chars[deadline_col], styles[deadline_col] = "|", "bold red"
        for call in view.calls:
            if call.server != server:
                continue
            end = call.outcome_ts if call.outcome_ts is not None else t1
            style = OUTCOME_STYLE[call.outcome]
            if call.phase in ("rollback", "recovery") and call.settles:
                style = OUTCOME_STYLE["compensated"]
            letter = letters.get(call.phase, "?")
            for i in range(col(call.sent_ts), col(end) + 1):
                chars[i], styles[i] = letter, style
        line = Text(server.ljust(label_width) + " ▕")
        for ch, st in zip(chars, styles, strict=True):
            line.append(ch, style=st)
        line.append("▏")
        lines.append(line)
    legend = "  ".join(f"{letter} {phase}" for phase, letter in letters.items())
    axis = Text(
        " " * label_width + f"  0{' ' * (width - 2 - len(duration(span)))}{duration(span)}", style="dim"
    )
    lines.append(axis)
    lines.append(Text(f"{legend}   | deadline", style="dim"))
    if view.v2 is not None:
        lines.append(Text(renewals_text(view.v2), style="dim"))
    return Group(*lines)


def renewals_text(facts: V2Facts) -> str:
    """`renewals: 3, last lease until 2025-01-02 03:04:05 UTC` (or `renewals: none`)."""
    if not facts.renewals:
        return "renewals: none"
    from datetime import UTC, datetime

    text = f"renewals: {facts.renewals}"
    if facts.last_lease is not None:
        until = datetime.fromtimestamp(facts.last_lease, UTC).strftime("%Y-%m-%d %H:%M:%S")
        text += f", last lease until {until} UTC"
    return text


def keys_text(keys: Sequence[str], limit: int = NAMED) -> str:
    """`r0, r1, r2 and 4 more`: the first `limit` capture keys named, the rest counted."""
    more = len(keys) - limit
    return ", ".join(keys[:limit]) + (f" and {more} more" if more > 0 else "")


def per_server_counts(values: dict[str, tuple[str, ...]]) -> str:
    """`environment 5, policy_model 3`: how many episodes each server holds."""
    return ", ".join(f"{name} {len(keys)}" for name, keys in values.items()) or "-"


def operation_text(op: EpisodeOperation) -> str:
    """One retire or forget in a line: what, of whom, and who failed."""
    noun = "episode" if op.operation == "retire" else "rollout"
    text = f"{op.operation} {count(len(op.items), noun)} ({keys_text(list(op.items))})"
    text += f" on {', '.join(op.servers) or 'no server'}"
    if op.reason:
        text += f" — {op.reason}"
    if op.failed:
        text += "; failed: " + "; ".join(f"{n} ({why})" for n, why in op.failed.items())
    return text


def v2_lines(view: AttemptView) -> list[tuple[str, str]]:
    """The unified plane's facts of an attempt, as (text, style) lines: its scope, restarts,
    exports, blockers, restored attempts and episode operations (none for a v1 attempt)."""
    facts = view.v2
    if facts is None:
        return []
    lines: list[tuple[str, str]] = []
    if facts.stop:
        lines.append(("stop-checkpoint: its servers stay paused once published", ""))
    if facts.blockers or facts.blocker_counts:
        for name, total in facts.blocker_counts.items() or ((n, len(k)) for n, k in facts.blockers.items()):
            named = keys_text(list(facts.blockers.get(name, ())))
            lines.append((f"blocked: {name} by {count(total, 'episode')} ({named})", "red"))
    if facts.scope is not None:
        lines.append((f"scope: {count(len(facts.scope), 'episode')} ({facts.scope_source or '?'})", ""))
    restarts = {n: k for n, k in facts.restarts.items() if k}
    if restarts:
        text = "; ".join(f"{n}: {keys_text(list(k))}" for n, k in restarts.items())
        lines.append((f"restarts (left out of the scope): {text}", "yellow"))
    if facts.exported:
        lines.append((f"exported: {per_server_counts(facts.exported)}", ""))
    if facts.restored_from is not None or facts.restored:
        inventory = f"{count(len(facts.inventory), 'episode')} " if facts.inventory is not None else ""
        lines.append((f"restored {inventory}from {facts.restored_from or '?'}", ""))
        lines.append((f"restored attempts: {per_server_counts(facts.restored)}", ""))
    for op in facts.operations:
        lines.append((f"{op.operation} (seq {op.seq}): {operation_text(op)}", "red" if op.failed else ""))
    return lines


def attempt_header(view: AttemptView) -> Text:
    text = Text()
    text.append("attempt ", style="bold")
    text.append(view.checkpoint_id, style="bold")
    text.append(f"  {view.kind or '?'}  ")
    outcome = view.outcome or "in progress"
    text.append(outcome, style=RESULT_STYLE.get(outcome, "yellow"))
    text.append(f"\nstarted {short_at(view.started_at)} UTC (epoch {view.epoch})")
    text.append(f"  duration {duration(view.duration_s)}")
    if view.deadline_ts is not None and view.start_ts is not None:
        text.append(f"  budget {duration(view.deadline_ts - view.start_ts)}")
    text.append(f"\nparticipants: {', '.join(view.participants) or '-'}")
    if view.v2 is not None:
        kinds = ", ".join(f"{n} ({k})" for n, k in view.v2.kinds.items())
        text.append(
            f"\nplane: {view.plane} ({PLANES.get(view.plane, 'unknown')})" + (f": {kinds}" if kinds else "")
        )
        for line, style in v2_lines(view):
            text.append(f"\n{line}", style=style)
    if view.abort_reason:
        text.append(f"\nabort reason: {view.abort_reason}")
    if view.left_paused:
        text.append(f"\nleft paused: {', '.join(view.left_paused)}", style="red")
    if view.published_dir:
        text.append(f"\npublished: {view.published_dir}")
    return text


def operations_table(operations: Sequence[EpisodeOperation], title: str = "operations") -> Table:
    """The retires and forgets recorded outside any attempt (Gym's unified plane), oldest first."""
    table = Table(title=title, title_justify="left")
    table.add_column("seq", justify="right")
    table.add_column("at (UTC)")
    table.add_column("operation")
    whole_column(table, "servers", [", ".join(op.servers) or "-" for op in operations])
    table.add_column("what")
    table.add_column("failed")
    for op in operations:
        table.add_row(
            Text(str(op.seq)),
            Text(short_at(op.at)),
            Text(op.operation),
            Text(", ".join(op.servers) or "-"),
            Text(
                f"{count(len(op.items), 'episode' if op.operation == 'retire' else 'rollout')}: "
                f"{keys_text(list(op.items))}"
            ),
            Text(
                "; ".join(f"{n} ({why})" for n, why in op.failed.items()) or "-",
                style="red" if op.failed else "",
            ),
        )
    return table


def widened(console: Console) -> Console:
    """`console` on a terminal; when piped, a console on the same stream at least 240 columns wide,
    so tables are not squeezed into 80 columns (still without colours): a history row, with its
    checkpoint id and snapshot (`q<ledger id>-<seq>-e<epoch>`, 25 characters each), fits one line."""
    if console.is_terminal:
        return console
    return Console(file=console.file, width=max(console.width, 240), highlight=False)


def print_attempt(console: Console, view: AttemptView, *, wide: bool = False) -> None:
    console = widened(console)
    console.print(attempt_header(view))
    console.print(calls_table(view, wide=wide))
    console.print(matrix_table(view))
    if view.recovery:
        console.print(recovery_table(view))
    for seq, message in view.pairing_errors:
        console.print(Text(f"seq {seq}: {message}", style="red"))
    console.print(Text("timeline", style="italic"))
    console.print(timeline(view))


def print_check(console: Console, report: CheckReport) -> None:
    verdict = report.chain
    style = "green" if verdict.ok else ("bold red" if verdict.ok is False else "yellow")
    console.print(Text(verdict.describe(), style=style))
    projection = report.projection
    if projection.verified:
        console.print(Text(projection.describe(), style="green" if projection.ok else "bold red"))
    if projection.differences:
        table = Table(title="projection differences", title_justify="left", title_style="red")
        whole_column(table, "checkpoint", [d.checkpoint_id for d in projection.differences])
        table.add_column("column")
        table.add_column("in the projection")
        table.add_column("from the events")
        for d in projection.differences:
            table.add_row(_cell(d.checkpoint_id), Text(d.column), Text(repr(d.live)), Text(repr(d.rebuilt)))
        widened(console).print(table)
    judged = sum(1 for v in report.attempts.values() if v == "judged")
    opened = len(report.attempts) - judged
    summary = Text(f"protocol: {count(len(report.attempts), 'attempt')} ({judged} ended, {opened} open), ")
    if not report.violations:
        summary.append("no violations", style="green")
    else:
        summary.append(count(len(report.violations), "violation"), style="bold red")
    if report.warnings:
        summary.append(f", {count(len(report.warnings), 'warning')}", style="yellow")
    console.print(summary)
    if report.rollouts is not None:
        states = ", ".join(f"{n} {state}" for state, n in report.rollouts.items() if n)
        console.print(
            Text(
                f"rollouts: {count(sum(report.rollouts.values()), 'rollout')}"
                + (f" ({states})" if states else "")
            )
        )
    for title, items, style in (
        ("violations", report.violations, "red"),
        ("warnings", report.warnings, "yellow"),
    ):
        if not items:
            continue
        table = Table(title=title, title_justify="left", title_style=style)
        table.add_column("seq")
        table.add_column("rule")
        whole_column(table, "checkpoint", [item.checkpoint_id or "-" for item in items])
        whole_column(table, "server", [item.server or "-" for item in items])
        table.add_column("what")
        for item in items:
            table.add_row(
                Text(str(item.seq)),
                Text(item.rule, style=style),
                _cell(item.checkpoint_id),
                _cell(item.server),
                Text(item.message),
            )
        widened(console).print(table)
