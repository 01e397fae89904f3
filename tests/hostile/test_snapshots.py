"""Snapshots on a hostile filesystem: the preflight before any pause, and restore checked against the ledger.

Preflight: a read-only snapshots folder, a staging folder mounted from another filesystem, or a
snapshots folder whose parent is missing fail the save before anything is recorded or any server
is contacted; too little free space for another snapshot of the latest one's size is a warning
(on the attempt and in `attempt.started`), and the save goes on.

Restore: a snapshot whose files and top manifest were re-digested consistently passes its own
manifest check, but not the ledger's record of what was published; a snapshot folder renamed away
from its manifest's id is refused; both before any server is contacted. A snapshot this ledger
never published is restored with a warning that says what was and was not verified.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator, SnapshotError, parse_config, read_latest, verify_snapshot
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.helpers import assert_all_accepting, control_logs, read_events
from tests.hostile.conftest import Mounts, fill
from tests.hostile.helpers import no_traceback, run_cli

pytestmark = pytest.mark.anyio


def _config(cluster: RunningCluster, ledger_url: str, snapshots: Path, base: Path) -> Any:
    return parse_config(cluster.config(ledger_url, snapshots), base_dir=base)


async def _requests(http: httpx.AsyncClient, cluster: RunningCluster) -> int:
    return sum(len(log) for log in (await control_logs(http, cluster)).values())


# -- preflight -------------------------------------------------------------------------------------


async def _refused_before_any_pause(
    http: httpx.AsyncClient, cluster: RunningCluster, config: Any, says: str
) -> None:
    async with Coordinator.open(config) as coord:
        await coord.discover()
        before = await _requests(http, cluster)
        with pytest.raises(SnapshotError, match=says) as caught:
            await coord.checkpoint(deadline_s=20)
        assert "Nothing was paused" in str(caught.value)
        assert await _requests(http, cluster) == before  # not one request, not even a read
    kinds = [e.kind for e in await read_events(config.ledger)]
    assert "attempt.started" not in kinds
    await assert_all_accepting(http, cluster)


async def test_a_read_only_snapshots_folder_fails_before_anyone_is_paused(
    mounts: Mounts, cluster: RunningCluster, sqlite_url: str, tmp_path: Path, token: str
) -> None:
    snapshots = mounts.small_fs(1 << 20, "snapshots")
    mounts.read_only(snapshots)
    config = _config(cluster, sqlite_url, snapshots, tmp_path)
    async with httpx.AsyncClient(timeout=30) as http:
        await _refused_before_any_pause(http, cluster, config, "read-only")
    written = tmp_path / "cluster.yaml"
    cluster.write_config(written, sqlite_url, snapshots)
    done = run_cli("checkpoint", "--config", str(written), token=token)
    assert done.returncode == 1
    assert f"cannot save into {snapshots}" in done.stderr
    assert "read-only" in done.stderr
    no_traceback(done)


async def test_a_staging_folder_on_another_filesystem_fails_before_anyone_is_paused(
    mounts: Mounts, cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    staging = mounts.small_fs(1 << 20, "snapshots/.staging")
    config = _config(cluster, sqlite_url, snapshots, tmp_path)
    assert config.staging_root == staging
    async with httpx.AsyncClient(timeout=30) as http:
        await _refused_before_any_pause(http, cluster, config, "another filesystem")


async def test_a_snapshots_folder_whose_parent_is_missing_fails_and_is_not_created(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    config = _config(cluster, sqlite_url, tmp_path / "mnt" / "nfs" / "snapshots", tmp_path)
    async with httpx.AsyncClient(timeout=30) as http:
        await _refused_before_any_pause(http, cluster, config, "does not exist")
    assert not (tmp_path / "mnt").exists()


async def test_low_free_space_is_a_warning_and_the_save_goes_on(
    mounts: Mounts, cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    snapshots = mounts.small_fs(4 << 20, "snapshots")
    config = _config(cluster, sqlite_url, snapshots, tmp_path)
    async with Coordinator.open(config) as coord:
        async with coord.save(deadline_s=20) as first:  # a large caller's half: 1.5 MB
            assert first.staging_dir is not None
            (first.staging_dir / "trainer.bin").write_bytes(b"\1" * (1536 << 10))
        assert first.warnings == []
        filler = fill(snapshots)
        filler.unlink()
        spare = snapshots / "spare"
        spare.write_bytes(b"\0" * ((4 << 20) - (1536 << 10) - (1200 << 10)))  # leave about 1.2 MB free
        second = await coord.checkpoint(deadline_s=20)
    assert second.snapshot is not None
    assert len(second.warnings) == 1
    assert "MB free" in second.warnings[0]
    assert first.checkpoint_id in second.warnings[0]
    started = next(
        e for e in await read_events(config.ledger, second.checkpoint_id) if e.kind == "attempt.started"
    )
    assert started.data["warnings"] == second.warnings


# -- restore against the ledger --------------------------------------------------------------------


def _redigest(snapshot: Path, rel: str, content: bytes) -> None:
    """Replace one file and rewrite its entry in the top manifest: a consistent forgery."""
    (snapshot / rel).write_bytes(content)
    manifest = json.loads((snapshot / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == rel:
            entry["bytes"], entry["sha256"] = len(content), hashlib.sha256(content).hexdigest()
    (snapshot / "manifest.json").write_text(json.dumps(manifest, indent=2))


async def _published(coord: Coordinator) -> Path:
    async with coord.save(deadline_s=20) as attempt:
        assert attempt.staging_dir is not None
        (attempt.staging_dir / "trainer").mkdir()
        (attempt.staging_dir / "trainer" / "step.txt").write_text("1200\n")
    assert attempt.snapshot is not None
    return attempt.snapshot


async def test_a_consistently_redigested_snapshot_is_refused_before_any_server_is_contacted(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    config = _config(cluster, sqlite_url, tmp_path / "snapshots", tmp_path)
    async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(config) as coord:
        snapshot = await _published(coord)
        _redigest(snapshot, "trainer/step.txt", b"1\n")  # the trainer would resume at step 1
        expected = {m.name: m.component for m in (await coord.discover()).participants}
        verify_snapshot(snapshot, participants=expected)  # its own manifest agrees: a consistent forgery
        before = await _requests(http, cluster)
        with pytest.raises(SnapshotError, match="not the one the ledger recorded") as caught:
            await coord.restore("latest")
        assert await _requests(http, cluster) == before
        await assert_all_accepting(http, cluster)
    published = next(
        e for e in await read_events(config.ledger, snapshot.name) if e.kind == "attempt.published"
    )
    assert f"(seq {published.seq})" in str(caught.value)
    assert published.data["manifest_sha256"] in str(caught.value)


async def test_a_snapshot_renamed_away_from_its_id_is_refused(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    config = _config(cluster, sqlite_url, tmp_path / "snapshots", tmp_path)
    async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(config) as coord:
        snapshot = await _published(coord)
        renamed = snapshot.with_name("e1-999999")
        snapshot.rename(renamed)
        before = await _requests(http, cluster)
        with pytest.raises(
            SnapshotError, match=f"names checkpoint '{snapshot.name}', but the folder is 'e1-999999'"
        ):
            await coord.restore(renamed)
        assert await _requests(http, cluster) == before


async def test_a_snapshot_this_ledger_never_published_is_restored_with_what_was_not_verified(
    cluster: RunningCluster, tmp_path: Path
) -> None:
    first = _config(cluster, f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", tmp_path / "a-snapshots", tmp_path)
    async with Coordinator.open(first) as coord:
        snapshot = await _published(coord)
    other = tmp_path / "b-snapshots"
    other.mkdir()
    shutil.copytree(snapshot, other / snapshot.name)
    second = _config(cluster, f"sqlite+aiosqlite:///{tmp_path / 'b.db'}", other, tmp_path)
    async with Coordinator.open(second):  # epoch 1 of ledger b: its restore gets e2-... , an id the
        pass  # servers never retired (ids unique across ledgers are issue 19's)
    async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(second) as coord:
        restored = await coord.restore(other / snapshot.name)
        await coord.resume(restored)
        await assert_all_accepting(http, cluster)
    assert len(restored.warnings) == 1
    warning = restored.warnings[0]
    assert "was not published by this ledger" in warning
    assert "every file was checked against its manifest" in warning
    assert "could not be checked against a recorded digest" in warning
    started = next(
        e for e in await read_events(second.ledger, restored.checkpoint_id) if e.kind == "attempt.started"
    )
    assert started.data["warnings"] == [warning]
    assert read_latest(other) is None
