"""`quiesce demo --dir`: it deletes nothing it did not make. Through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiesce.tools.demo import MARKER
from tests.cli.helpers import json_of, quiesce


def test_a_folder_the_demo_did_not_make_is_refused_untouched(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('mine')\n")
    (work / "snapshots").mkdir()  # even a name the demo uses
    (work / "snapshots" / "step-100").write_text("the trainer's")
    for argv in (
        ["demo", "--dir", "work"],
        ["demo", "--dir", "work", "--json"],
        ["demo", "--dir", "work/train.py"],
    ):
        done = quiesce(*argv, cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        if "--json" in argv:  # the error is the one JSON document on stdout
            error = json_of(done)["error"]
            assert (error["code"], error["exit_code"]) == ("usage", 2)
            assert "name a new or empty folder" in error["message"]
        else:
            assert "name a new or empty folder" in done.stderr
            assert done.stdout == ""
    assert sorted(p.name for p in work.iterdir()) == ["snapshots", "train.py"]
    assert (work / "snapshots" / "step-100").read_text() == "the trainer's"
    # `--dir .` in a folder with files is refused the same way
    assert quiesce("demo", "--dir", ".", cwd=work).returncode == 2
    assert (work / "train.py").is_file()


@pytest.mark.timeout(240)
def test_a_marked_folder_loses_only_what_the_demo_made(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / MARKER).write_text("from an earlier run\n")
    (work / "notes.txt").write_text("mine")
    (work / "snapshots").mkdir()
    (work / "snapshots" / "stale").mkdir()  # what an earlier run left
    done = quiesce("demo", "--dir", "work", "--json", cwd=tmp_path, timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json_of(done)
    assert document["ok"] is True
    assert document["differences"] == []
    assert document["dir"] == str(work)
    assert document["checkpoint_id"]
    assert document["restored_as"]
    # the demo sent /run again for exactly what the restore listed: each saved rollout, attempt 1
    assert document["resubmitted"]
    assert {(r["server"], r["attempt_index"]) for r in document["resubmitted"]} == {("simple_agent", 1)}
    assert "sent /run again for the" in done.stderr
    assert "finished exactly as the uninterrupted run" in done.stderr  # the story, off stdout
    assert (work / "notes.txt").read_text() == "mine"
    assert not (work / "snapshots" / "stale").exists()
    assert (work / "ledger.db").is_file()
    assert not (work / "ledger.db.writer-lock").exists()  # a clean exit leaves no lock file
