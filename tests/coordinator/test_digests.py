"""digests.py on a real filesystem: facts read once, read again when the file changed or was racy."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiesce.coordinator import Coordinator, digests
from quiesce.coordinator.digests import RACY_S, DigestCache, file_digest, read_facts
from quiesce.coordinator.protocol import ArtifactRef
from quiesce.coordinator.publish import tree_digests, verify_artifact


def _aged(path: Path, data: bytes) -> None:
    """Write `data` and wait until the file is no longer racy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    time.sleep(RACY_S * 2)


def _opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths digests.py opens from now on (its `os.open`), in order."""
    opened: list[str] = []
    real_open = os.open

    def spy(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        opened.append(os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", spy)  # the os module digests.py calls
    return opened


@pytest.mark.parametrize(
    "data",
    [b"", b"a\n", b"a", b"\n\n \n\t\n", b"x\n\ny\n  \nz", b"r\n" * 40 + b"tail"],
)
@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_facts_count_the_non_empty_lines_across_chunk_borders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, chunk: int
) -> None:
    monkeypatch.setattr(digests, "_CHUNK", chunk)
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    facts = read_facts(path, records=True)
    assert facts.size == len(data)
    assert facts.sha256 == hashlib.sha256(data).hexdigest()
    assert facts.records == sum(1 for line in data.split(b"\n") if line.strip())
    assert read_facts(path).records is None  # not counted unless asked for
    assert file_digest(path) == (facts.size, facts.sha256)


def test_an_unchanged_file_is_read_once_and_a_changed_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a" / "rows.jsonl"
    _aged(path, b"one\ntwo\n")
    cache = DigestCache()
    opened = _opened(monkeypatch)
    first = read_facts(path, records=True, cache=cache)
    assert (first.records, len(cache)) == (2, 1)
    assert read_facts(path, cache=cache) == first
    assert read_facts(path, records=True, cache=cache) == first
    assert opened == [str(path)]  # the two later calls read nothing
    # same size, new content, in place (same inode): its ctime and mtime moved on
    with path.open("r+b") as handle:
        handle.write(b"ONE")
    again = read_facts(path, records=True, cache=cache)
    assert again.sha256 == hashlib.sha256(b"ONE\ntwo\n").hexdigest() != first.sha256
    assert opened == [str(path), str(path)]
    # replaced by a rename: a new inode
    time.sleep(RACY_S * 2)
    read_facts(path, cache=cache)
    other = tmp_path / "other"
    other.write_bytes(b"ONE\nTWO\n")
    os.replace(other, path)
    assert read_facts(path, cache=cache).sha256 == hashlib.sha256(b"ONE\nTWO\n").hexdigest()


def test_a_racy_file_is_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "fresh.json"
    cache = DigestCache()
    path.write_bytes(b"{}")
    read_facts(path, cache=cache)  # stamped within RACY_S of the read: could change unseen
    assert len(cache) == 0
    time.sleep(RACY_S * 2)
    read_facts(path, cache=cache)
    assert len(cache) == 1


def test_publish_reads_only_what_commit_did_not_and_still_sees_a_tamper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "staging"
    data = b'{"r":1}\n{"r":2}\n'
    _aged(root / "agent" / "a" / "continuations.jsonl", data)
    _aged(root / "agent" / "a" / "manifest.json", b"{}")
    cache = DigestCache()
    ref = ArtifactRef(
        relative_path="agent/a/continuations.jsonl",
        sha256=hashlib.sha256(data).hexdigest(),
        records=2,
        bytes=len(data),
    )
    assert verify_artifact(root, ref, what="a", cache=cache) is None  # the commit-phase check
    (root / "model" / "m").mkdir(parents=True)
    (root / "model" / "m" / "calls.jsonl").write_bytes(b"x\n")  # written after that check
    opened = _opened(monkeypatch)
    sums = tree_digests(root, sync=False, cache=cache)
    unread = ("agent/a/manifest.json", "model/m/calls.jsonl")
    assert sorted(opened) == sorted(str(root / rel) for rel in unread)
    assert sums["agent/a/continuations.jsonl"] == (ref.bytes, ref.sha256)
    opened.clear()
    assert verify_artifact(root, ref, what="a", cache=cache) is None
    assert opened == []
    # a same-size change after the check is still found
    (root / "agent" / "a" / "continuations.jsonl").write_bytes(data.replace(b"2", b"3"))
    problem = verify_artifact(root, ref, what="a", cache=cache)
    assert problem is not None
    assert "differs from the reply's" in problem
    assert tree_digests(root, sync=False, cache=cache)["agent/a/continuations.jsonl"][1] != ref.sha256


def test_a_missing_or_non_regular_artifact_is_reported_missing(tmp_path: Path) -> None:
    ref = ArtifactRef(relative_path="agent/a/rows.jsonl", sha256="0" * 64, records=0, bytes=0)
    assert verify_artifact(tmp_path, ref, what="a", cache=DigestCache()) == "a: agent/a/rows.jsonl is missing"
    (tmp_path / "agent" / "a" / "rows.jsonl").mkdir(parents=True)
    assert verify_artifact(tmp_path, ref, what="a", cache=DigestCache()) == (
        "a: agent/a/rows.jsonl is missing (not a regular file)"
    )
    (tmp_path / "agent" / "a" / "rows.jsonl").rmdir()
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / "agent" / "a" / "rows.jsonl").symlink_to(tmp_path / "elsewhere")  # right digest, but a link
    assert verify_artifact(tmp_path, ref.model_copy(update={"sha256": hashlib.sha256(b"").hexdigest()}),
                           what="a", cache=DigestCache()) == (
        "a: agent/a/rows.jsonl is missing (not a regular file)"
    )  # fmt: skip


def test_an_unreadable_artifact_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agent" / "a" / "rows.jsonl"
    _aged(path, b"x\n")

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")  # as a file mode would, for a non-root user

    monkeypatch.setattr(digests, "read_facts", denied)
    ref = ArtifactRef(relative_path="agent/a/rows.jsonl", sha256="0" * 64, records=1, bytes=2)
    problem = verify_artifact(tmp_path, ref, what="a", cache=DigestCache())
    assert problem == "a: agent/a/rows.jsonl cannot be read: Permission denied"


@pytest.mark.anyio
async def test_a_save_keeps_file_facts_from_commit_to_publish_only(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    config = configure(cluster, sqlite_url)
    async with Coordinator.open(config) as coord:
        attempt = await coord.prepare(deadline_s=20)
        await coord.commit(attempt)
        assert attempt.staging_dir is not None
        await anyio.sleep(RACY_S * 2)
        for path in sorted(p for p in attempt.staging_dir.rglob("*") if p.is_file()):
            read_facts(path, cache=attempt.digests)  # as commit's checks would, for files this old
        assert len(attempt.digests) > 0
        await coord.publish(attempt)
        assert len(attempt.digests) == 0  # dropped once published: only commit and publish read it
        await coord.resume(attempt)
