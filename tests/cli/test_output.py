"""`-o table|wide|json|jsonl` on every listing command, ids and paths never cut at 80 or 120
columns on a real terminal, and `quiesce checkpoint`'s one line in a pipe. Through the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiesce.ledger import Ledger
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.audit.handmade import Script
from tests.cli.helpers import json_of, on_terminal, quiesce

#: Ids as quiesce makes them (`q<ledger id>-<seq>-e<epoch>`): 25 characters.
IDS = ("qee4118882e-0000000089-e4", "qee4118882e-0000000120-e4")
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


async def _two_saves(url: str) -> None:
    async with Ledger.open(url) as ledger:
        script = Script(ledger)
        await script.start()
        for checkpoint_id in IDS:
            await script.good_save(checkpoint_id)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A ledger `q.db` holding two published saves with real-length ids."""
    anyio.run(_two_saves, f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")
    return tmp_path


def _lines(text: str) -> list[str]:
    return [_ESCAPES.sub("", line) for line in text.splitlines()]


def _jsonl(done: Any) -> list[dict[str, Any]]:
    assert done.returncode in (0, 1), done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("columns", [80, 120])
def test_history_never_cuts_an_id_on_a_terminal(folder: Path, columns: int) -> None:
    for output in ("table", "wide"):
        done = on_terminal("history", "--ledger", "q.db", "-o", output, cwd=folder, columns=columns)
        assert done.returncode == 0, done.stderr
        lines = _lines(done.stdout)
        for checkpoint_id in IDS:
            # the id (and, in the snapshot column, the same id) whole on one line: never "qee41…"
            assert any(line.count(checkpoint_id) == 2 for line in lines), (output, done.stdout)
        assert "…" not in done.stdout


@pytest.mark.parametrize("columns", [80, 120])
def test_show_and_check_never_cut_a_server_or_route(folder: Path, columns: int) -> None:
    shown = on_terminal("show", IDS[0], "--ledger", "q.db", "-o", "wide", cwd=folder, columns=columns)
    assert shown.returncode == 0, shown.stderr
    text = "\n".join(_lines(shown.stdout))
    assert f"attempt {IDS[0]}" in text
    for whole in ("simple_agent", "/agent-checkpoint/prepare", "POST"):
        assert whole in text, whole
    assert "…" not in shown.stdout


def test_every_format_of_history(folder: Path) -> None:
    document = json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=folder))
    assert json_of(quiesce("history", "--ledger", "q.db", "-o", "json", cwd=folder)) == document
    rows = _jsonl(quiesce("history", "--ledger", "q.db", "-o", "jsonl", cwd=folder))
    assert rows == document
    assert [row["checkpoint_id"] for row in rows] == list(IDS)
    table = quiesce("history", "--ledger", "q.db", cwd=folder).stdout
    wide = quiesce("history", "--ledger", "q.db", "-o", "wide", cwd=folder).stdout
    assert "state" not in table.splitlines()[0]
    assert wide.splitlines()[0].split()[-4:] == ["state", "ended", "(UTC)", "epoch"]
    assert wide.splitlines()[1].split()[-4:-2] == ["completed", rows[0]["ended_at"][:10]]


def test_every_listing_command_prints_one_json_object_per_row(folder: Path) -> None:
    calls = _jsonl(quiesce("show", "latest", "--ledger", "q.db", "-o", "jsonl", cwd=folder))
    shown = json_of(quiesce("show", "latest", "--ledger", "q.db", "--json", cwd=folder))
    assert [c["call_id"] for c in calls] == [c["call_id"] for c in shown["calls"]]
    assert {c["checkpoint_id"] for c in calls} == {IDS[1]}
    checked = quiesce("check", "--ledger", "q.db", "-o", "jsonl", cwd=folder)
    assert checked.returncode == 0
    assert checked.stdout == ""  # no violation, no warning: no row
    replayed = quiesce("replay", "--ledger", "q.db", "-o", "jsonl", cwd=folder)
    assert (replayed.returncode, replayed.stdout) == (0, "")  # no projection difference


def test_cluster_listings_in_every_format(config_file: Path, cluster: RunningCluster, tmp_path: Path) -> None:
    where = ("--config", str(config_file))
    servers = _jsonl(quiesce("discover", *where, "-o", "jsonl", cwd=tmp_path))
    assert [(s["name"], s["status"]) for s in servers] == [
        ("policy_model", "participant"),
        ("simple_agent", "participant"),
        ("tools", "participant"),
        ("judge", "skipped"),
        ("math_agent", "skipped"),
    ]
    assert servers[0]["url"] == cluster.urls["policy_model"]
    wide = quiesce("discover", *where, "-o", "wide", cwd=tmp_path)
    assert cluster.urls["tools"] in wide.stdout
    assert cluster.urls["tools"] not in quiesce("discover", *where, cwd=tmp_path).stdout

    status = _jsonl(quiesce("status", *where, "-o", "jsonl", cwd=tmp_path))
    assert [s["name"] for s in status] == list(cluster.urls)
    assert all(s["reachable"] and not s["held"] for s in status)
    assert cluster.urls["judge"] in quiesce("status", *where, "-o", "wide", cwd=tmp_path).stdout

    published = quiesce("checkpoint", *where, cwd=tmp_path)  # stdout is a pipe here
    assert published.returncode == 0, published.stderr
    line = published.stdout
    match = re.fullmatch(r"published (\S+) -> (\S+)\n", line)
    assert match, line  # exactly one line, whatever its length: never wrapped
    checkpoint_id, path = match.groups()
    assert Path(path) == tmp_path / "snaps" / checkpoint_id
    assert "prepare started" in published.stderr  # progress stays on stderr

    snapshots = _jsonl(quiesce("snapshots", *where, "-o", "jsonl", cwd=tmp_path))
    assert [(s["id"], s["latest"]) for s in snapshots] == [(checkpoint_id, True)]
    assert path in quiesce("snapshots", *where, "-o", "wide", cwd=tmp_path).stdout
    assert path not in quiesce("snapshots", *where, cwd=tmp_path).stdout

    conformance = _jsonl(quiesce("conformance", cluster.urls["tools"], "-o", "jsonl", cwd=tmp_path))
    document = json_of(quiesce("conformance", cluster.urls["tools"], "--json", cwd=tmp_path))
    assert conformance == document["checks"]
    human = quiesce("conformance", cluster.urls["tools"], "-o", "wide", cwd=tmp_path)
    assert human.returncode == 0, human.stderr
    assert "(s)" not in human.stdout  # `3 case(s)` reads `3 cases`
    assert all(c["name"] in human.stdout for c in document["checks"])  # check names whole


def test_checkpoint_on_a_terminal_shows_the_whole_path(
    config_file: Path, cluster: RunningCluster, tmp_path: Path
) -> None:
    done = on_terminal("checkpoint", "--config", str(config_file), cwd=tmp_path, columns=80)
    assert done.returncode == 0, done.stderr
    text = "".join(_lines(done.stdout))  # the terminal wraps the line; nothing is cut from it
    match = re.search(r"published (\S+) -> (\S+)", text)
    assert match, done.stdout
    assert Path(match.group(2)) == tmp_path / "snaps" / match.group(1)
