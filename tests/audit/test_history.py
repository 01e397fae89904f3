"""`quiesce history`: one row per attempt from the projection, with --since, --outcome, --limit, --json."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import pytest

from quiesce.ledger import Ledger
from quiesce.tools.cli.commands import history
from quiesce.tools.cli.commands.history import parse_since
from quiesce.tools.cli.main import main
from tests.audit.handmade import AGENT_1, POLICY, Script


async def _write(url: str) -> None:
    """`ck-ok` published; `ck-bad` aborted (one failure); `ck-open` left open, then recovered."""
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.good_save("ck-ok")
        await s.attempt("ck-bad", participants=(POLICY, AGENT_1))
        await s.phase("ck-bad", "prepare")
        await s.call("ck-bad", POLICY, "prepare", "pause")
        await s.call("ck-bad", AGENT_1, "prepare", "prepare", status=409)
        await s.phase("ck-bad", "rollback")
        await s.call("ck-bad", POLICY, "rollback", "resume")
        await s.call("ck-bad", AGENT_1, "rollback", "resume")
        await s.aborted("ck-bad", "prepare failed", resumed=[POLICY, AGENT_1])
        await s.attempt("ck-open", participants=(POLICY,))
        await s.phase("ck-open", "prepare")
        await s.call("ck-open", POLICY, "prepare", "pause")
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await ledger.append(
            "recovery.settled",
            checkpoint_id="ck-open",
            server=POLICY,
            data={
                "reported_phase": "prepared",
                "active_checkpoint_id": "ck-open",
                "action": "resume",
                "result": "ok",
            },
        )


def _rows(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["history", *argv, "--json"]) == 0
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def test_history_rows_and_filters(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_write, ledger_url)
    rows = _rows(capsys, "--ledger", ledger_url)
    assert [r["checkpoint_id"] for r in rows] == ["ck-ok", "ck-bad", "ck-open"]
    ok, bad, open_ = rows
    assert (ok["kind"], ok["outcome"], ok["calls"], ok["failures"]) == ("save", "published", 13, 0)
    assert isinstance(ok["duration_s"], float)
    assert (bad["outcome"], bad["calls"], bad["failures"], bad["participants"]) == (
        "aborted",
        4,
        1,
        [POLICY, AGENT_1],
    )
    assert (open_["outcome"], open_["duration_s"], open_["recovered_by"]) == (None, None, 2)

    assert [r["checkpoint_id"] for r in _rows(capsys, "--ledger", ledger_url, "--outcome", "aborted")] == [
        "ck-bad"
    ]
    assert [r["checkpoint_id"] for r in _rows(capsys, "--ledger", ledger_url, "--outcome", "open")] == [
        "ck-open"
    ]
    assert [r["checkpoint_id"] for r in _rows(capsys, "--ledger", ledger_url, "--limit", "1")] == ["ck-open"]
    assert len(_rows(capsys, "--ledger", ledger_url, "--since", "1h")) == 3
    assert _rows(capsys, "--ledger", ledger_url, "--since", "2999-01-01") == []
    started = str(bad["started_at"])
    since = [r["checkpoint_id"] for r in _rows(capsys, "--ledger", ledger_url, "--since", started)]
    assert since == ["ck-bad", "ck-open"]

    capsys.readouterr()
    assert main(["history", "--ledger", ledger_url]) == 0
    out = capsys.readouterr().out
    for heading in ("checkpoint", "outcome", "duration", "participants", "calls", "failures", "recovered by"):
        assert heading in out
    assert "epoch 2" in out
    assert "open (prepare)" in out


def test_history_usage_errors(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["history", "--ledger", ledger_url, "--since", "yesterday-ish"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        main(["history", "--ledger", ledger_url, "--outcome", "exploded"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        main(["history", "--ledger", ledger_url, "--limit", "-1"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        main(["report", "--ledger", ledger_url, "--out", "x.html", "--limit", "0"])
    assert caught.value.code == 2


def test_history_pages_back_with_before(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--limit N --before <oldest id shown>` is the page before; a full table page says how to get it."""
    anyio.run(_write, ledger_url)

    def ids(*argv: str) -> list[object]:
        return [r["checkpoint_id"] for r in _rows(capsys, "--ledger", ledger_url, *argv)]

    assert ids("--limit", "2") == ["ck-bad", "ck-open"]
    assert ids("--limit", "2", "--before", "ck-bad") == ["ck-ok"]
    assert ids("--before", "ck-open") == ["ck-ok", "ck-bad"]
    assert ids("--before", "ck-ok") == []
    assert ids("--before", "ck-open", "--outcome", "aborted") == ["ck-bad"]

    capsys.readouterr()
    assert main(["history", "--ledger", ledger_url, "--limit", "2"]) == 0
    assert "add --before ck-bad for the page before these" in capsys.readouterr().out
    assert main(["history", "--ledger", ledger_url, "--limit", "5"]) == 0
    assert "--before" not in capsys.readouterr().out  # not a full page: nothing older

    assert main(["history", "--ledger", ledger_url, "--before", "ck-nope", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "usage"
    assert "--before ck-nope: no attempt with that id" in error["message"]


def test_parse_since() -> None:
    now = datetime(2025, 1, 2, 12, 0, tzinfo=UTC)
    assert parse_since("2h", now) == now - timedelta(hours=2)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("2025-01-01", now) == datetime(2025, 1, 1, tzinfo=UTC)
    assert parse_since("2025-01-01T03:04:05Z", now) == datetime(2025, 1, 1, 3, 4, 5, tzinfo=UTC)
    assert parse_since("2025-01-01T05:04:05+02:00", now) == datetime(2025, 1, 1, 3, 4, 5, tzinfo=UTC)


def test_long_history_is_plain_text(
    ledger_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    anyio.run(_write, ledger_url)
    monkeypatch.setattr(history, "RICH_MAX_ROWS", 1)
    capsys.readouterr()
    assert main(["history", "--ledger", ledger_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["checkpoint", "kind", "outcome"]
    assert [line.split()[0] for line in lines[1:]] == ["ck-ok", "ck-bad", "ck-open"]
    assert lines[3].rstrip().endswith("epoch 2")


_HISTORY = """
import sys
from quiesce.tools.cli.main import main

code = main(["history", "--ledger", sys.argv[1], "--json"])
print("MODULES", *sorted(sys.modules))
raise SystemExit(code)
"""


def test_history_json_imports_only_what_it_needs(tmp_path: Path) -> None:
    """`quiesce history --json` on SQLite imports no SQLAlchemy, pydantic, wire models or rich:
    it must start in well under a second (a fresh process on a 1,000,000-event ledger)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    anyio.run(_write, url)
    result = subprocess.run(
        [sys.executable, "-c", _HISTORY, url],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    document, _, modules = result.stdout.partition("MODULES ")
    assert [row["checkpoint_id"] for row in json.loads(document)] == ["ck-ok", "ck-bad", "ck-open"]
    heavy = (
        "sqlalchemy",
        "alembic",
        "pydantic",
        "quiesce.ledger.payloads",
        "quiesce.coordinator.protocol",
        "httpx",
        "fastapi",
    )
    assert [m for m in modules.split() if m.split(".")[0] in heavy or m in heavy] == []
