"""The timeline report: one self-contained HTML page of checkpoint attempts.

`render_report(views)` returns the page. It loads and runs nothing: no network, no script, no
external style or font; the CSS is inline, and a Content-Security-Policy meta tag (`default-src
'none'`, the inline style allowed only by its sha256) makes the browser refuse anything else. The
page holds:

- a summary table of the attempts, oldest first (the order of `quiesce history`): kind, outcome,
  start, duration, participants, calls, failures, the slowest server (largest total call time)
  and the recovering epoch;
- per attempt, a Gantt chart in inline SVG: one lane (`<g class="lane">`) per server, one bar
  (`<rect class="bar ...">`) per call from its `call.sent` to its outcome, coloured by outcome
  (acknowledged, failed, unknown) with rollback/recovery resumes outlined as compensations, phase
  bands behind the lanes, labelled above them (a label that would run into the one before it moves
  up a row, so short phases never overprint each other), the deadline as a red line (or an
  arrow at the right edge when it lies far beyond the last event), and recovery actions
  (`recovery.settled`) as diamonds on their lane;
- for an attempt on Gym's unified plane (v2), its plane and the facts its `episodes.*` events
  recorded (scope, restarts, exports, blockers, restored attempts, retires and forgets) and its
  renewals (`<ul class="v2">`, one `<li>` each);
- given the ledger's rollout lineage (`tools.audit.lineage.report_lineage`): per published save
  shown, the rollout attempts it captured, left out as restarts and showed lost, and those retired
  since the previous published save (in its section's facts, and a table); then a "Rollouts"
  section (`<section class="rollouts">`): the count in each state, the lineage violations and
  warnings (`<li class="violation">`), and one row per rollout shown with its lineage strip (one
  `<li class="step step-<what>">` per step, across checkpoints and restores), a lost rollout's
  row `<tr class="rollout state-lost">` in red. It shows the first `REPORT_CAP` rollouts by id
  and every lost one, and says how many it left out (and how many violations past the cap).

Invariants: every ledger-derived string reaches the page only through `html.escape` (text and
attribute values alike); class names come from fixed vocabularies, never from ledger text; element
ids are positional (`attempt-<n>`). The page carries nothing for tests: a browser test reads the
rendered DOM and the browser's console.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from typing import Final

from quiesce.ledger.lineage import STATES, LineageViolation, Rollout, Step
from quiesce.tools.audit.attempts import AttemptView, Call, Settled, call_duration
from quiesce.tools.audit.lineage import REPORT_CAP, ReportLineage, SaveFigures
from quiesce.tools.audit.present import PLANES, renewals_text, short_route, v2_lines
from quiesce.tools.audit.timefmt import duration, short_at

WIDTH: Final = 1100
LABEL_W: Final = 170
RIGHT_PAD: Final = 70
LANE_H: Final = 24
#: Top of the first lane with one row of phase labels above it; each further row adds LABEL_ROW_H.
TOP: Final = 34
LABEL_ROW_H: Final = 15
#: Width of one character of a phase label (11px system-ui), on the generous side, and the gap
#: kept after a label.
LABEL_CHAR_W: Final = 7.0
LABEL_GAP: Final = 6.0
BOTTOM: Final = 26
#: The deadline is drawn to scale only when it lies within this multiple of the activity span.
DEADLINE_SCALE_LIMIT: Final = 3.0

_PHASES: Final = frozenset({"prepare", "commit", "restore", "resume", "rollback", "recovery"})
_OUTCOMES: Final = frozenset({"acknowledged", "failed", "unknown"})

CSS: Final = """
:root { --ok: #2e9e4f; --bad: #d0342c; --unk: #e0a100; --comp: #1c7ed6; --ink: #1f2328; --mute: #6e7781; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
       margin: 24px; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 6px; }
.meta { color: var(--mute); margin: 0 0 12px; }
table.summary { border-collapse: collapse; margin: 8px 0 16px; }
table.summary th, table.summary td { border-bottom: 1px solid #d8dee4; padding: 4px 10px; text-align: left;
       white-space: nowrap; }
table.summary th { background: #f6f8fa; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.outcome-published, .outcome-restored, .outcome-resumed { color: var(--ok); font-weight: 600; }
.outcome-aborted, .outcome-abandoned { color: var(--bad); font-weight: 600; }
.outcome-open { color: var(--unk); font-weight: 600; }
section.attempt { margin-bottom: 28px; }
svg.gantt { display: block; border: 1px solid #d8dee4; background: #fff; }
svg text { font: 12px system-ui, sans-serif; fill: var(--ink); }
svg text.tick, svg text.band-label { fill: var(--mute); font-size: 11px; }
.lane-bg { fill: #fafbfc; } .lane:nth-of-type(2n) .lane-bg { fill: #f3f5f7; }
.band { opacity: 0.16; } .band-prepare { fill: #8250df; } .band-commit { fill: #1f883d; }
.band-restore { fill: #0969da; } .band-resume { fill: #bf8700; } .band-rollback { fill: #cf222e; }
.band-recovery { fill: #57606a; } .band-other { fill: #57606a; }
rect.bar { stroke-width: 0; rx: 2; }
rect.bar.outcome-acknowledged { fill: var(--ok); } rect.bar.outcome-failed { fill: var(--bad); }
rect.bar.outcome-unknown { fill: var(--unk); stroke: #8a6400; stroke-width: 1; stroke-dasharray: 3 2; }
rect.bar.compensating { stroke: var(--comp); stroke-width: 2; }
line.deadline { stroke: var(--bad); stroke-width: 2; stroke-dasharray: 6 3; }
text.deadline { fill: var(--bad); font-size: 11px; }
path.recovery-mark { fill: var(--comp); stroke: #fff; stroke-width: 1; }
line.axis { stroke: #afb8c1; }
.legend { color: var(--mute); font-size: 12px; margin: 4px 0 0; }
.legend span { display: inline-block; width: 12px; height: 12px; vertical-align: -2px; margin: 0 4px 0 12px; }
.sw-ack { background: var(--ok); } .sw-fail { background: var(--bad); } .sw-unk { background: var(--unk); }
.sw-comp { border: 2px solid var(--comp); } .sw-dead { border-left: 2px dashed var(--bad); }
.sw-rec { background: var(--comp); transform: rotate(45deg) scale(0.7); }
.empty { color: var(--mute); font-style: italic; }
section.rollouts { margin-top: 36px; }
table.lineage td.id { font-family: ui-monospace, monospace; white-space: nowrap; }
ol.strip { list-style: none; margin: 0; padding: 0; display: flex; flex-wrap: wrap; gap: 2px 18px; }
ol.strip li { position: relative; white-space: nowrap; padding: 1px 6px; border-radius: 3px;
       background: #eef1f4; }
ol.strip li + li::before { content: "\\2192"; position: absolute; left: -15px; color: var(--mute);
       font-weight: 400; }
ol.strip li.step-captured { background: #dafbe1; } ol.strip li.step-continued { background: #ddf4ff; }
ol.strip li.step-restart, ol.strip li.step-discarded, ol.strip li.step-retired { background: #fff8c5; }
ol.strip li.step-lost { background: #ffebe9; color: var(--bad); font-weight: 600; }
td.state-live { color: var(--ok); } td.state-restarted, td.state-retired { color: #9a6700; }
tr.state-lost td { color: var(--bad); font-weight: 600; background: #fff5f5; }
ul.lineage li.violation { color: var(--bad); } ul.lineage li.warning { color: #9a6700; }
"""


def _sha256_b64(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def _e(value: object) -> str:
    """HTML-escape any value for text or a quoted attribute."""
    return escape(str(value), quote=True)


def _phase_token(phase: str) -> str:
    return phase if phase in _PHASES else "other"


def _num(value: float) -> str:
    return f"{value:.1f}"


class _Scale:
    """Maps Unix seconds to x pixels across the chart area."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, max(t1, t0 + 1e-6)
        self.x0, self.x1 = float(LABEL_W), float(WIDTH - RIGHT_PAD)

    def x(self, ts: float) -> float:
        ratio = (ts - self.t0) / (self.t1 - self.t0)
        return self.x0 + max(0.0, min(1.0, ratio)) * (self.x1 - self.x0)


def _call_title(call: Call) -> str:
    parts = [
        f"{call.server} — {call.phase} {short_route(call)}",
        f"result: {call.result}" + (f" — {call.detail}" if call.detail else ""),
        f"elapsed: {duration(call_duration(call))}",
        f"seq {call.sent_seq} → {'?' if call.outcome_seq is None else call.outcome_seq} (epoch {call.epoch})",
    ]
    return "\n".join(parts)


def _settled_title(item: Settled) -> str:
    return (
        f"recovery (epoch {item.epoch}, seq {item.seq}): reported {item.reported_phase}, "
        f"active {item.active_checkpoint_id}; action {item.action}: {item.result}"
    )


def label_rows(starts: Sequence[tuple[float, str]], right: float) -> list[tuple[float, int]]:
    """Where each phase label goes: (x, row) for labels `(band start x, text)` in band order.

    A label starts 3px into its band (moved left so it ends by `right`) and takes the lowest row
    (0 is just above the lanes) where it starts `LABEL_GAP` after every label already in it."""
    ends: list[float] = []
    placed: list[tuple[float, int]] = []
    for start, text in starts:
        width = len(text) * LABEL_CHAR_W
        x = max(float(LABEL_W), min(start + 3, right - width))
        row = next((i for i, end in enumerate(ends) if end + LABEL_GAP <= x), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = x + width
        placed.append((x, row))
    return placed


def gantt(view: AttemptView) -> str:
    """The SVG Gantt chart of one attempt (see the module docstring)."""
    servers = view.servers()
    if view.start_ts is None or not servers:
        return '<p class="empty">no calls recorded</p>'
    t0 = view.start_ts
    activity_end = max([view.end_ts or t0] + [c.outcome_ts or c.sent_ts for c in view.calls])
    span = max(activity_end - t0, 1e-3)
    deadline = view.deadline_ts
    deadline_in_scale = deadline is not None and deadline - t0 <= span * DEADLINE_SCALE_LIMIT
    t1 = max(activity_end, deadline) if deadline is not None and deadline_in_scale else activity_end
    scale = _Scale(t0, t1 + (t1 - t0) * 0.02)
    bands = [
        (scale.x(p.start_ts), scale.x(p.end_ts if p.end_ts is not None else activity_end), p)
        for p in view.phases
    ]
    labels = label_rows([(start, p.phase) for start, _, p in bands], scale.x1)
    top = TOP + LABEL_ROW_H * max([row for _, row in labels], default=0)
    height = top + LANE_H * len(servers) + BOTTOM
    lanes_bottom = top + LANE_H * len(servers)
    out: list[str] = [
        f'<svg class="gantt" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="timeline of {_e(view.checkpoint_id)}">'
    ]
    # phase bands (behind everything), each label in its row above the lanes
    for (start, end, span_), (label_x, row) in zip(bands, labels, strict=True):
        token = _phase_token(span_.phase)
        out.append(
            f'<g class="phase-band"><rect class="band band-{token}" x="{_num(start)}" y="{top - 16}" '
            f'width="{_num(max(end - start, 1.0))}" height="{lanes_bottom - top + 16}">'
            f"<title>{_e(span_.phase)} ({_e(span_.status)}"
            f"{': ' + _e(span_.reason) if span_.reason else ''})</title></rect>"
            f'<text class="band-label" x="{_num(label_x)}" y="{top - 5 - LABEL_ROW_H * row}">'
            f"{_e(span_.phase)}</text></g>"
        )
    # lanes
    for index, server in enumerate(servers):
        y = top + index * LANE_H
        out.append(f'<g class="lane" data-server="{_e(server)}">')
        out.append(
            f'<rect class="lane-bg" x="{LABEL_W}" y="{y}" width="{WIDTH - LABEL_W - RIGHT_PAD}" '
            f'height="{LANE_H}" />'
        )
        out.append(f'<text class="lane-label" x="8" y="{y + LANE_H / 2 + 4:.1f}">{_e(server)}</text>')
        for call in view.calls:
            if call.server != server:
                continue
            start = scale.x(call.sent_ts)
            end = scale.x(call.outcome_ts if call.outcome_ts is not None else activity_end)
            classes = ["bar", f"outcome-{call.outcome if call.outcome in _OUTCOMES else 'unknown'}"]
            classes.append(f"phase-{_phase_token(call.phase)}")
            if call.phase in ("rollback", "recovery"):
                classes.append("compensating")
            out.append(
                f'<rect class="{" ".join(classes)}" x="{_num(start)}" y="{y + 4}" '
                f'width="{_num(max(end - start, 2.0))}" height="{LANE_H - 8}" '
                f'data-call-id="{_e(call.call_id)}" data-seq="{call.sent_seq}">'
                f"<title>{_e(_call_title(call))}</title></rect>"
            )
        for item in view.recovery:
            if item.server != server:
                continue
            cx, cy = scale.x(item.ts), y + LANE_H / 2
            out.append(
                f'<path class="recovery-mark" d="M{_num(cx)} {_num(cy - 7)} L{_num(cx + 7)} {_num(cy)} '
                f'L{_num(cx)} {_num(cy + 7)} L{_num(cx - 7)} {_num(cy)} Z" data-seq="{item.seq}">'
                f"<title>{_e(_settled_title(item))}</title></path>"
            )
        out.append("</g>")
    # axis and ticks
    out.append(
        f'<line class="axis" x1="{LABEL_W}" y1="{lanes_bottom}" x2="{WIDTH - RIGHT_PAD}" '
        f'y2="{lanes_bottom}" />'
    )
    for i in range(6):
        ts = scale.t0 + (scale.t1 - scale.t0) * i / 5
        x = scale.x(ts)
        out.append(
            f'<text class="tick" x="{_num(x)}" y="{lanes_bottom + 16}" text-anchor="middle">'
            f"+{_e(duration(ts - t0))}</text>"
        )
    # the deadline
    if deadline is not None:
        if deadline_in_scale:
            x = scale.x(deadline)
            out.append(
                f'<line class="deadline" x1="{_num(x)}" y1="{top - 18}" x2="{_num(x)}" y2="{lanes_bottom}">'
                f"<title>deadline +{_e(duration(deadline - t0))}</title></line>"
            )
        else:
            x = float(WIDTH - RIGHT_PAD + 4)
            out.append(
                f'<line class="deadline offscale" x1="{_num(x)}" y1="{top - 18}" x2="{_num(x)}" '
                f'y2="{lanes_bottom}">'
                f"<title>deadline +{_e(duration(deadline - t0))} (beyond this chart)</title></line>"
                f'<text class="deadline" x="{_num(x + 4)}" y="{top - 5}">deadline →</text>'
                f'<text class="deadline" x="{_num(x + 4)}" y="{top + 9}">'
                f"+{_e(duration(deadline - t0))}</text>"
            )
    out.append("</svg>")
    return "".join(out)


def _summary_row(index: int, view: AttemptView) -> str:
    outcome = view.outcome or "open"
    slow = view.slowest_server()
    recovered = sorted(
        {r.epoch for r in view.recovery} | {c.epoch for c in view.calls if c.phase == "recovery"}
    )
    failures = sum(1 for c in view.calls if c.outcome == "failed")
    outcome_class = (
        outcome if outcome in ("published", "restored", "resumed", "aborted", "abandoned") else "open"
    )
    cells = [
        f'<td><a href="#attempt-{index}">{_e(view.checkpoint_id)}</a></td>',
        f"<td>{_e(view.kind or '?')}</td>",
        f'<td class="outcome-{outcome_class}">{_e(outcome)}</td>',
        f"<td>{_e(short_at(view.started_at))}</td>",
        f'<td class="num">{_e(duration(view.duration_s))}</td>',
        f'<td class="num">{len(view.participants)}</td>',
        f'<td class="num">{len(view.calls)}</td>',
        f'<td class="num">{failures}</td>',
        f"<td>{_e(f'{slow[0]} ({duration(slow[1])})') if slow else '-'}</td>",
        f"<td>{_e(', '.join(f'epoch {e}' for e in recovered)) if recovered else '-'}</td>",
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def _attempt_section(index: int, view: AttemptView, figures: SaveFigures | None = None) -> str:
    outcome = view.outcome or "open (no terminal event)"
    facts = [
        f"{view.kind or '?'} · {outcome}",
        f"started {short_at(view.started_at)} UTC · epoch {view.epoch}",
        f"duration {duration(view.duration_s)}",
        f"{len(view.calls)} calls",
    ]
    if figures is not None:
        facts.append(f"rollouts: {_figures_text(figures)}")
    if view.abort_reason:
        facts.append(f"reason: {view.abort_reason}")
    if view.left_paused:
        facts.append(f"left paused: {', '.join(view.left_paused)}")
    return (
        f'<section class="attempt" id="attempt-{index}" data-checkpoint-id="{_e(view.checkpoint_id)}">'
        f"<h2>{_e(view.checkpoint_id)}</h2>"
        f'<p class="meta">{" · ".join(_e(f) for f in facts)}</p>'
        f"{_v2_facts(view)}"
        f"{gantt(view)}"
        '<p class="legend"><span class="sw-ack"></span>acknowledged<span class="sw-fail"></span>failed'
        '<span class="sw-unk"></span>unknown<span class="sw-comp"></span>rollback / recovery'
        '<span class="sw-dead"></span>deadline<span class="sw-rec"></span>recovery action</p>'
        "</section>"
    )


def _v2_facts(view: AttemptView) -> str:
    """The unified plane's facts of an attempt as a list (nothing for v1)."""
    if view.v2 is None:
        return ""
    lines = [f"plane {view.plane} ({PLANES.get(view.plane, 'unknown')})"]
    lines += [text for text, _ in v2_lines(view)]
    lines.append(renewals_text(view.v2))
    return '<ul class="v2">' + "".join(f"<li>{_e(line)}</li>" for line in lines) + "</ul>"


def _figures_text(figures: SaveFigures) -> str:
    return (
        f"{figures.captured} captured, {figures.restarted} restarted, {figures.lost} lost;"
        f" {figures.retired} retired since the previous save"
    )


def _violation_items(items: Sequence[LineageViolation], css: str) -> list[str]:
    shown = [
        f'<li class="{css}">seq {v.seq} · {_e(v.rule)} · {_e(v.rollout_id)}: {_e(v.message)}</li>'
        for v in items[:REPORT_CAP]
    ]
    if len(items) > REPORT_CAP:
        shown.append(
            f'<li class="more">and {len(items) - REPORT_CAP} more {css}s (quiesce check lists all)</li>'
        )
    return shown


def _rollout_row(rollout: Rollout) -> str:
    state = rollout.state if rollout.state in STATES else "live"
    steps = "".join(
        f'<li class="step step-{_step_token(s.what)}" title="{_e(_step_title(s))}">'
        f"{_e(_step_text(s.what, s.attempt, s.checkpoint_id))}</li>"
        for s in rollout.steps
    )
    return (
        f'<tr class="rollout state-{state}"><td class="id">{_e(rollout.rollout_id)}</td>'
        f'<td class="state-{state}">{_e(rollout.state)}</td><td class="num">{rollout.attempt}</td>'
        f'<td><ol class="strip">{steps}</ol></td></tr>'
    )


def _step_title(step: Step) -> str:
    servers = f" on {', '.join(step.servers)}" if step.servers else ""
    return f"seq {step.seq}{servers}" + (f" — {step.detail}" if step.detail else "")


_STEPS: Final = frozenset(
    {"captured", "restart", "continued", "discarded", "retired", "forgotten", "acknowledged", "ended", "lost"}
)


def _step_token(what: str) -> str:
    return what if what in _STEPS else "other"


def _step_text(what: str, attempt: int | None, checkpoint_id: str | None) -> str:
    text = what if attempt is None else f"{what} a{attempt}"
    return text + (f" @{checkpoint_id}" if checkpoint_id else "")


def _rollouts_section(lineage: ReportLineage, ordered: Sequence[tuple[int, AttemptView]]) -> str:
    """The "Rollouts" section (see the module docstring)."""
    report = lineage.report
    counts = ", ".join(f"{n} {state}" for state, n in report.counts().items() if n) or "none recorded"
    parts = [
        '<section class="rollouts" id="rollouts"><h2>Rollouts</h2>',
        f'<p class="meta">{len(report.rollouts)} rollouts: {_e(counts)}</p>',
    ]
    saves = [(i, v, lineage.saves[v.checkpoint_id]) for i, v in ordered if v.checkpoint_id in lineage.saves]
    if saves:
        rows = "".join(
            f'<tr class="save"><td class="id"><a href="#attempt-{i}">{_e(v.checkpoint_id)}</a></td>'
            + "".join(f'<td class="num">{n}</td>' for n in (f.captured, f.restarted, f.retired, f.lost))
            + "</tr>"
            for i, v, f in saves
        )
        parts.append(
            '<table class="summary saves"><thead><tr><th>published save</th><th>captured</th>'
            "<th>restarted</th><th>retired since the previous save</th><th>lost</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
    items = _violation_items(report.violations, "violation") + _violation_items(report.warnings, "warning")
    if items:
        parts.append(f'<ul class="lineage">{"".join(items)}</ul>')
    else:
        parts.append('<p class="empty">no lineage violations or warnings</p>')
    if lineage.shown:
        rows = "".join(_rollout_row(r) for r in lineage.shown)
        parts.append(
            '<table class="summary lineage"><thead><tr><th>rollout</th><th>state</th><th>attempt</th>'
            f"<th>lineage</th></tr></thead><tbody>{rows}</tbody></table>"
        )
    if lineage.left_out:
        parts.append(
            f'<p class="meta left-out">{lineage.left_out} more rollouts not shown: this page shows the first'
            f" {lineage.cap} by id and every lost one (quiesce rollouts lists all)</p>"
        )
    parts.append("</section>")
    return "".join(parts)


def render_report(
    views: Sequence[AttemptView],
    *,
    source: str,
    generated_at: datetime | None = None,
    lineage: ReportLineage | None = None,
) -> str:
    """The whole page for `views`, shown in their order (oldest first). `source` names the ledger;
    `lineage` (when given) adds each published save's rollout figures and the "Rollouts" section."""
    when = (generated_at or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    ordered = list(enumerate(views))
    csp = (
        f"default-src 'none'; style-src 'sha256-{_sha256_b64(CSS)}'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    head = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_e(csp)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>quiesce attempts — {_e(source)}</title><style>{CSS}</style></head>"
    )
    rows = "".join(_summary_row(i, v) for i, v in ordered)
    summary = (
        '<table class="summary"><thead><tr><th>attempt</th><th>kind</th><th>outcome</th>'
        "<th>started (UTC)</th>"
        "<th>duration</th><th>participants</th><th>calls</th><th>failures</th><th>slowest server</th>"
        f"<th>recovered by</th></tr></thead><tbody>{rows}</tbody></table>"
        if views
        else '<p class="empty">no attempts in this ledger</p>'
    )
    saves = lineage.saves if lineage is not None else {}
    sections = "".join(_attempt_section(i, v, saves.get(v.checkpoint_id)) for i, v in ordered)
    rollouts = _rollouts_section(lineage, ordered) if lineage is not None else ""
    return (
        f"{head}<body><h1>quiesce — checkpoint attempts</h1>"
        f'<p class="meta">ledger {_e(source)} · {len(views)} attempts · generated {_e(when)}</p>'
        f"{summary}{sections}{rollouts}</body></html>\n"
    )
