"""publish.py on the filesystem, and calls.py's reply cap and error classes against a raw loopback server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from quiesce.coordinator.calls import MAX_REPLY_BYTES, STAGED_READ_COMMIT_S, Caller, CallResult
from quiesce.coordinator.digests import file_digest
from quiesce.coordinator.errors import SnapshotError
from quiesce.coordinator.protocol import sha256_hex
from quiesce.coordinator.publish import (
    LATEST,
    SYNCFS_MIN_FILES,
    TRASH,
    apply_retention,
    build_manifest,
    empty_trash,
    list_snapshots,
    read_latest,
    readable_json,
    sweep_staging,
    tree_digests,
    verify_snapshot,
    write_json_durably,
    write_latest,
)
from quiesce.ledger import Ledger
from tests.coordinator.helpers import loopback


def _snapshot(root: Path, name: str, epoch: int, seq: int, participants: list[dict[str, str]]) -> Path:
    folder = root / name
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "a.txt").write_text(f"{name}\n")
    manifest = build_manifest(
        folder,
        checkpoint_id=name,
        created="2025-01-01T00:00:00Z",
        epoch=epoch,
        ledger_seq=seq,
        participants=participants,
        skipped=[],
    )
    write_json_durably(folder / "manifest.json", manifest)
    return folder


@pytest.mark.parametrize(
    "document",
    [
        {},
        {"files": []},
        {"epoch": 3, "files": [{"path": "a/b", "bytes": 1}, {"path": "c"}], "name": '\u00e9\n"x'},
        {"participants": [{"reply": {"z": [1, {"y": None}]}, "name": "m"}], "skipped": [], "f": 1.5},
    ],
)
def test_readable_json_has_a_line_per_key_and_per_list_item(document: dict[str, Any]) -> None:
    text = readable_json(document)
    assert json.loads(text) == document
    lines = text.splitlines()
    items = sum(len(v) for v in document.values() if isinstance(v, list))
    empty_or_scalar = sum(1 for v in document.values() if not (isinstance(v, list) and v))
    lists = len(document) - empty_or_scalar  # a line to open each non-empty list and one to close it
    assert len(lines) == (2 + empty_or_scalar + 2 * lists + items if document else 1)


def test_latest_retention_and_sweep(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    made = [_snapshot(tmp_path, f"e{e}-{s:06d}", e, s, []) for e, s in [(9, 5), (10, 2), (10, 7), (11, 1)]]
    write_latest(tmp_path, made[1].name)  # an older one is latest: never removed
    assert (tmp_path / LATEST).read_text() == made[1].name + "\n"
    assert read_latest(tmp_path) == made[1]
    (tmp_path / "not-ours").mkdir()
    removed = apply_retention(tmp_path, 2)
    assert removed == [made[0]]  # (epoch, seq) order, not name order; LATEST's kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [LATEST, "not-ours", made[1].name, made[2].name, made[3].name]
    )
    staging = tmp_path / ".staging"
    for name in ("done", "running"):
        (staging / name).mkdir(parents=True)
    assert sweep_staging(staging, {"done", "elsewhere"}) == [staging / "done"]
    assert [p.name for p in staging.iterdir()] == ["running"]


def test_retention_can_defer_deleting_to_the_trash(tmp_path: Path) -> None:
    made = [_snapshot(tmp_path, f"e1-{s:06d}", 1, s, []) for s in (1, 2, 3)]
    write_latest(tmp_path, made[2].name)
    assert empty_trash(tmp_path) == 0  # no trash yet
    removed = apply_retention(tmp_path, 1, defer_delete=True)
    assert removed == made[:2]
    assert [p.exists() for p in made] == [False, False, True]  # gone from the snapshots at once
    assert [s.path for s in list_snapshots(tmp_path)] == [made[2]]
    trash = sorted(p.name for p in (tmp_path / TRASH).iterdir())
    assert [name.rsplit("-", 1)[0] for name in trash] == [made[0].name, made[1].name]
    assert empty_trash(tmp_path) == 2
    assert list((tmp_path / TRASH).iterdir()) == []


@pytest.mark.parametrize("rm", [None, "/bin/false"])
def test_the_trash_is_emptied_on_threads_without_a_working_rm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rm: str | None
) -> None:
    from quiesce.coordinator import publish

    made = [_snapshot(tmp_path, f"e1-{s:06d}", 1, s, []) for s in (1, 2, 3)]
    write_latest(tmp_path, made[2].name)
    apply_retention(tmp_path, 1, defer_delete=True)
    monkeypatch.setattr(publish, "_rm_binary", lambda: rm)  # no rm on PATH, or one that fails
    assert empty_trash(tmp_path) == 2
    assert list((tmp_path / TRASH).iterdir()) == []
    assert [s.path for s in list_snapshots(tmp_path)] == [made[2]]


def test_tree_digests_hash_and_fsync_every_file_and_folder_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    root = tmp_path / "staging"
    files = [f"s{i}/d/f{j}.jsonl" for i in range(20) for j in range(3)] + ["top.json", "manifest.json"]
    for k, rel in enumerate(files):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(k * 97))
    (root / "link").symlink_to(root / "top.json")
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), root))
        real_fsync(fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", spy)
        digests = tree_digests(root, sync=True, skip=["manifest.json"])
    expected = sorted(rel for rel in files if rel != "manifest.json")
    assert sorted(digests) == expected  # no symlink, nothing skipped
    assert all(digests[rel] == file_digest(root / rel) for rel in expected)
    folders = {".", *(f"s{i}" for i in range(20)), *(f"s{i}/d" for i in range(20))}
    assert sorted(synced) == sorted([*expected, *folders])  # each file and folder exactly once
    assert tree_digests(root, sync=False) == {**digests, "manifest.json": file_digest(root / "manifest.json")}


def test_a_large_tree_is_made_durable_by_one_syncfs_not_an_fsync_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from quiesce.coordinator import durable, publish

    if not durable.syncfs_available():
        pytest.skip("no syncfs(2) on this system: every file is fsynced (the test above)")
    root = tmp_path / "staging"
    files = [f"s{i}/f{j}.jsonl" for i in range(SYNCFS_MIN_FILES // 2) for j in range(2)]
    for k, rel in enumerate(files):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(k * 31))
    fsynced: list[int] = []
    synced: list[Path] = []
    real_syncfs = publish.syncfs  # type: ignore[attr-defined]  # the name publish calls

    def spy(path: Path) -> None:
        synced.append(path)
        real_syncfs(path)  # the real system call, on the real filesystem

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", fsynced.append)
        patch.setattr(publish, "syncfs", spy)
        digests = tree_digests(root, sync=True)
    assert (synced, fsynced) == ([root], [])
    assert digests == tree_digests(root, sync=False)
    assert all(digests[rel] == file_digest(root / rel) for rel in files)
    with pytest.raises(FileNotFoundError, match="missing"):
        durable.syncfs(tmp_path / "missing")


def test_verify_snapshot_lists_every_difference(tmp_path: Path) -> None:
    folder = _snapshot(tmp_path, "e1-000001", 1, 1, [{"name": "m", "component": "responses_api_models"}])
    assert verify_snapshot(folder, participants={"m": "responses_api_models"}).checkpoint_id == "e1-000001"
    (folder / "data" / "a.txt").write_text("changed!!\n")
    (folder / "extra").write_text("x")
    with pytest.raises(SnapshotError) as caught:
        verify_snapshot(folder, participants={"m": "responses_api_agents", "n": "resources_servers"})
    assert caught.value.differences == [
        "data/a.txt: sha256 differs from the manifest",
        "extra: not listed in the manifest",
        "participant n: a participant of this cluster but not in the snapshot",
        "participant m: is a responses_api_agents now, the snapshot has a responses_api_models",
    ]
    with pytest.raises(SnapshotError, match="is not a snapshot folder"):
        verify_snapshot(tmp_path / "nothing", participants={})


def test_verify_snapshot_checks_each_participant_manifest_against_its_commit_digest(tmp_path: Path) -> None:
    """A server manifest re-listed in the top manifest (file list consistent) but not the one its
    commit reported (`manifest_digest` of the commit reply) is a difference."""
    own = "resources/tools/manifest.json"
    folder = tmp_path / "e1-000002"
    (folder / "resources" / "tools").mkdir(parents=True)
    (folder / own).write_text('{"sessions": 1}\n')
    committed = sha256_hex((folder / own).read_bytes())
    entry = {"name": "tools", "component": "resources_servers", "manifest": own, "manifest_digest": committed}

    def publish_manifest() -> None:
        manifest = build_manifest(
            folder,
            checkpoint_id=folder.name,
            created="2025-01-01T00:00:00Z",
            epoch=1,
            ledger_seq=2,
            participants=[entry],
            skipped=[],
        )
        write_json_durably(folder / "manifest.json", manifest)

    publish_manifest()
    assert verify_snapshot(folder, participants={"tools": "resources_servers"}).checkpoint_id == folder.name
    (folder / own).write_text('{"sessions": 2}\n')
    (folder / "manifest.json").unlink()
    publish_manifest()  # the file list re-digested; the commit's digest kept
    with pytest.raises(SnapshotError) as caught:
        verify_snapshot(folder, participants={"tools": "resources_servers"})
    assert caught.value.differences == [
        f"participant tools: {own} is not the manifest its commit reported"
        " (sha256 differs from the commit's manifest_digest)"
    ]


@asynccontextmanager
async def _raw_server(reply: Callable[[bytes], bytes]) -> AsyncIterator[str]:
    """A loopback HTTP server that answers every request with `reply(request_head)`, then closes."""

    async def handle(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(reply(head))

    async with loopback(handle) as url:
        yield url


async def _capabilities(ledger: Ledger, url: str, token: str) -> CallResult:
    """One recorded capabilities call to `url` from a new epoch of `ledger`."""
    await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
    caller = Caller(ledger, token, epoch=ledger.epoch)
    try:
        return await caller.capabilities("srv", url, deadline_ts=2e9)
    finally:
        await caller.aclose()


def _http(status: int, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "body", "error", "code"),
    [
        (200, b'{"a": "' + b"x" * (MAX_REPLY_BYTES + 10) + b'"}', "protocol", None),
        (200, b"[1, 2]", "protocol", None),
        (
            409,
            json.dumps({"error": {"code": "invalid_phase", "detail": "no"}}).encode(),
            "http",
            "invalid_phase",
        ),
        (503, b"down", "http", None),
    ],
)
async def test_reply_classes(tmp_path: Path, status: int, body: bytes, error: str, code: str | None) -> None:
    seen: list[bytes] = []

    def reply(head: bytes) -> bytes:
        seen.append(head)
        return _http(status, body)

    async with (
        _raw_server(reply) as url,
        Ledger.open(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}", secrets=("sekret",)) as ledger,
    ):
        result = await _capabilities(ledger, url, "sekret")
        events = [ev async for ev in ledger.read()]
    assert (result.ok, result.error, result.code) == (False, error, code)
    if status != 200:
        assert result.status == status
    if len(body) > MAX_REPLY_BYTES:
        assert result.detail == "reply larger than 1 MiB"
    assert b"authorization: Bearer sekret" in seen[0].lower().replace(b"bearer", b"Bearer")
    failed = [ev for ev in events if ev.kind == "call.failed"]
    assert [ev.data["error"] for ev in failed] == [error]
    assert "sekret" not in json.dumps([ev.data for ev in events])


@pytest.mark.anyio
@pytest.mark.parametrize("size", [100, MAX_REPLY_BYTES + 10])
async def test_a_reply_without_a_length_is_read_up_to_the_cap(tmp_path: Path, size: int) -> None:
    body = b'{"a": "' + b"x" * (size - 9) + b'"}'
    chunks = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:50], body[50:]))
    framed = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"

    async with (
        _raw_server(lambda head: framed + chunks + b"0\r\n\r\n") as url,
        Ledger.open(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}") as ledger,
    ):
        result = await _capabilities(ledger, url, "t")
    if size > MAX_REPLY_BYTES:
        assert (result.error, result.detail) == ("protocol", "reply larger than 1 MiB")
    else:  # read whole: a JSON object that is not a capabilities document
        assert result.error == "protocol"
        assert result.detail is not None
        assert result.detail.startswith("reply does not match Capabilities")


@pytest.mark.anyio
@pytest.mark.parametrize("answer_after_s", [0.0, 0.5])
async def test_a_read_is_committed_with_the_next_append_or_while_it_waits(
    tmp_path: Path, answer_after_s: float
) -> None:
    """A GET changes nothing on the server, so its `call.sent` is staged, not committed before the
    request leaves: a quick read is committed with the next append; a read still unanswered after
    `STAGED_READ_COMMIT_S` has it committed while the server holds the request (a long poll)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"

    async def committed() -> list[str]:
        async with Ledger.open(url, readonly=True) as reader:
            return [ev.kind async for ev in reader.read() if ev.kind.startswith("call.")]

    seen_by_server: list[list[str]] = []

    async def handle(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            await anyio.sleep(answer_after_s)
            seen_by_server.append(await committed())
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(_http(503, b"down"))

    async with loopback(handle) as server_url, Ledger.open(url) as ledger:
        assert answer_after_s == 0 or answer_after_s > 2 * STAGED_READ_COMMIT_S
        result = await _capabilities(ledger, server_url, "t")
        assert (result.error, result.status) == ("http", 503)
        after_the_read = await committed()
        await ledger.flush()
        flushed = await committed()
    if answer_after_s == 0:
        assert seen_by_server == [[]]
        assert after_the_read == []
    else:
        assert seen_by_server == [["call.sent"]]
        assert after_the_read == ["call.sent"]
    assert flushed == ["call.sent", "call.failed"]


@pytest.mark.anyio
async def test_a_commit_failing_during_a_long_read_stops_it_and_is_raised_as_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit made while a read waits fails (here: the ledger is fenced): the read is stopped
    and the caller gets that `FencedError` itself, not an exception group."""
    import time

    from quiesce.ledger import FencedError

    async def hold(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            await anyio.sleep(30)

    async def fenced() -> None:
        raise FencedError("another coordinator took over")

    url = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    async with loopback(hold) as server_url, Ledger.open(url) as ledger:
        monkeypatch.setattr(ledger, "flush", fenced)
        started = time.monotonic()
        with pytest.raises(FencedError, match="another coordinator took over"):
            await _capabilities(ledger, server_url, "t")
        assert time.monotonic() - started < 10  # stopped, not waited out


@pytest.mark.anyio
async def test_connect_and_timeout(tmp_path: Path) -> None:
    import time

    async with Ledger.open(f"sqlite+aiosqlite:///{tmp_path / 'l.db'}") as ledger:
        await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
        caller = Caller(ledger, "t", epoch=ledger.epoch)
        try:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            await listener.aclose()
            refused = await caller.capabilities(
                "gone", f"http://127.0.0.1:{port}", deadline_ts=time.time() + 5
            )
            assert (refused.error, refused.ok) == ("connect", False)

            async def silent(stream: anyio.abc.ByteStream) -> None:
                async with stream:
                    await anyio.sleep(30)

            async with loopback(silent) as quiet_url:
                late = await caller.capabilities("slow", quiet_url, deadline_ts=time.time() + 0.3)
            assert (late.error, late.ok) == ("timeout", False)

            async def trickle(stream: anyio.abc.ByteStream) -> None:
                # headers at once, then a byte of a never-ending chunked body every 20 ms
                async with stream:
                    await stream.receive()
                    await stream.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                      b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                    with suppress(Exception):
                        while True:
                            await stream.send(b"1\r\n \r\n")
                            await anyio.sleep(0.02)

            async with loopback(trickle) as slow_url:
                started = time.monotonic()
                dribbled = await caller.capabilities("trickle", slow_url, deadline_ts=time.time() + 0.3)
                took = time.monotonic() - started
            assert (dribbled.error, dribbled.ok, dribbled.status) == ("timeout", False, None)
            assert took < 5  # cut off at the deadline, not when the body ends (never)
        finally:
            await caller.aclose()
        kinds = [(ev.kind, ev.data.get("error")) async for ev in ledger.read() if ev.kind.startswith("call.")]
    assert kinds == [
        ("call.sent", None),
        ("call.failed", "connect"),
        ("call.sent", None),
        ("call.failed", "timeout"),
        ("call.sent", None),
        ("call.failed", "timeout"),
    ]


@pytest.mark.anyio
async def test_a_save_fsyncs_only_what_recovery_and_the_rename_wait_on(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """Against the reference cluster: of a whole save, only one transaction is fsynced — the one
    that carries `attempt.started` (it lists every server the attempt may touch), which is the
    transaction of the first `call.sent`; every other transaction is write-behind and ends with a
    `call.sent` (committed before its request leaves) or the final `attempt.completed`. Outcomes,
    phase boundaries, `attempt.publishing` and `attempt.published` are staged and ride in the next
    of those transactions — none commits on its own, and the rename waits for no transaction (the
    fsynced rename decides publication)."""
    from quiesce.coordinator import Coordinator
    from quiesce.ledger import Event

    config = configure(cluster, sqlite_url)
    batches: list[tuple[list[str], bool]] = []
    async with Coordinator.open(config) as coord:
        await coord.discover()
        backend: Any = coord.ledger.backend
        real_now, real_append = backend.append_now, backend.append
        noted: set[int] = set()  # the awaited path's backend.append may commit through append_now

        def note(batch: Any) -> None:
            assert all(isinstance(event, Event) for event in batch.events)
            if batch.events[0].seq not in noted:
                noted.add(batch.events[0].seq)
                batches.append(([event.kind for event in batch.events], batch.durable))

        def spy_now(batch: Any) -> None:
            real_now(batch)
            note(batch)

        async def spy_append(batch: Any) -> None:
            await real_append(batch)
            note(batch)

        backend.append_now = spy_now
        backend.append = spy_append
        attempt = await coord.checkpoint(deadline_s=30)
    assert attempt.snapshot is not None
    assert batches[0] == (["attempt.started", "phase.started", "call.sent"], True)
    assert [kinds[-1] for kinds, durable in batches if durable] == ["call.sent"]
    assert {kinds[-1] for kinds, durable in batches if not durable} == {"call.sent", "attempt.completed"}
    assert batches[-1][0][-1] == "attempt.completed"
    seen = [kind for kinds, _ in batches for kind in kinds]
    staged = {"call.replied", "phase.started", "phase.completed", "attempt.publishing", "attempt.published"}
    assert staged <= set(seen)
    # the publish step's records ride with the first resume request's call.sent
    resume_first = next(kinds for kinds, _ in batches if "attempt.published" in kinds)
    assert resume_first[-1] == "call.sent"
    assert resume_first.index("attempt.publishing") < resume_first.index("attempt.published")
    # one transaction per request at most (a parallel fan-out may share one), plus the final one
    assert len(batches) <= seen.count("call.sent") + 1
    async with Ledger.open(sqlite_url, readonly=True) as ledger:  # closed: everything is on disk
        stored = [e.kind async for e in ledger.read(checkpoint_id=attempt.checkpoint_id)]
    assert stored == seen
