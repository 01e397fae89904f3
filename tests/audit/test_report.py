"""`quiesce report`: a self-contained page, hostile ledger text escaped, rendered by a real browser.

The browser tests run headless Chromium (`/usr/bin/chromium`, Debian package `chromium`) on the
written file, which carries nothing for them (no script, no test attributes): the rendered DOM
(`--dump-dom`) has one lane per server and one bar per call, the browser's console (its log on
stderr, where every CSP violation is reported) stays empty — a tampered style shows that it would
not — and a screenshot is a PNG. Phase labels never overlap: measured by the browser on a copy
of the page given a measuring script. Without Chromium the browser tests skip, unless
`QUIESCE_REQUIRE_CHROMIUM=1`, which makes them fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import anyio
import pytest

from quiesce.ledger import Ledger
from quiesce.ledger import store as ledger_store
from quiesce.tools.cli.main import main
from tests.audit.handmade import AGENT_1, AGENT_2, PARTICIPANTS, POLICY, TOOLS, Script

ROOT = Path(__file__).resolve().parents[2]

HOSTILE = '</title><script>alert("x")</script><img src=x onerror=alert(1)>'
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


async def _write(url: str) -> None:
    """A good save; a failed one whose replies are hostile; one a recovering coordinator settled."""
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.good_save("ck-good")
        await s.attempt("ck-hostile")
        await s.phase("ck-hostile", "prepare")
        await s.call("ck-hostile", POLICY, "prepare", "pause")
        call_id = await s.send("ck-hostile", AGENT_1, "prepare", "prepare")
        await s.fail("ck-hostile", AGENT_1, call_id, code=HOSTILE)
        await s.phase_failed("ck-hostile", "prepare", AGENT_1, HOSTILE)
        await s.phase("ck-hostile", "rollback")
        await s.call("ck-hostile", POLICY, "rollback", "resume")
        await s.call("ck-hostile", AGENT_1, "rollback", "resume")
        await s.phase_done("ck-hostile", "rollback")
        await s.aborted("ck-hostile", HOSTILE, resumed=[POLICY, AGENT_1])
        await s.attempt("ck-dead", participants=(POLICY, TOOLS))
        await s.phase("ck-dead", "prepare")
        await s.call("ck-dead", POLICY, "prepare", "pause")
        await s.send("ck-dead", TOOLS, "prepare", "prepare")  # the coordinator dies here
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        for server in (POLICY, TOOLS):
            await ledger.append(
                "recovery.settled",
                checkpoint_id="ck-dead",
                server=server,
                data={
                    "reported_phase": "prepared",
                    "active_checkpoint_id": "ck-dead",
                    "action": "resume",
                    "result": "ok",
                },
            )
        await s.call("ck-dead", TOOLS, "recovery", "resume")
        await s.call("ck-dead", POLICY, "recovery", "resume")
        await s.aborted("ck-dead", "recovered", resumed=[POLICY, TOOLS])


#: servers per attempt and calls per attempt, as written by `_write`
EXPECTED_LANES = len(PARTICIPANTS) * 2 + 2
EXPECTED_BARS = 13 + 4 + 4


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _classes(attrs: dict[str, str | None]) -> set[str]:
    return set((attrs.get("class") or "").split())


@pytest.fixture
def page(ledger_url: str, tmp_path: Path) -> Path:
    anyio.run(_write, ledger_url)
    out = tmp_path / "report.html"
    assert main(["report", "--ledger", ledger_url, "--out", str(out)]) == 0
    return out


def test_page_is_self_contained_and_escaped(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    assert "<script>alert" not in html
    assert "onerror=alert" not in html.replace("onerror=alert(1)&gt;", "")  # only ever as escaped text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    collector = _Collector()
    collector.feed(html)
    assert [attrs for tag, attrs in collector.tags if tag == "script"] == []  # the page runs nothing
    for test_hook in ("data-errors", "data-lanes", "data-bars", "data-ready"):
        assert test_hook not in html
    for tag, attrs in collector.tags:
        for name in ("src", "href"):
            value = attrs.get(name)
            assert value is None or value.startswith("#"), (tag, name, value)
        assert tag not in ("link", "iframe", "img", "object", "embed")
    assert re.search(r'http-equiv="Content-Security-Policy" content="default-src &#x27;none&#x27;', html)
    assert "script-src" not in html  # default-src 'none' refuses every script
    lanes = [a for t, a in collector.tags if t == "g" and "lane" in _classes(a)]
    bars = [a for t, a in collector.tags if t == "rect" and "bar" in _classes(a)]
    assert len(lanes) == EXPECTED_LANES
    assert len(bars) == EXPECTED_BARS
    assert sum(1 for _, a in collector.tags if "recovery-mark" in _classes(a)) == 2
    assert sum(1 for _, a in collector.tags if "deadline" in _classes(a)) >= 3
    assert {"outcome-failed", "outcome-unknown", "compensating"} <= set().union(*(_classes(b) for b in bars))


def test_single_checkpoint_report(ledger_url: str, tmp_path: Path) -> None:
    anyio.run(_write, ledger_url)
    out = tmp_path / "one.html"
    assert main(["report", "--ledger", ledger_url, "--checkpoint", "ck-dead", "--out", str(out)]) == 0
    collector = _Collector()
    collector.feed(out.read_text(encoding="utf-8"))
    assert [a.get("data-server") for t, a in collector.tags if t == "g" and "lane" in _classes(a)] == [
        POLICY,
        TOOLS,
    ]
    assert main(["report", "--ledger", ledger_url, "--checkpoint", "nope", "--out", str(out)]) == 1


# -- in a real browser ----------------------------------------------------------------------------


def _chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        if os.environ.get("QUIESCE_REQUIRE_CHROMIUM", "") not in ("", "0"):
            pytest.fail("QUIESCE_REQUIRE_CHROMIUM=1 but chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return found


def _run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _console_lines(stderr: str) -> list[str]:
    """The browser console's messages (errors and CSP violations among them) from its log."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_browser_renders_lanes_and_bars_without_errors(page: Path, tmp_path: Path) -> None:
    binary = _chromium()
    result = _run_chromium(
        binary, tmp_path / "profile-dom", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    assert "<body" in dom, dom[:500]
    body = dom.split("<body", 1)[1]
    assert len(re.findall(r'<g class="lane"', body)) == EXPECTED_LANES
    assert len(re.findall(r'<rect class="bar ', body)) == EXPECTED_BARS
    # every console message — an error, a refused style or resource — reaches the log; none here
    assert _console_lines(result.stderr) == []
    # the hostile reply is text in the rendered DOM, not an element
    assert "<img src=" not in body
    sections = re.findall(r'<section class="attempt".*?</section>', dom, flags=re.S)
    assert len(sections) == 3
    lanes_per_section = [len(re.findall(r'<g class="lane"', s)) for s in sections]
    bars_per_section = [len(re.findall(r'<rect class="bar ', s)) for s in sections]
    assert lanes_per_section == [len(PARTICIPANTS), len(PARTICIPANTS), 2]  # oldest first, as history
    assert bars_per_section == [13, 4, 4]
    assert AGENT_2 in sections[0]


def test_browser_console_reports_a_refused_style(page: Path, tmp_path: Path) -> None:
    """The console check above can fail: a style whose hash the page's CSP does not allow is
    refused, and the refusal is on the console."""
    binary = _chromium()
    tampered = tmp_path / "tampered.html"
    tampered.write_text(
        page.read_text(encoding="utf-8").replace("<style>", "<style>p{}", 1), encoding="utf-8"
    )
    result = _run_chromium(
        binary, tmp_path / "profile-bad", "--enable-logging=stderr", "--v=0", "--dump-dom", tampered.as_uri()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert any("Content Security Policy" in line for line in _console_lines(result.stderr))


class _Clock:
    """A stand-in for the ledger's clock (`quiesce.ledger.store.utc_now`): time moves only when told."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    def __call__(self) -> str:
        return self.now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


async def _write_short_prepare(url: str, clock: _Clock) -> None:
    """A save whose prepare takes 1 ms of ledger time while commit and resume take seconds."""
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck-short")
        await s.prepare("ck-short")
        clock.advance(0.001)
        await s.phase("ck-short", "commit")
        for server in PARTICIPANTS:
            clock.advance(1.0)
            await s.call("ck-short", server, "commit", "commit")
        await s.phase_done("ck-short", "commit")
        clock.advance(0.5)
        await s.publish("ck-short")
        clock.advance(0.5)
        await s.resume("ck-short")
        clock.advance(1.0)
        await s.completed("ck-short")


#: Measures every phase label in the browser and writes the boxes into the page (a test copy only).
MEASURE = """<script>
document.addEventListener("DOMContentLoaded", function () {
  var boxes = [];
  document.querySelectorAll("text.band-label").forEach(function (t) {
    var b = t.getBBox();
    boxes.push({text: t.textContent, x: b.x, y: b.y, w: b.width, h: b.height});
  });
  var out = document.createElement("pre");
  out.id = "measured";
  out.textContent = JSON.stringify(boxes);
  document.body.appendChild(out);
});
</script>"""


def test_phase_labels_never_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real CLI: a prepare far narrower than its label, and the browser's own
    measures of every label: no two overlap."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    clock = _Clock()
    monkeypatch.setattr(ledger_store, "utc_now", clock)
    anyio.run(_write_short_prepare, url, clock)
    out = tmp_path / "short.html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "quiesce.tools.cli.main",
            "report",
            "--ledger",
            str(tmp_path / "q.db"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    html = out.read_text(encoding="utf-8")
    bands = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'<rect class="band band-(\w+)" x="[\d.]+" y="[\d.]+" width="([\d.]+)"', html)
    }
    assert bands["prepare"] < len("prepare") * 5  # the case: prepare's band is narrower than its label
    binary = _chromium()
    harness = tmp_path / "measure.html"
    unlocked = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", html)
    harness.write_text(unlocked.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    result = _run_chromium(binary, tmp_path / "profile-measure", "--dump-dom", harness.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="measured">(.*?)</pre>', result.stdout, flags=re.S)
    assert found is not None, result.stdout[-1000:]
    boxes = json.loads(found.group(1).replace("&quot;", '"'))
    assert [b["text"] for b in boxes] == ["prepare", "commit", "resume"]
    assert all(b["w"] > 0 for b in boxes)
    overlaps = [
        (a["text"], b["text"])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    ]
    assert overlaps == []


def test_browser_screenshot(page: Path, tmp_path: Path) -> None:
    binary = _chromium()
    shot = tmp_path / "report.png"
    result = _run_chromium(
        binary, tmp_path / "profile-shot", "--window-size=1200,1400", f"--screenshot={shot}", page.as_uri()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 1400)
    assert len(data) > 20_000  # lanes, bars and text, not a blank page
