"""``latest.md``: the results of one bench run as a Markdown table, with the machine it ran on."""

from __future__ import annotations

from typing import Any


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(document: dict[str, Any]) -> str:
    """The summary table (one row per measure), detail tables, notes, and the machine."""
    m = document["machine"]
    lines = [
        "# quiesce benchmarks",
        "",
        f"`{document['command']}` — {document['started']}, {document['seconds']:.0f} s,"
        f" {document['runs']} run(s) per measure"
        + (" (**--quick: a smoke check, not a measurement**)" if document["quick"] else "")
        + ". Figures are median [min–max] over the runs; each run is a fresh process.",
        "",
        "| # | measure | result | baseline (same run) | goal | met | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in document["measures"]:
        met = ("met" if r["met"] else "**missed**") if r["status"] == "ok" else r["status"]
        rss = r["metrics"].get("peak_rss_mb")
        rss_text = f"{rss['median']:.0f} [{rss['min']:.0f}–{rss['max']:.0f}] MB" if rss else "—"
        value = r["value"] if r["status"] == "ok" else (r["reason"] or "")
        lines.append(
            f"| {r['id']} | {_cell(r['title'])} | {_cell(value)} | {_cell(r['baseline'] or '—')}"
            f" | {_cell(r['goal'])} | {met} | {rss_text} |"
        )
    for r in document["measures"]:
        if not r["rows"] and not r["notes"]:
            continue
        lines += ["", f"### {r['id']}. {r['title']}", ""]
        if r["rows"]:
            columns = list(r["rows"][0])
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for row in r["rows"]:
                lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
            lines.append("")
        lines += [f"- {_cell(note)}" for note in r["notes"]]
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
    return "\n".join(lines) + "\n"
