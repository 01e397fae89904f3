"""Manifest-last storage (Gym's `_checkpoint/store.py`): layout, digests, the manifest written once, and
the restore-side checks of manifest and records."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import RECORDS_PATTERN, CommitReply, manifest_bytes
from quiesce.tools.gymsim.v2.store import WriteStop, WriteStopped, write_state
from quiesce.tools.gymsim.v2.trainer import make_tasks
from tests.gymsim_v2.conftest import V2, code, running

pytestmark = pytest.mark.anyio


async def _checkpoint(gym: V2, folder: Path, turns: int = 2) -> dict[str, dict[str, Any]]:
    trainer = gym.trainer()
    await trainer.start(make_tasks(3, turns=4), paced=True)
    await trainer.advance(turns)
    await trainer.wait_parked()
    return await gym.control.checkpoint("c1", str(folder), trainer.in_flight(), stop=True)


async def test_layout_digest_and_manifest_bytes(gym: V2, tmp_path: Path) -> None:
    commits = await _checkpoint(gym, tmp_path)
    for name, kind in (
        ("environment", "environment"),
        ("policy_model", "model"),
        ("agent", "agent"),
        ("resources", "resources"),
    ):
        reply = CommitReply.model_validate(commits[name])
        folder = tmp_path / "gym" / kind / name
        files = sorted(p.name for p in folder.iterdir())
        assert files == sorted(["manifest.json", reply.manifest.records_file]), files  # no temporary left
        assert RECORDS_PATTERN.match(reply.manifest.records_file)
        data = (folder / reply.manifest.records_file).read_bytes()
        assert reply.manifest.records_file == f"records-{hashlib.sha256(data).hexdigest()}.jsonl"
        assert reply.manifest.records_sha256 == hashlib.sha256(data).hexdigest()
        lines = data.decode().splitlines()
        assert len(lines) == reply.manifest.record_count == 3
        for line in lines:
            record = json.loads(line)
            assert line == json.dumps(record)  # json.dumps default form, key order kept
            assert set(record["episode_id"]) == {"rollout_id", "attempt"}
        on_disk = (folder / "manifest.json").read_bytes()
        assert on_disk == manifest_bytes(commits[name]["manifest"])
        assert json.loads(on_disk) == {
            "schema_version": 1,
            "kind": kind,
            "instance": name,
            "checkpoint_id": "c1",
            "records_file": reply.manifest.records_file,
            "records_sha256": reply.manifest.records_sha256,
            "record_count": 3,
        }
    model = commits["policy_model"]
    assert model["staging_keys"] == sorted(
        k for keys in model["staging_keys_by_episode"].values() for k in keys
    )
    assert model["staging_keys_by_episode"]["r0"] == ["r0.call-0", "r0.call-1"]


async def test_an_identical_manifest_is_kept_and_a_different_one_refused(gym: V2, tmp_path: Path) -> None:
    trainer = gym.trainer()
    await trainer.start(make_tasks(1, turns=3), paced=True)
    await trainer.wait_parked()
    first = await gym.control.checkpoint("c1", str(tmp_path), trainer.in_flight())
    manifest = tmp_path / "gym/environment/environment/manifest.json"
    before = manifest.read_bytes()
    # another checkpoint id into the same folder: a different manifest → 422, the first one kept
    await gym.op("environment", "prepare", "c2")
    other = await gym.op("environment", "commit", "c2", checkpoint_dir=str(tmp_path))
    assert (other.status_code, code(other)) == (422, "invalid_checkpoint_state")
    assert "different commit" in other.json()["error"]["detail"]
    assert manifest.read_bytes() == before
    # a retry of c2 into another folder is a conflict (its write is bound to the first folder)
    retry = await gym.op("environment", "commit", "c2", checkpoint_dir=str(tmp_path / "b"))
    assert code(retry) == "checkpoint_conflict"
    await gym.op("environment", "resume", "c2")
    assert first["environment"]["manifest"]["checkpoint_id"] == "c1"


def test_the_writer_keeps_an_identical_manifest_and_a_stopped_write_publishes_nothing(tmp_path: Path) -> None:
    records = [{"episode_id": {"rollout_id": "r0", "attempt": 0}, "session_id": "s", "state": None}]
    args: dict[str, Any] = {
        "kind": "resources",
        "instance": "tools",
        "checkpoint_id": "c1",
        "records": records,
    }
    first = write_state(str(tmp_path), extra={}, stop=WriteStop(), **args)
    manifest = tmp_path / "gym/resources/tools/manifest.json"
    inode = manifest.stat().st_ino
    assert write_state(str(tmp_path), extra={}, stop=WriteStop(), **args) == first
    assert manifest.stat().st_ino == inode  # never replaced
    stopped = WriteStop()
    stopped.stop()
    with pytest.raises(WriteStopped):
        write_state(str(tmp_path / "other"), extra={}, stop=stopped, **args)
    assert not (tmp_path / "other/gym/resources/tools/manifest.json").exists()


async def test_an_unwritable_folder_is_422_and_the_retry_elsewhere_a_conflict(
    gym: V2, tmp_path: Path
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    await gym.op("resources", "prepare", "c1")
    reply = await gym.op("resources", "commit", "c1", checkpoint_dir=str(blocked))
    assert (reply.status_code, code(reply)) == (422, "invalid_checkpoint_state")
    moved = await gym.op("resources", "commit", "c1", checkpoint_dir=str(tmp_path / "ok"))
    assert (moved.status_code, code(moved)) == (409, "checkpoint_conflict")
    blocked.unlink()
    again = await gym.op("resources", "commit", "c1", checkpoint_dir=str(blocked))
    assert again.status_code == 200, again.text


async def _restore(http: httpx.AsyncClient, folder: Path, name: str = "agent") -> httpx.Response:
    with running() as fresh:
        gym = V2(fresh.urls, http)
        return await gym.op(
            name, "restore", "r1", checkpoint_dir=str(folder), episode_ids=[{"rollout_id": "r0"}]
        )


def _manifest(folder: Path) -> tuple[Path, dict[str, Any]]:
    path = folder / "gym/agent/agent/manifest.json"
    return path, json.loads(path.read_bytes())


@pytest.mark.parametrize(
    "damage",
    ["schema", "kind", "instance", "file_name", "digest", "count", "no_manifest", "capture_key_line"],
)
async def test_restore_verifies_the_manifest_and_records(
    http: httpx.AsyncClient, tmp_path: Path, damage: str
) -> None:
    with running() as first:
        await _checkpoint(V2(first.urls, http), tmp_path)
    path, manifest = _manifest(tmp_path)
    records = path.parent / manifest["records_file"]
    if damage == "schema":
        manifest["schema_version"] = 2
    elif damage == "kind":
        manifest["kind"] = "resources"
    elif damage == "instance":
        manifest["instance"] = "other"
    elif damage == "file_name":
        records.rename(path.parent / "records-x.jsonl")
        manifest["records_file"] = "records-x.jsonl"
    elif damage == "digest":
        records.write_bytes(records.read_bytes().replace(b"r0", b"r9", 1))
    elif damage == "count":
        manifest["record_count"] = 4
    elif damage == "capture_key_line":
        lines = [json.loads(line) for line in records.read_bytes().splitlines()]
        for line in lines:
            line["episode_id"] = line["episode_id"]["rollout_id"]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        records.write_bytes(data)
        manifest["records_sha256"] = hashlib.sha256(data).hexdigest()
    if damage == "no_manifest":
        path.unlink()
    else:
        path.write_bytes(manifest_bytes(manifest))
    reply = await _restore(http, tmp_path)
    assert (reply.status_code, code(reply)) == (422, "invalid_checkpoint_state"), reply.text


async def test_restore_keeps_only_the_scope_and_the_legacy_name_reads(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    with running() as first:
        await _checkpoint(V2(first.urls, http), tmp_path)
    path, manifest = _manifest(tmp_path)
    (path.parent / manifest["records_file"]).rename(path.parent / "records.jsonl")
    manifest["records_file"] = "records.jsonl"
    path.write_bytes(manifest_bytes(manifest))
    with running() as fresh:
        gym = V2(fresh.urls, http)
        scope = [{"rollout_id": "r0"}, {"rollout_id": "r2"}, {"rollout_id": "absent"}]
        reply = await gym.op("agent", "restore", "r1", checkpoint_dir=str(tmp_path), episode_ids=scope)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {
            "phase": "restored",
            "source_checkpoint_id": "c1",
            "restored": ["r0-a1", "r2-a1"],
        }
        replay = await gym.op("agent", "restore", "r1", checkpoint_dir="/elsewhere", episode_ids=[])
        assert replay.json() == reply.json()
        other = await gym.op("agent", "restore", "r2", checkpoint_dir=str(tmp_path), episode_ids=scope)
        assert code(other) == "checkpoint_conflict"
