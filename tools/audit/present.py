"""Terminal rendering of audit results with rich.

Ledger-derived text (server names, ids, reasons, reply details) is always wrapped in
`rich.text.Text`, never interpolated into markup, so a hostile server reply cannot inject markup.
Colours reach the terminal only (the shared console drops them when stdout is not a terminal).

The attempt model and the wire routes (`quiesce.coordinator.protocol`, pydantic) are imported by the
functions that use them: `quiesce history` needs only `duration`, `short_at` and `widened`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from quiesce.tools.audit.timefmt import duration, short_at

if TYPE_CHECKING:
    from quiesce.tools.audit.attempts import AttemptView, Call
    from quiesce.tools.audit.check import CheckReport

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


def short_route(call: Call) -> str:
    from quiesce.coordinator.protocol import PREFIX

    path = call.path.split("?", 1)[0]
    return f"{call.method} {path[len(PREFIX) :] if path.startswith(PREFIX) else path}"


def _cell(text: str | None, style: str = "") -> Text:
    return Text(text if text is not None else "-", style=style)


def calls_table(view: AttemptView) -> Table:
    from quiesce.tools.audit.attempts import call_duration

    table = Table(title="calls", title_justify="left", expand=False)
    for name in ("sent", "outcome", "phase", "server", "route", "result", "elapsed", "epoch"):
        table.add_column(name, justify="right" if name in ("sent", "outcome", "elapsed", "epoch") else "left")
    for call in view.calls:
        table.add_row(
            Text(str(call.sent_seq)),
            _cell(str(call.outcome_seq) if call.outcome_seq is not None else None),
            _cell(call.phase),
            _cell(call.server),
            _cell(short_route(call)),
            _cell(call.result, OUTCOME_STYLE.get(call.outcome, "")),
            _cell(duration(call_duration(call))),
            Text(str(call.epoch)),
        )
    return table


def matrix_table(view: AttemptView) -> Table:
    matrix = view.matrix()
    phases = list(next(iter(matrix.values()), {}).keys())
    table = Table(title="participant × phase", title_justify="left")
    table.add_column("server")
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
            letter = PHASE_LETTER.get(call.phase, "?")
            for i in range(col(call.sent_ts), col(end) + 1):
                chars[i], styles[i] = letter, style
        line = Text(server.ljust(label_width) + " ▕")
        for ch, st in zip(chars, styles, strict=True):
            line.append(ch, style=st)
        line.append("▏")
        lines.append(line)
    legend = "  ".join(f"{letter} {phase}" for phase, letter in PHASE_LETTER.items())
    axis = Text(
        " " * label_width + f"  0{' ' * (width - 2 - len(duration(span)))}{duration(span)}", style="dim"
    )
    lines.append(axis)
    lines.append(Text(f"{legend}   | deadline", style="dim"))
    return Group(*lines)


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
    if view.abort_reason:
        text.append(f"\nabort reason: {view.abort_reason}")
    if view.left_paused:
        text.append(f"\nleft paused: {', '.join(view.left_paused)}", style="red")
    if view.published_dir:
        text.append(f"\npublished: {view.published_dir}")
    return text


def widened(console: Console) -> Console:
    """`console` on a terminal; when piped, a console on the same stream at least 240 columns wide,
    so tables are not squeezed into 80 columns (still without colours): a history row, with its
    checkpoint id and snapshot (`q<ledger id>-<seq>-e<epoch>`, 25 characters each), fits one line."""
    if console.is_terminal:
        return console
    return Console(file=console.file, width=max(console.width, 240), highlight=False)


def print_attempt(console: Console, view: AttemptView) -> None:
    console = widened(console)
    console.print(attempt_header(view))
    console.print(calls_table(view))
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
    judged = sum(1 for v in report.attempts.values() if v == "judged")
    opened = len(report.attempts) - judged
    summary = Text(f"protocol: {len(report.attempts)} attempts ({judged} ended, {opened} open), ")
    if report.ok:
        summary.append("no violations", style="green")
    else:
        summary.append(f"{len(report.violations)} violations", style="bold red")
    if report.warnings:
        summary.append(f", {len(report.warnings)} warnings", style="yellow")
    console.print(summary)
    for title, items, style in (
        ("violations", report.violations, "red"),
        ("warnings", report.warnings, "yellow"),
    ):
        if not items:
            continue
        table = Table(title=title, title_justify="left", title_style=style)
        for name in ("seq", "rule", "checkpoint", "server", "what"):
            table.add_column(name)
        for item in items:
            table.add_row(
                Text(str(item.seq)),
                Text(item.rule, style=style),
                _cell(item.checkpoint_id),
                _cell(item.server),
                Text(item.message),
            )
        widened(console).print(table)
