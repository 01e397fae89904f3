"""``latest.md``: the results of one bench run as Markdown — summary, per-measure detail, each side's
settings, the commit and the machine."""

from __future__ import annotations

from typing import Any


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def verdict(measure: dict[str, Any]) -> str:
    """``met``, ``**missed**``, ``not judged`` (``**not judged: loaded**`` when the machine was
    loaded during it), or the status of a measure that did not run (``unavailable``, ``error``)."""
    if measure["status"] != "ok":
        return str(measure["status"])
    if measure["met"] is None:
        return "**not judged: loaded**" if (measure.get("load") or {}).get("loaded") else "not judged"
    return "met" if measure["met"] else "**missed**"


def rss_cell(measure: dict[str, Any]) -> str:
    rss = measure["metrics"].get("peak_rss_mb")
    return f"{rss['median']:.0f} [{rss['min']:.0f}–{rss['max']:.0f}] MB" if rss else "—"


def summary_table(document: dict[str, Any]) -> list[str]:
    """The one-row-per-measure table (also README's, see ``quiesce.tools.bench.readme``)."""
    lines = [
        "| # | measure | result | baseline (same run) | goal | met | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in document["measures"]:
        value = r["value"] if r["status"] == "ok" else (r["reason"] or "")
        lines.append(
            f"| {r['id']} | {_cell(r['title'])} | {_cell(value)} | {_cell(r['baseline'] or '—')}"
            f" | {_cell(r['goal'])} | {verdict(r)} | {rss_cell(r)} |"
        )
    return lines


def source_line(measure: dict[str, Any]) -> str | None:
    """Where a measure spliced in from another run came from (None: from this document's run)."""
    source = measure.get("source")
    if not source:
        return None
    load = source.get("load_avg_at_start")
    return (
        f"#{measure['id']} comes from `{source['command']}` ({source['started']}, commit"
        f" `{source['commit']}`, {source['runs']} fresh process(es) per figure"
        + (f", CPU: {source['cpu']}" if source.get("cpu") else "")
        + (f", load average at start {', '.join(f'{x:.2f}' for x in load)}" if load else "")
        + ")"
    )


def load_text(load: dict[str, Any]) -> str:
    """``load.merged`` JSON in words: the worst of each figure over the measure's runs."""
    parts = []
    if load.get("foreign_cores") is not None:
        parts.append(f"other processes took up to {load['foreign_cores']:.2f} of {load['cores']} cores")
    if load.get("own_cores") is not None:
        parts.append(f"the bench's own processes up to {load['own_cores']:.2f} cores")
    if load.get("load1_max") is not None:
        parts.append(f"load average up to {load['load1_max']:.2f} (the bench's own processes count in it)")
    if load.get("cpu_pressure") is not None:
        parts.append(f"some task waited for a CPU up to {load['cpu_pressure'] * 100:.0f}% of a run")
    return (", ".join(parts) or "not recorded on this platform") + (
        " — LOADED: not judged" if load.get("loaded") else ""
    )


def machine_line(document: dict[str, Any]) -> str:
    m = document["machine"]
    load = m.get("load_avg_at_start")
    text = (
        f"CPU: {m['cpu']}, {m['cores']} cores; RAM: {m['ram_gb']} GB; disk: {m['disk']};"
        f" {m['os']}, Python {m['python']}, SQLite {m['sqlite']}"
    )
    if load:
        text += f"; load average at start: {', '.join(f'{x:.2f}' for x in load)}"
    return text


def render_markdown(document: dict[str, Any]) -> str:
    """The summary table (one row per measure), detail tables, settings, notes, and the machine."""
    m = document["machine"]
    lines = [
        "# quiesce benchmarks",
        "",
        f"`{document['command']}` — {document['started']}, {document['seconds']:.0f} s,"
        f" {document['runs']} run(s) per measure, commit `{document.get('commit', 'unknown')}`"
        + (" (**--quick: a smoke check, not a measurement**)" if document["quick"] else "")
        + ". Figures are median [min–max] over the runs; each run is a fresh process; the two sides"
        " of every ratio ran interleaved in the same run.",
        "",
        *summary_table(document),
    ]
    spliced = [line for r in document["measures"] if (line := source_line(r)) is not None]
    if spliced:
        lines += [
            "",
            "Measures spliced in from later runs (`--only ... --splice`): " + "; ".join(spliced) + ".",
        ]
    for r in document["measures"]:
        settings = r.get("settings") or []
        if not r["rows"] and not r["notes"] and not settings:
            continue
        lines += ["", f"### {r['id']}. {r['title']}", ""]
        if (source := source_line(r)) is not None:
            lines += [source + ".", ""]
        if settings:
            columns: list[str] = []
            for side in settings:
                columns += [c for c in side if c not in columns]
            lines.append("Settings of each side:")
            lines.append("")
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for side in settings:
                lines.append("| " + " | ".join(_cell(side.get(c, "")) for c in columns) + " |")
            lines.append("")
        if r["rows"]:
            columns = list(r["rows"][0])
            for row in r["rows"]:
                columns += [c for c in row if c not in columns]
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for row in r["rows"]:
                lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
            lines.append("")
        lines += [f"- {_cell(note)}" for note in r["notes"]]
        if (load := r.get("load")) is not None:
            lines.append(f"- the machine during this measure: {_cell(load_text(load))}")
    load = m.get("load_avg_at_start")
    lines += [
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores",
        f"- RAM: {m['ram_gb']} GB",
        f"- disk: {m['disk']}",
        f"- {m['os']}, Python {m['python']}, SQLite {m['sqlite']}",
    ]
    if load:
        lines.append(f"- load average at start: {', '.join(f'{x:.2f}' for x in load)} (a shared machine)")
    if m.get("bytecode"):
        lines.append(f"- quiesce's bytecode for the child processes: {m['bytecode']}")
    return "\n".join(lines) + "\n"
