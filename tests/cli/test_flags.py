"""One flag set on every command, through the real CLI: `--json` and `--debug` anywhere,
`--version`, `--ledger FILE|URL` or `--config C` (default `$QUIESCE_CONFIG`) on every ledger
reader, `latest`, bad usage exiting 2 with the value as typed, and history and the report in
the same order."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from quiesce.coordinator.version import VERSION
from quiesce.ledger import Ledger
from quiesce.tools.cli import commands
from quiesce.tools.cli.main import main
from tests.audit.handmade import POLICY, Script
from tests.cli.helpers import child_env, json_of, quiesce


async def _write(url: str) -> None:
    """`ck-b` published, then `ck-a` (a restore of it, resumed), then `ck-c` aborted — started in
    that order, which is not the order of their names."""
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.good_save("ck-b")
        await ledger.append(
            "attempt.started",
            checkpoint_id="ck-a",
            data={
                "kind": "restore",
                "deadline_ts": 4102444800.0,
                "participants": [POLICY],
                "snapshot_dir": "/snap/ck-b",
                "source_checkpoint_id": "ck-b",
            },
        )
        await s.phase("ck-a", "restore")
        await s.call("ck-a", POLICY, "restore", "restore")
        await s.phase_done("ck-a", "restore")
        await s.completed("ck-a", "restored")
        await s.attempt("ck-c", participants=(POLICY,))
        await s.phase("ck-c", "prepare")
        await s.call("ck-c", POLICY, "prepare", "pause")
        await s.aborted("ck-c", "operator abort", resumed=[POLICY])
        await s.resume("ck-a", servers=(POLICY,))
        await s.completed("ck-a", "resumed")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder holding ledger `q.db` (see `_write`) and `cluster.yaml` naming it."""
    anyio.run(_write, f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")
    (tmp_path / "cluster.yaml").write_text(
        "ledger: sqlite+aiosqlite:///q.db\nservers:\n  - {name: policy_model, url: 'http://127.0.0.1:9'}\n"
    )
    return tmp_path


def _command_names() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(commands.__path__))


def test_version(tmp_path: Path) -> None:
    done = quiesce("--version", cwd=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, f"quiesce {VERSION}")


def test_every_command_takes_json_and_debug(capsys: pytest.CaptureFixture[str]) -> None:
    """Every command's parser (as `quiesce` builds it) offers both; `demo` and `sim` are also run
    for real below and in their own tests."""
    for name in [*_command_names(), "db upgrade"]:
        with pytest.raises(SystemExit) as done:
            main([*name.split(), "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "--json" in text, name
        assert "--debug" in text, name


@pytest.mark.parametrize("name", ["demo", "sim", "snapshots", "db upgrade"])
def test_json_and_debug_in_the_real_help(name: str, tmp_path: Path) -> None:
    done = quiesce(*name.split(), "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout
    assert "--debug" in done.stdout


def test_debug_before_or_after_the_command(folder: Path) -> None:
    for argv in (
        ["--debug", "show", "nope", "--ledger", "q.db"],
        ["show", "nope", "--ledger", "q.db", "--debug"],
    ):
        done = quiesce(*argv, cwd=folder)
        assert done.returncode == 1
        assert "Traceback" in done.stderr
        assert "no attempt 'nope'" in done.stderr
    plain = quiesce("show", "nope", "--ledger", "q.db", cwd=folder)
    assert plain.returncode == 1
    assert "Traceback" not in plain.stderr
    assert "no attempt 'nope'" in plain.stderr
    # --json before the command name counts as well
    assert json_of(quiesce("--json", "history", "--ledger", "q.db", cwd=folder))[0]["checkpoint_id"] == "ck-b"


@pytest.mark.parametrize("source", ["file", "config", "env"])
def test_every_ledger_reader_takes_a_file_a_url_or_a_config(source: str, folder: Path) -> None:
    where = {
        "file": ["--ledger", "q.db"],  # (a URL: what every other test passes)
        "config": ["--config", "cluster.yaml"],
        "env": [],
    }[source]
    env = {"QUIESCE_CONFIG": str(folder / "cluster.yaml")} if source == "env" else None
    rows = json_of(quiesce("history", *where, "--json", cwd=folder, env=env))
    assert [r["checkpoint_id"] for r in rows] == ["ck-b", "ck-a", "ck-c"]
    shown = json_of(quiesce("show", "latest", *where, "--json", cwd=folder, env=env))
    assert shown["checkpoint_id"] == "ck-c"  # the last attempt started
    checked = quiesce("check", "ck-b", *where, "--json", cwd=folder, env=env)
    assert checked.returncode == 0, checked.stderr
    replayed = json_of(quiesce("replay", *where, "--json", cwd=folder, env=env))
    assert replayed["chain"]["ok"] is True
    exported = json_of(
        quiesce("export", *where, "--checkpoint", "latest", "--out", "b.jsonl", "--json", cwd=folder, env=env)
    )
    assert exported["checkpoint"] == "ck-c"
    assert quiesce("verify-bundle", "b.jsonl", *where, cwd=folder, env=env).returncode == 0
    report = json_of(quiesce("report", *where, "--out", "r.html", "--json", cwd=folder, env=env))
    assert report["attempts"] == ["ck-b", "ck-a", "ck-c"]


def test_history_and_report_list_attempts_in_the_same_order(folder: Path) -> None:
    rows = json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=folder))
    assert quiesce("report", "--ledger", "q.db", "--out", "r.html", cwd=folder).returncode == 0
    page = (folder / "r.html").read_text(encoding="utf-8")
    sections = re.findall(r'<section class="attempt" id="attempt-\d+" data-checkpoint-id="([^"]+)"', page)
    summary = re.findall(r'<td><a href="#attempt-\d+">([^<]+)</a></td>', page)
    assert [r["checkpoint_id"] for r in rows] == sections == summary == ["ck-b", "ck-a", "ck-c"]


def test_history_outcome_resumed_and_the_snapshot_column(folder: Path) -> None:
    rows = {
        r["checkpoint_id"]: r for r in json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=folder))
    }
    assert (rows["ck-b"]["outcome"], rows["ck-b"]["snapshot"]) == ("published", "ck-b")
    assert (rows["ck-a"]["outcome"], rows["ck-a"]["snapshot"]) == (
        "resumed",
        "ck-b",
    )  # restored ck-b, resumed
    assert (rows["ck-c"]["outcome"], rows["ck-c"]["snapshot"]) == ("aborted", None)
    resumed = json_of(quiesce("history", "--ledger", "q.db", "--outcome", "resumed", "--json", cwd=folder))
    assert [r["checkpoint_id"] for r in resumed] == ["ck-a"]
    assert (
        json_of(quiesce("history", "--ledger", "q.db", "--outcome", "restored", "--json", cwd=folder)) == []
    )
    table = quiesce("history", "--ledger", "q.db", cwd=folder).stdout
    header, *lines = [line for line in table.splitlines() if line.strip()]
    assert header.split()[:4] == ["checkpoint", "kind", "outcome", "snapshot"]
    assert lines[1].split()[:4] == ["ck-a", "restore", "resumed", "ck-b"]
    # the report says the same of the restore
    assert (
        quiesce(
            "report", "--ledger", "q.db", "--checkpoint", "ck-a", "--out", "a.html", cwd=folder
        ).returncode
        == 0
    )
    assert '<td class="outcome-resumed">resumed</td>' in (folder / "a.html").read_text(encoding="utf-8")


def test_bad_usage_exits_2_naming_the_value_as_typed(folder: Path) -> None:
    cases = [
        (["history", "--ledger", "nope.db"], "'nope.db'"),
        (["show", "latest", "--ledger", "mysql://ops:s3cret@db/q"], "mysql://ops:***@db/q"),
        (
            ["replay", "--ledger", "postgresql+asyncpg://ops:s3cret@db:port/q"],
            "postgresql+asyncpg://ops:***@db:port/q",
        ),
        (["check", "--ledger", "."], "'.' is a folder"),
        (["history"], "--ledger URL|FILE, or --config FILE"),
        (["report", "--ledger", "q.db", "--config", "cluster.yaml", "--out", "r.html"], "not allowed with"),
        (["checkpoint"], "--config FILE is required"),
        (["snapshots", "--config", "cluster.yaml", "--prune", "-1"], "'-1'"),
        (["history", "--config", "missing.yaml"], "missing.yaml"),
    ]
    for argv, expected in cases:
        done = quiesce(*argv, cwd=folder)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert expected in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr
        assert "s3cret" not in done.stderr


_HISTORY = """
import sys
from quiesce.tools.cli.main import main

code = main(["history", "--ledger", sys.argv[1], "--json"])
print("MODULES", *sorted(sys.modules))
raise SystemExit(code)
"""


def test_history_json_stays_light_with_restores_and_a_file_path(folder: Path) -> None:
    """A restore's row reads its events, a file path is turned into a URL: still no SQLAlchemy,
    pydantic, wire models or rich (see tests/audit/test_history.py)."""
    done = subprocess.run(
        [sys.executable, "-c", _HISTORY, "q.db"], cwd=folder, env=child_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    document, _, modules = done.stdout.partition("MODULES ")
    assert [r["outcome"] for r in json.loads(document)] == ["published", "resumed", "aborted"]
    heavy = ("sqlalchemy", "alembic", "pydantic", "httpx", "fastapi", "rich")
    loaded = [
        m
        for m in modules.split()
        if m.split(".")[0] in heavy or m in ("quiesce.ledger.payloads", "quiesce.coordinator.protocol")
    ]
    assert loaded == []
