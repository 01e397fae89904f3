"""`quiesce snapshots`, `restore --snapshot ID`, `show latest` and `history --outcome resumed`,
through the real CLI against a real reference cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.cli.helpers import json_of, on_terminal, quiesce


def _checkpoint(config_file: Path, cwd: Path) -> str:
    document = json_of(quiesce("checkpoint", "--config", str(config_file), "--json", cwd=cwd))
    assert document["outcome"] == "published", document
    checkpoint_id: str = document["checkpoint_id"]
    return checkpoint_id


def _listed(config_file: Path, cwd: Path, *more: str) -> dict[str, Any]:
    document: dict[str, Any] = json_of(
        quiesce("snapshots", "--config", str(config_file), "--json", *more, cwd=cwd)
    )
    return document


def test_snapshots_lists_and_prunes_only_ours(config_file: Path, tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    made = [_checkpoint(config_file, tmp_path) for _ in range(3)]
    listed = _listed(config_file, tmp_path)
    assert listed["folder"] == str(snaps)
    rows = listed["snapshots"]
    assert [r["id"] for r in rows] == made
    assert [r["latest"] for r in rows] == [False, False, True]
    for row in rows:
        manifest = json.loads((snaps / row["id"] / "manifest.json").read_text())
        assert row["files"] == len(manifest["files"]) > 0
        assert row["size"] > sum(f["bytes"] for f in manifest["files"])  # and the manifest itself
        assert row["created"] == manifest["created"]
        assert row["participants"] == [p["name"] for p in manifest["participants"]]
    text = quiesce("snapshots", "--config", str(config_file), cwd=tmp_path).stdout
    assert all(cid in text for cid in made)
    assert "LATEST" in text

    # not ours: a plain folder, a folder whose manifest is someone else's, a symlink to a snapshot
    (snaps / "mine").mkdir()
    (snaps / "mine" / "notes.txt").write_text("keep me")
    (snaps / "other").mkdir()
    (snaps / "other" / "manifest.json").write_text('{"format": "something-else"}')
    (snaps / "alias").symlink_to(snaps / made[0], target_is_directory=True)
    # LATEST names the oldest: pruning to one keeps the newest and LATEST's
    (snaps / "LATEST").write_text(made[0] + "\n")
    pruned = _listed(config_file, tmp_path, "--prune", "1", "--yes")
    assert pruned["removed"] == [made[1]]
    assert [(r["id"], r["latest"]) for r in pruned["snapshots"]] == [(made[0], True), (made[2], False)]
    assert not (snaps / made[1]).exists()
    assert (snaps / "mine" / "notes.txt").read_text() == "keep me"
    assert (snaps / "other" / "manifest.json").is_file()
    assert (snaps / "alias").is_symlink()
    assert (snaps / made[0] / "manifest.json").is_file()

    pruned = _listed(config_file, tmp_path, "--prune", "0", "--yes")
    assert pruned["removed"] == [made[2]]
    assert [r["id"] for r in pruned["snapshots"]] == [made[0]]  # LATEST's, whatever K


def test_restore_an_id_from_the_snapshots_folder_not_the_current_one(
    config_file: Path, tmp_path: Path
) -> None:
    first = _checkpoint(config_file, tmp_path)
    _checkpoint(config_file, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / first).mkdir()  # a folder of the same name where the operator stands
    restored = json_of(
        quiesce(
            "restore", "--config", str(config_file), "--snapshot", first, "--resume", "--json", cwd=elsewhere
        )
    )
    assert restored["outcome"] == "resumed", restored
    shown = json_of(quiesce("show", "latest", "--config", str(config_file), "--json", cwd=elsewhere))
    assert shown["checkpoint_id"] == restored["checkpoint_id"]
    assert shown["kind"] == "restore"
    rows = json_of(
        quiesce("history", "--config", str(config_file), "--outcome", "resumed", "--json", cwd=elsewhere)
    )
    assert [(r["checkpoint_id"], r["snapshot"]) for r in rows] == [(restored["checkpoint_id"], first)]

    missing = quiesce("restore", "--config", str(config_file), "--snapshot", "e9-999999", cwd=elsewhere)
    assert missing.returncode == 2
    assert "no snapshot 'e9-999999' under" in missing.stderr
    assert "Traceback" not in missing.stderr
    gone = quiesce("restore", "--config", str(config_file), "--snapshot", "./nowhere/e1", cwd=elsewhere)
    assert gone.returncode == 2
    assert "--snapshot ./nowhere/e1: no such snapshot folder" in gone.stderr


def test_a_restore_left_paused_is_restored_until_resumed(config_file: Path, tmp_path: Path) -> None:
    _checkpoint(config_file, tmp_path)
    restored = json_of(quiesce("restore", "--config", str(config_file), "--json", cwd=tmp_path))
    assert restored["outcome"] == "restored"

    def ids(outcome: str) -> list[str]:
        rows = json_of(
            quiesce("history", "--config", str(config_file), "--outcome", outcome, "--json", cwd=tmp_path)
        )
        return [r["checkpoint_id"] for r in rows]

    assert (ids("restored"), ids("resumed")) == ([restored["checkpoint_id"]], [])
    assert quiesce("resume", "--config", str(config_file), cwd=tmp_path).returncode == 0
    assert (ids("restored"), ids("resumed")) == ([], [restored["checkpoint_id"]])


def test_prune_asks_first_lists_with_dry_run_and_needs_yes_off_a_terminal(
    config_file: Path, tmp_path: Path
) -> None:
    snaps = tmp_path / "snaps"
    made = [_checkpoint(config_file, tmp_path) for _ in range(3)]
    config = ("--config", str(config_file))

    refused = quiesce("snapshots", *config, "--prune", "1", cwd=tmp_path)  # stdin is no terminal
    assert refused.returncode == 2
    assert "add --yes to remove them, or --dry-run to list what would be removed" in refused.stderr
    as_json = json_of(quiesce("snapshots", *config, "--prune", "1", "--json", cwd=tmp_path))
    assert as_json["error"]["code"] == "usage"
    assert all((snaps / cid).is_dir() for cid in made)

    dry = _listed(config_file, tmp_path, "--prune", "1", "--dry-run")
    assert (dry["would_remove"], dry["removed"]) == (made[:2], [])
    assert [r["id"] for r in dry["snapshots"]] == made  # nothing removed
    text = quiesce("snapshots", *config, "--prune", "1", "--dry-run", cwd=tmp_path).stdout
    assert f"would remove {made[0]}" in text
    assert f"would remove {made[1]}" in text
    assert all((snaps / cid).is_dir() for cid in made)

    # on a terminal it lists what it removes and asks; anything but yes removes nothing
    declined = on_terminal("snapshots", *config, "--prune", "2", cwd=tmp_path, columns=100, typed="n\n")
    assert declined.returncode == 1
    assert "--prune 2 removes 1 snapshot from" in " ".join(declined.stderr.split())
    assert made[0] in declined.stderr
    assert "remove them? [y/N]" in declined.stderr
    assert "nothing removed" in declined.stderr
    assert (snaps / made[0]).is_dir()
    accepted = on_terminal("snapshots", *config, "--prune", "2", cwd=tmp_path, columns=100, typed="y\n")
    assert accepted.returncode == 0, accepted.stderr
    assert f"removed {made[0]}" in accepted.stdout
    assert not (snaps / made[0]).exists()

    # --yes removes exactly what --dry-run listed
    dry = _listed(config_file, tmp_path, "--prune", "1", "--dry-run")
    pruned = _listed(config_file, tmp_path, "--prune", "1", "--yes")
    assert pruned["removed"] == dry["would_remove"] == [made[1]]
    assert [r["id"] for r in pruned["snapshots"]] == [made[2]]
