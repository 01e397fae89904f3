"""`quiesce report` shows the rollout lineage: a hand-made v2 ledger written through the real
`Ledger` API — a save of four rollouts (one with a hostile id), a restore of all four, a retire of
one, then a save that captures one, leaves one out as a restart and drops one.

The page has, per published save, what it captured, restarted and showed lost and what was
retired since the previous save; a "Rollouts" section with each rollout's lineage strip, the lost
one's row marked, its violation listed; the hostile id only ever escaped. With a cap, the first
rollouts by id and every lost one are shown and the page says how many were left out.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import anyio

from quiesce.ledger import Ledger
from quiesce.tools.audit.lineage import ReportLineage, report_lineage
from quiesce.tools.audit.report import render_report
from quiesce.tools.cli.main import main
from tests.audit.handmade_v2 import ENV, V2Script

HOSTILE = '<script>alert("r")</script>'
ESCAPED = "&lt;script&gt;alert(&quot;r&quot;)&lt;/script&gt;"


async def _write(url: str) -> None:
    async with Ledger.open(url) as ledger:
        s = V2Script(ledger)
        await s.start()
        await s.good_save("ck-1", scope=("r0", "r1", "r2", HOSTILE))
        await s.good_restore("ck-2", "ck-1", inventory=("r0", "r1", "r2", HOSTILE))
        await s.retire(None, "op-1", ["r0-a1"])
        # r0 retired, r1 dropped by the trainer, r2 a restart: only the hostile one is captured
        await s.attempt("ck-3")
        await s.prepare("ck-3", restarts={ENV: ["r2-a1"]})
        await s.commit("ck-3", [f"{HOSTILE}-a1"], restarts={ENV: ["r2-a1"]})
        await s.renew("ck-3")
        await s.publish("ck-3")
        await s.resume("ck-3")
        await s.completed("ck-3")


class _Page(HTMLParser):
    """Each element's classes and text, by tag: `rows` (a `<tr>`'s classes, its cells' text),
    `items` (an `<li>`'s classes, its text)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[set[str], list[str]]] = []
        self.items: list[tuple[set[str], str]] = []
        self.sections: list[set[str]] = []
        self.scripts = 0
        self._row = self._item = False  # inside a <tr>, an <li>

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = set((dict(attrs).get("class") or "").split())
        if tag == "tr":
            self.rows.append((classes, []))
            self._row = True
        elif tag == "td" and self._row:
            self.rows[-1][1].append("")
        elif tag == "li":
            self.items.append((classes, ""))
            self._item = True
        elif tag == "section":
            self.sections.append(classes)
        elif tag == "script":
            self.scripts += 1

    def handle_data(self, data: str) -> None:
        if self._row and self.rows[-1][1]:
            self.rows[-1][1][-1] += data
        if self._item:
            classes, text = self.items[-1]
            self.items[-1] = (classes, text + data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = False
        elif tag == "li":
            self._item = False


def _parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    return page


def test_the_report_shows_each_rollouts_lineage(ledger_url: str, tmp_path: Path) -> None:
    anyio.run(_write, ledger_url)
    out = tmp_path / "report.html"
    assert main(["report", "--ledger", ledger_url, "--out", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    page = _parse(html)
    assert {"rollouts"} in page.sections
    assert page.scripts == 0
    assert "<script>alert" not in html
    assert ESCAPED in html

    rollouts = {cells[0]: (classes, cells[1:]) for classes, cells in page.rows if "rollout" in classes}
    assert set(rollouts) == {"r0", "r1", "r2", HOSTILE}
    assert {r: cells[0] for r, (_, cells) in rollouts.items()} == {
        "r0": "retired",
        "r1": "lost",
        "r2": "restarted",
        HOSTILE: "live",
    }
    assert [r for r, (classes, _) in rollouts.items() if "state-lost" in classes] == ["r1"]
    steps = [(classes, text) for classes, text in page.items if "step" in classes]
    assert [c for c, t in steps if t == "lost a1 @ck-3"] == [{"step", "step-lost"}]
    assert [c for c, t in steps if t == "restart a1 @ck-3"] == [{"step", "step-restart"}]
    assert rollouts["r1"][1][2] == "captured a0 @ck-1continued a1 @ck-2lost a1 @ck-3"
    assert rollouts[HOSTILE][1][2] == "captured a0 @ck-1continued a1 @ck-2captured a1 @ck-3"

    violations = [text for classes, text in page.items if "violation" in classes]
    assert len(violations) == 1
    assert violations[0].startswith("seq ")
    assert " · lost · r1: " in violations[0]
    assert "ck-2" in violations[0]

    # per published save: captured, restarted, retired since the previous save, lost
    saves = [cells for classes, cells in page.rows if "save" in classes]
    assert saves == [["ck-1", "4", "0", "0", "0"], ["ck-3", "1", "1", "1", "1"]]
    assert "rollouts: 1 captured, 1 restarted, 1 lost; 1 retired since the previous save" in html
    assert "more rollouts not shown" not in html


def test_a_capped_report_shows_the_first_rollouts_and_every_lost_one(ledger_url: str) -> None:
    anyio.run(_write, ledger_url)

    async def read() -> ReportLineage:
        async with Ledger.open(ledger_url, readonly=True) as ledger:
            return await report_lineage(ledger, cap=1)

    lineage = anyio.run(read)
    # by id the hostile one sorts first ("<" before "r"); r1 is lost: shown past the cap
    assert [r.rollout_id for r in lineage.shown] == [HOSTILE, "r1"]
    assert lineage.left_out == 2
    assert [s.what for s in lineage.report.rollouts["r1"].steps] == ["captured", "continued", "lost"]
    assert lineage.report.rollouts["r0"].steps == []  # not shown: no steps kept
    html = render_report([], source="ledger", generated_at=datetime(2026, 1, 1, tzinfo=UTC), lineage=lineage)
    page = _parse(html)
    shown = [cells[0] for classes, cells in page.rows if "rollout" in classes]
    assert shown == [HOSTILE, "r1"]
    assert re.search(r"2 more rollouts not shown: this page shows the first 1 by id and every lost one", html)
    assert "4 rollouts: 1 live, 1 restarted, 1 retired, 1 lost" in html
