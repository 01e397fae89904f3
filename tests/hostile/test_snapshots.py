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

from quiesce.coordinator import (
    Coordinator,
    PhaseError,
    SnapshotError,
    parse_config,
    read_latest,
    verify_snapshot,
)
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


# -- a poisoned LATEST -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("poison", "says"),
    [
        (b"../../etc\n", "which is not a snapshot folder name"),
        (b".staging\n", "which is not a snapshot folder name"),
        (b"\xff\xfe\x00garbage", "not UTF-8 text"),
        (b"\n", "is empty"),
        (b"q0123456789-0000000099-e9-wabcdef\n", "which does not exist"),
        (b"x" * 5000, "over 4096 bytes"),
        (b"outside\n", "a symlink, not a snapshot folder"),
    ],
)
async def test_a_poisoned_latest_is_reported_as_such_and_nothing_is_contacted(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path, token: str, poison: bytes, says: str
) -> None:
    snapshots = tmp_path / "snapshots"
    config = _config(cluster, sqlite_url, snapshots, tmp_path)
    async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(config) as coord:
        await _published(coord)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (snapshots / "outside").symlink_to(elsewhere, target_is_directory=True)
        (snapshots / "LATEST").write_bytes(poison)
        assert read_latest(snapshots) is None
        before = await _requests(http, cluster)
        with pytest.raises(SnapshotError, match=says) as caught:
            await coord.restore("latest")
        assert "no LATEST file" not in str(caught.value)
        assert await _requests(http, cluster) == before
    written = tmp_path / "cluster.yaml"
    cluster.write_config(written, sqlite_url, snapshots)
    done = run_cli("restore", "--config", str(written), "--snapshot", "latest", token=token)
    assert done.returncode == 1, done.stderr
    assert says in done.stderr
    assert "no LATEST file" not in done.stderr
    no_traceback(done)
    listed = run_cli("snapshots", "--config", str(written), token=token)
    assert listed.returncode == 0, listed.stderr
    assert f"warning: {snapshots / 'LATEST'}" in listed.stderr
    assert says in listed.stderr


# -- a staging folder swapped while the caller writes its half ----------------------------------------


def _swap_for_symlink(staging: Path, outside: Path) -> None:
    """Move the real staging folder out of the snapshots folder and leave a symlink to it."""
    shutil.move(str(staging), str(outside))
    staging.symlink_to(outside, target_is_directory=True)


async def _save_swapping(coord: Coordinator, inside: Any, seen: list[Any]) -> None:
    """A save whose caller block runs `inside(staging folder)`; the attempt is kept in `seen`."""
    async with coord.save(deadline_s=20) as attempt:
        seen.append(attempt)
        assert attempt.staging_dir is not None
        inside(attempt.staging_dir)


def _write_half(staging: Path, swap: Any, outside: Path) -> None:
    """The caller's half, then the swap."""
    (staging / "trainer").mkdir()
    (staging / "trainer" / "step.txt").write_text("2400\n")
    swap(staging, outside)


def _swap_for_copy(staging: Path, outside: Path) -> None:
    """Put another real folder (a copy of the servers' files) where the staging folder was."""
    shutil.copytree(staging, outside)
    shutil.rmtree(staging)
    outside.rename(staging)


@pytest.mark.parametrize(
    ("swap", "says"), [(_swap_for_symlink, "a symlink"), (_swap_for_copy, "another folder")]
)
async def test_a_staging_folder_swapped_before_publication_is_never_published(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path, swap: Any, says: str
) -> None:
    snapshots = tmp_path / "snapshots"
    config = _config(cluster, sqlite_url, snapshots, tmp_path)
    outside = tmp_path / "outside"
    seen: list[Any] = []
    async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(config) as coord:
        before = await _published(coord)
        with pytest.raises(PhaseError) as caught:
            await _save_swapping(coord, lambda staging: _write_half(staging, swap, outside), seen)
        attempt = seen[0]
        assert caught.value.phase == "publish"
        assert says in str(caught.value)
        assert "only the folder quiesce made is published" in str(caught.value)
        await assert_all_accepting(http, cluster)
        assert read_latest(snapshots) == before  # the earlier snapshot is still the latest
        assert not (snapshots / attempt.checkpoint_id).exists()
        assert not (snapshots / attempt.checkpoint_id).is_symlink()
        assert not attempt.staging_dir.exists()
        assert not attempt.staging_dir.is_symlink()
    kinds = [e.kind for e in await read_events(config.ledger, attempt.checkpoint_id)]
    assert "attempt.aborted" in kinds, kinds
    assert "attempt.published" not in kinds, kinds
    if swap is _swap_for_symlink:  # the link's target is not ours: the rollback removed only the link
        assert (outside / "trainer" / "step.txt").read_text() == "2400\n"


async def test_a_staging_folder_planted_as_a_symlink_before_the_commit_fails_it(
    cluster: RunningCluster, sqlite_url: str, tmp_path: Path
) -> None:
    """A symlink already at the staging path (the id is predictable) is never written through."""
    snapshots = tmp_path / "snapshots"
    config = _config(cluster, sqlite_url, snapshots, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not quiesce's\n")
    async with httpx.AsyncClient(timeout=30) as http, Coordinator.open(config) as coord:
        await coord.discover()
        from quiesce.coordinator.attempt import next_checkpoint_id  # the id the next save gets

        upcoming = await next_checkpoint_id(coord._ctx.ledger)
        (snapshots / ".staging").mkdir(parents=True)
        (snapshots / ".staging" / upcoming).symlink_to(outside, target_is_directory=True)
        with pytest.raises(PhaseError, match="a symlink, not a folder quiesce made") as caught:
            await coord.checkpoint(deadline_s=20)
        assert caught.value.phase == "commit"
        await assert_all_accepting(http, cluster)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


async def test_a_v2_staging_folder_swapped_for_a_symlink_is_never_published(
    sqlite_url: str, tmp_path: Path, token: str
) -> None:
    from quiesce.tools.gymsim.cluster import start_cluster
    from quiesce.tools.gymsim.spec import default_v2_spec
    from tests.coordinator_v2.helpers import phases

    outside = tmp_path / "outside"
    with start_cluster(default_v2_spec().model_dump(mode="json"), token=token) as running:
        config = _config(running, sqlite_url, tmp_path / "snapshots", tmp_path)
        seen: list[Any] = []
        async with Coordinator.open(config) as coord:
            with pytest.raises(PhaseError) as caught:
                await _save_swapping(coord, lambda staging: _swap_for_symlink(staging, outside), seen)
            attempt = seen[0]
            assert caught.value.phase == "publish"
            assert "a symlink" in str(caught.value)
            assert read_latest(tmp_path / "snapshots") is None
            assert not (tmp_path / "snapshots" / attempt.checkpoint_id).is_symlink()
            assert outside.is_dir()
        async with httpx.AsyncClient(timeout=30) as http:
            assert set((await phases(http, running.urls, token)).values()) == {"idle"}
