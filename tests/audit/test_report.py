"""`quiesce report`: a self-contained page, hostile ledger text escaped, rendered by a real browser.

The browser test runs headless Chromium (`/usr/bin/chromium`, Debian package `chromium`) on the
written file: no console errors and no CSP violation (the page's script records them into
`<body data-errors>`), one lane per server and one bar per call in the rendered DOM, and a
screenshot PNG. Without Chromium the browser tests skip, unless `QUIESCE_REQUIRE_CHROMIUM=1`,
which makes them fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import anyio
import pytest

from ledger import Ledger
from tests.audit.handmade import AGENT_1, AGENT_2, PARTICIPANTS, POLICY, TOOLS, Script
from tools.cli.main import main

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
    scripts = [attrs for tag, attrs in collector.tags if tag == "script"]
    assert scripts == [{}]  # one inline script, no src
    for tag, attrs in collector.tags:
        for name in ("src", "href"):
            value = attrs.get(name)
            assert value is None or value.startswith("#"), (tag, name, value)
        assert tag not in ("link", "iframe", "img", "object", "embed")
    assert re.search(r'http-equiv="Content-Security-Policy" content="default-src &#x27;none&#x27;', html)
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


def test_browser_renders_lanes_and_bars_without_errors(page: Path, tmp_path: Path) -> None:
    binary = _chromium()
    result = _run_chromium(
        binary, tmp_path / "profile-dom", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body is not None, dom[:500]
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1)))
    assert attrs.get("data-ready") == "1", attrs  # the page script ran
    assert attrs.get("data-errors") == "[]", attrs  # no error, no CSP violation
    assert attrs.get("data-lanes") == str(EXPECTED_LANES)
    assert attrs.get("data-bars") == str(EXPECTED_BARS)
    # console messages reach the log as "CONSOLE(...)" lines; the page logs nothing
    assert [line for line in result.stderr.splitlines() if ":CONSOLE" in line] == []
    # the hostile reply is text in the rendered DOM, not an element
    assert "<img src=" not in dom.split("<body", 1)[1]
    sections = re.findall(r'<section class="attempt".*?</section>', dom, flags=re.S)
    assert len(sections) == 3
    lanes_per_section = [len(re.findall(r'<g class="lane"', s)) for s in sections]
    bars_per_section = [len(re.findall(r'<rect class="bar ', s)) for s in sections]
    assert lanes_per_section == [2, len(PARTICIPANTS), len(PARTICIPANTS)]  # newest first
    assert bars_per_section == [4, 4, 13]
    assert AGENT_2 in sections[2]


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
