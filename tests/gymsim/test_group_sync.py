"""`GroupSync`: commits waiting at the same time share one syncfs(2), and none returns before a
syncfs that started after its call has completed. The real system call runs in the last test."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from quiesce.coordinator.durable import syncfs_available
from quiesce.coordinator.protocol import sha256_hex
from quiesce.tools.gymsim import common
from quiesce.tools.gymsim.common import ArtifactWriter, GroupSync


def test_a_call_made_during_a_running_sync_waits_for_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = threading.Event()
    release = threading.Event()
    started: list[float] = []

    def slow_syncfs(path: Path) -> None:
        started.append(time.monotonic())
        if len(started) == 1:
            entered.set()
            assert release.wait(5)

    monkeypatch.setattr(common, "syncfs", slow_syncfs)
    group = GroupSync()
    returned: dict[str, float] = {}

    def call(name: str) -> None:
        group.sync(tmp_path)
        returned[name] = time.monotonic()

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert entered.wait(5)
    # these three call while the first syncfs runs: it started before their writes, so it does
    # not cover them; they must share one more
    late = [threading.Thread(target=call, args=(f"late{i}",)) for i in range(3)]
    for thread in late:
        thread.start()
    time.sleep(0.05)
    assert returned == {}
    release.set()
    for thread in [first, *late]:
        thread.join(5)
    assert group.runs == len(started) == 2
    assert all(returned[f"late{i}"] >= started[1] for i in range(3))


def test_many_concurrent_callers_share_few_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def syncfs(path: Path) -> None:
        time.sleep(0.01)

    monkeypatch.setattr(common, "syncfs", syncfs)
    group = GroupSync()
    barrier = threading.Barrier(32)

    def call() -> None:
        barrier.wait()
        group.sync(tmp_path)

    threads = [threading.Thread(target=call) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert 1 <= group.runs <= 4  # 32 callers: the first sync, then at most a few shared ones


def test_a_failed_sync_raises_where_it_ran_and_the_waiters_run_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = threading.Event()
    release = threading.Event()
    calls = {"n": 0}

    def failing_once(path: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            entered.set()
            assert release.wait(5)
            raise OSError(5, "syncfs: Input/output error", str(path))

    monkeypatch.setattr(common, "syncfs", failing_once)
    group = GroupSync()
    errors: list[BaseException] = []
    waiter_done = threading.Event()

    def runner() -> None:
        try:
            group.sync(tmp_path)
        except OSError as error:
            errors.append(error)

    def waiter() -> None:
        group.sync(tmp_path)
        waiter_done.set()

    first = threading.Thread(target=runner)
    first.start()
    assert entered.wait(5)
    second = threading.Thread(target=waiter)
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    assert [str(e) for e in errors] == [f"[Errno 5] syncfs: Input/output error: '{tmp_path}'"]
    assert waiter_done.is_set()
    assert calls["n"] == 2


@pytest.mark.skipif(not syncfs_available(), reason="no syncfs(2) on this system")
def test_the_writer_syncs_once_with_the_real_syscall_and_writes_the_same_files(tmp_path: Path) -> None:
    group = GroupSync.for_path(tmp_path)
    before = group.runs
    writer = ArtifactWriter(str(tmp_path), "agent/x")
    ref = writer.write("rows.jsonl", b'{"a": 1}\n{"a": 2}\n', 2)
    digest = writer.write_manifest({"schema_version": 1})
    assert group.runs - before == 1  # after the manifest: data files and manifest at once
    assert (tmp_path / "agent/x/rows.jsonl").read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert ref.records == 2
    assert ref.bytes == len(b'{"a": 1}\n{"a": 2}\n')
    assert sha256_hex((tmp_path / "agent/x/manifest.json").read_bytes()) == digest
    assert [p.name for p in (tmp_path / "agent/x").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("existing", [False, True])
def test_without_syncfs_every_file_and_the_folder_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    if existing:  # a repeated commit into a folder that is there already
        (tmp_path / "res").mkdir()
        (tmp_path / "res" / "a.json").write_bytes(b"old\n")
    writer = ArtifactWriter(str(tmp_path), "res")
    writer._grouped = False  # a system without syncfs(2)
    monkeypatch.setattr(os, "fsync", spy)
    writer.write("a.json", b"{}\n", 1)
    writer.write("b.json", b"{}\n", 1)
    writer.write_manifest({"schema_version": 1})
    # each file (under its temporary name in a folder that existed), then the folder before
    # and after the manifest
    tmp = f".tmp-{os.getpid()}" if existing else ""
    name = (lambda n: f".{n}{tmp}") if existing else (lambda n: n)
    assert synced == [name("a.json"), name("b.json"), "res", name("manifest.json"), "res"]
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["a.json", "b.json", "manifest.json"]
    assert (tmp_path / "res" / "a.json").read_bytes() == b"{}\n"
