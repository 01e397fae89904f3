"""Ledger files as users really have them: symlinked, hard-linked, in a missing folder, not a
database, on a full or read-only disk, filling up in the middle of an attempt.

Every refusal is a `LedgerError` whose message says what is wrong and what to do, and through the
CLI one line with no traceback (exit 1; 2 for bad usage). Full and read-only filesystems are real
(a small tmpfs, remounted read-only: `conftest.Mounts`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, parse_config
from quiesce.coordinator.stranded import LedgerStranded
from quiesce.ledger import FencedError, Ledger, LedgerError, replay_url, sqlitefile
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.helpers import assert_all_accepting, read_events
from tests.hostile.conftest import Mounts, fill
from tests.hostile.front import Rule, after, hostile_front
from tests.hostile.helpers import REPO, no_traceback, run_cli
from tests.ledger.helpers import COORDINATOR, SENT, run_and_kill, started

pytestmark = pytest.mark.anyio


def _url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


async def _ledger_with_one_attempt(url: str) -> None:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        await ledger.append("attempt.started", checkpoint_id="c1", data=started())
        await ledger.append("call.sent", checkpoint_id="c1", server="s", call_id="k1", data=SENT)


# -- symlinks, hard links, identity ---------------------------------------------------------------


async def test_a_symlinked_ledger_is_its_target_for_wal_and_writer_lock(tmp_path: Path) -> None:
    real = tmp_path / "data" / "q.db"
    real.parent.mkdir()
    link = tmp_path / "q-link.db"
    link.symlink_to(real)
    async with Ledger.open(_url(link)) as writer:  # creates the target through the link
        await writer.start_epoch(COORDINATOR)
        await writer.append("call.sent", call_id="k", data=SENT)  # durable: fsyncs <target>-wal
        assert (tmp_path / "data" / "q.db-wal").exists()
        assert not (tmp_path / "q-link.db-wal").exists()
        with pytest.raises(FencedError, match="already has a writer"):  # the same file by its real name
            await Ledger.connect(_url(real))
    assert link.is_symlink()  # the link is left as it was, not replaced by a file
    async with Ledger.open(_url(link), readonly=True) as reader:
        assert [e.kind for e in [e async for e in reader.read()]] == ["coordinator.started", "call.sent"]
    done = run_cli("history", "--ledger", _url(link))
    assert done.returncode == 0, done.stderr
    assert (await replay_url(_url(link))).chain_ok


async def test_a_hard_linked_ledger_is_refused_by_writers_and_readers(tmp_path: Path) -> None:
    first = tmp_path / "a.db"
    await _ledger_with_one_attempt(_url(first))
    second = tmp_path / "b.db"
    os.link(first, second)
    for path in (first, second):
        for readonly in (False, True):
            with pytest.raises(LedgerError, match="2 hard links") as info:
                await Ledger.connect(_url(path), readonly=readonly)
            assert "find / -xdev -samefile" in str(info.value)
    done = run_cli("history", "--ledger", _url(second))
    assert done.returncode == 1
    assert "hard links" in done.stderr
    no_traceback(done)
    second.unlink()  # one name again: usable
    async with Ledger.open(_url(first)) as writer:
        await writer.start_epoch(COORDINATOR)


def _hold_writer(url: str) -> subprocess.Popen[str]:
    """A child process that opens `url` as its writer and holds it (until it is killed)."""
    child = f"""
import anyio
from quiesce.ledger import Ledger
async def main():
    ledger = await Ledger.connect({url!r})
    print("holding", flush=True)
    await anyio.sleep(3600)
anyio.run(main)
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "holding"
    return proc


async def test_the_writer_lock_is_the_files_identity_whatever_the_path(tmp_path: Path) -> None:
    """Two paths to one file — through a symlinked folder, and its real path — one writer."""
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    path = tmp_path / "real" / "q.db"
    proc = await anyio.to_thread.run_sync(_hold_writer, _url(tmp_path / "alias" / "q.db"))
    try:
        with pytest.raises(FencedError, match=f"process {proc.pid} holds the writer lock"):
            await Ledger.connect(_url(path))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    async with Ledger.open(_url(path)) as writer:  # the kernel released the lock with the process
        await writer.start_epoch(COORDINATOR)
    leftovers = await anyio.to_thread.run_sync(lambda: list(tmp_path.glob("**/*.writer-lock")))
    assert leftovers == []  # no lock file beside the ledger


async def test_a_writer_lock_being_released_is_waited_for_briefly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock whose holder `/proc/locks` no longer shows is being released — its writer has just
    died, as when `quiesce recover` follows a SIGKILL — so the next writer tries again for up to
    `RELEASING_WAIT_S` instead of refusing with "process unknown". The lock here is a real writer's
    in a real process; only the lookup of its holder is hidden, as it is in that moment."""
    path = tmp_path / "q.db"
    proc = await anyio.to_thread.run_sync(_hold_writer, _url(path))
    monkeypatch.setattr(sqlitefile, "lock_holder", lambda st: None)
    try:
        # released 0.2 s into the new writer's wait: it gets the lock
        killer = threading.Timer(0.2, proc.kill)
        killer.start()
        async with Ledger.open(_url(path)) as writer:
            await writer.start_epoch(COORDINATOR)
        killer.join()
        # never released: refused once the wait is over, saying the holder is unknown
        proc.wait()
        proc = await anyio.to_thread.run_sync(_hold_writer, _url(path))
        with pytest.raises(FencedError, match="process unknown holds the writer lock"):
            await Ledger.connect(_url(path))
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# -- where the file is, what it is ------------------------------------------------------------------


async def test_a_ledger_in_a_missing_folder_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    url = _url(tmp_path / "no" / "such" / "q.db")
    for readonly in (False, True):
        with pytest.raises(LedgerError, match="does not exist"):
            await Ledger.connect(url, readonly=readonly)
    assert not (tmp_path / "no").exists()
    config = tmp_path / "cluster.yaml"
    config.write_text(f"ledger: {url}\nservers:\n  - {{name: m, url: 'http://127.0.0.1:9'}}\n")
    done = run_cli("recover", "--config", str(config))
    assert done.returncode == 1
    assert "does not exist" in done.stderr
    assert "mkdir -p" in done.stderr
    no_traceback(done)
    done = run_cli("history", "--ledger", url)  # a reader names a file that is not there: bad usage
    assert done.returncode == 2
    assert "no ledger file" in done.stderr
    no_traceback(done)
    assert not (tmp_path / "no").exists()


def test_sim_owns_the_folder_of_the_ledger_it_names(tmp_path: Path) -> None:
    config = tmp_path / "out" / "sim.yaml"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "quiesce.tools.cli.main", "sim", "--ledger", "sqlite+aiosqlite:///runs/one/q.db",
         "--config-out", str(config)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(600):
            if config.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert config.exists(), proc.stderr.read() if proc.stderr else ""
        assert (tmp_path / "out" / "runs" / "one").is_dir()  # relative to the config, as it is read
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("what", ["a text file", "a folder", "a FIFO"])
async def test_something_that_is_not_a_sqlite_file_is_refused_and_left_alone(
    tmp_path: Path, what: str
) -> None:
    path = tmp_path / "notes.db"
    if what == "a text file":
        path.write_text("my notes, not a ledger\n")
    elif what == "a folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    expected = {"a text file": "is not a SQLite database", "a folder": "is a folder", "a FIFO": "is a FIFO"}[
        what
    ]
    for readonly in (False, True):
        with pytest.raises(LedgerError, match=expected):
            await Ledger.connect(_url(path), readonly=readonly)
    done = run_cli("db", "upgrade", "--ledger", _url(path))
    assert done.returncode == 1
    assert expected in done.stderr
    no_traceback(done)
    done = run_cli("history", "--ledger", _url(path))  # a reader's --ledger is checked as a flag first
    if what == "a text file":
        assert (done.returncode, expected in done.stderr) == (1, True), done.stderr
    else:  # bad usage: the flag names what the path is
        assert done.returncode == 2
        assert ("is a folder" if what == "a folder" else "is not a regular file") in done.stderr
    no_traceback(done)
    if what == "a text file":
        assert path.read_text() == "my notes, not a ledger\n"  # never written to


# -- full and read-only filesystems -------------------------------------------------------------------


async def test_a_full_disk_at_open_is_one_clear_error(mounts: Mounts, tmp_path: Path) -> None:
    disk = mounts.small_fs(1 << 20)
    existing = disk / "old.db"
    await _ledger_with_one_attempt(_url(existing))
    filler = fill(disk)
    with pytest.raises(LedgerError, match="full") as info:  # a new ledger: its schema cannot be written
        await Ledger.connect(_url(disk / "new.db"))
    assert "free space" in str(info.value)
    config = tmp_path / "cluster.yaml"
    config.write_text(f"ledger: {_url(existing)}\nservers:\n  - {{name: m, url: 'http://127.0.0.1:9'}}\n")
    done = run_cli("recover", "--config", str(config))  # an existing ledger: its new epoch cannot be written
    assert done.returncode == 1
    assert "full" in done.stderr
    no_traceback(done)
    filler.unlink()
    async with Ledger.open(_url(existing)) as writer:  # space again: it opens, its chain intact
        await writer.start_epoch(COORDINATOR)
    assert (await replay_url(_url(existing))).chain_ok


async def test_every_read_command_reads_a_ledger_on_a_full_disk(mounts: Mounts, tmp_path: Path) -> None:
    """A WAL database needs its -shm index created even to be read; on a disk with no room for it
    (the ledger closed cleanly: nothing left in a -wal file) the read commands read the file as it
    stands, and a writer is still refused with the disk named."""
    disk = mounts.small_fs(1 << 20)
    path = disk / "q.db"
    url = _url(path)
    await _ledger_with_one_attempt(url)
    assert not await anyio.Path(f"{path}-shm").exists()
    fill(disk)
    out = tmp_path / "out"
    out.mkdir()
    for args in (
        ("history", "--ledger", url, "--json"),
        ("show", "c1", "--ledger", url),
        ("check", "--ledger", url),
        ("replay", "--verify", "--ledger", url),
        ("export", "--ledger", url, "--out", str(out / "bundle.jsonl")),
        ("report", "--ledger", url, "--out", str(out / "report.html")),
    ):
        done = run_cli(*args)
        no_traceback(done)
        assert "full" not in done.stderr, (args, done.stderr)
        assert "disk" not in done.stderr, (args, done.stderr)
        assert done.returncode in (0, 1), (args, done.stderr)  # 1: a protocol finding, not a failure to read
    history = run_cli("history", "--ledger", url, "--json")
    assert [row["checkpoint_id"] for row in json.loads(history.stdout)] == ["c1"]
    assert await anyio.Path(out / "bundle.jsonl").exists()
    config = tmp_path / "cluster.yaml"
    config.write_text(f"ledger: {url}\nservers:\n  - {{name: m, url: 'http://127.0.0.1:9'}}\n")
    done = run_cli("recover", "--config", str(config))
    assert done.returncode == 1
    assert "full" in done.stderr
    no_traceback(done)


@pytest.mark.parametrize("left_behind", ["closed cleanly", "writer killed (WAL left behind)"])
async def test_a_read_only_filesystem_refuses_writers_and_serves_every_read_command(
    mounts: Mounts, tmp_path: Path, left_behind: str
) -> None:
    disk = mounts.small_fs(4 << 20)
    path = disk / "q.db"
    url = _url(path)
    await _ledger_with_one_attempt(url)
    if left_behind != "closed cleanly":
        child = f"""
import anyio
from quiesce.ledger import Ledger
async def main():
    ledger = await Ledger.connect({url!r})
    await ledger.start_epoch({COORDINATOR!r})
    data = {{"servers": ["s"], "outcome": "published"}}
    ev = await ledger.append("attempt.completed", checkpoint_id="c1", data=data)
    print(ev.seq, flush=True)
    await anyio.sleep(3600)
anyio.run(main)
"""
        line, _ = await anyio.to_thread.run_sync(run_and_kill, child)
        assert line.strip() == "5"
        assert await anyio.Path(f"{path}-wal").exists()
    mounts.read_only(disk)
    with pytest.raises(LedgerError, match="read-only filesystem") as info:
        await Ledger.connect(url)
    assert "Read-only commands" in str(info.value)
    last = 5 if left_behind != "closed cleanly" else 3
    async with Ledger.open(url, readonly=True) as reader:
        head = await reader.head()
        assert head is not None
        assert head.seq == last  # the WAL's last commit is read too
    out = tmp_path / "out"
    out.mkdir()
    for args in (
        ("history", "--ledger", url),
        ("show", "c1", "--ledger", url),
        ("check", "--ledger", url),
        ("replay", "--verify", "--ledger", url),
        ("export", "--ledger", url, "--out", str(out / "bundle.jsonl")),
        ("report", "--ledger", url, "--out", str(out / "report.html")),
    ):
        done = run_cli(*args)
        no_traceback(done)
        assert "read-only" not in done.stderr, (args, done.stderr)
        assert done.returncode in (0, 1), (args, done.stderr)  # 1: a protocol finding, not a failure to read
    assert await anyio.Path(out / "bundle.jsonl").exists()
    assert await anyio.Path(out / "report.html").exists()
    config = tmp_path / "cluster.yaml"
    config.write_text(f"ledger: {url}\nservers:\n  - {{name: m, url: 'http://127.0.0.1:9'}}\n")
    done = run_cli("recover", "--config", str(config))
    assert done.returncode == 1
    assert "read-only filesystem" in done.stderr
    no_traceback(done)


# -- a ledger that fills up in the middle of an attempt ------------------------------------------------


async def test_a_ledger_that_fills_up_mid_attempt_names_who_is_paused_and_recover_frees_them(
    mounts: Mounts, cluster: RunningCluster, tmp_path: Path
) -> None:
    disk = mounts.small_fs(8 << 20)
    url = _url(disk / "q.db")
    filler: list[Path] = []
    # the disk fills while the agent prepares (its prepare is applied, its reply delivered)
    rule = Rule("/agent-checkpoint/prepare", after(lambda body: filler.append(fill(disk))))
    async with (
        httpx.AsyncClient(timeout=30) as http,
        hostile_front(cluster.urls["simple_agent"], rule) as front,
    ):
        document: dict[str, Any] = cluster.config(url, tmp_path / "snapshots")
        for entry in document["servers"]:
            if entry["name"] == "simple_agent":
                entry["url"] = front
        config = parse_config(document, base_dir=tmp_path)
        with pytest.raises(LedgerStranded) as caught:
            async with Coordinator.open(config) as coord:
                await coord.checkpoint(deadline_s=20)
        error = caught.value
        message = str(error)
        assert "full" in message
        assert "quiesce recover" in message
        # the two it paused, and the next one, whose request was about to leave when the append failed
        assert error.left_paused[:2] == ["policy_model", "simple_agent"]
        assert set(error.left_paused) <= {"policy_model", "simple_agent", "tools"}
        assert ", ".join(error.left_paused) in message
        states = {name: (await http.get(f"{u}/ng-control/v1/capabilities")).json()["phase"]
                  for name, u in cluster.urls.items()}  # fmt: skip
        assert states["policy_model"] != "idle"  # really left paused: nothing could be recorded
        assert states["simple_agent"] != "idle"
        filler[0].unlink()  # space again
        async with Coordinator.open(config) as coord:  # opening recovers: what `quiesce recover` does
            report = coord.last_recovery
            assert report is not None
            assert [a.checkpoint_id for a in report.attempts] == [error.checkpoint_id]
        await assert_all_accepting(http, cluster)
    events = await read_events(url, error.checkpoint_id)
    assert [e.kind for e in events][-1] == "attempt.aborted"
    assert (await replay_url(url)).chain_ok


def _copy_closed_ledger(source: Path, copy: Path) -> None:
    """A closed SQLite ledger copied as a backup tool would copy it (its WAL files too)."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{source}{suffix}").exists():
            Path(f"{copy}{suffix}").write_bytes(Path(f"{source}{suffix}").read_bytes())


async def test_two_copies_of_one_ledger_save_without_repeating_a_checkpoint_id(
    cluster: RunningCluster, tmp_path: Path
) -> None:
    """A backup restored beside its original: both reach the same epoch and seq, yet each save gets
    an id the servers never retired (a repeated id would be refused `stale_checkpoint`)."""
    original = tmp_path / "ledger.db"
    backup = tmp_path / "backup.db"

    def config(db: Path) -> Any:
        document = cluster.config(f"sqlite+aiosqlite:///{db}", tmp_path / "snapshots")
        return parse_config(document, base_dir=tmp_path)

    async with Coordinator.open(config(original)) as coord, coord.save(deadline_s=20):
        pass
    _copy_closed_ledger(original, backup)
    made: list[str] = []
    async with httpx.AsyncClient(timeout=30) as http:
        for db in (backup, original):  # the backup first, then the original: same epoch, same seq
            async with Coordinator.open(config(db)) as coord:
                async with coord.save(deadline_s=20) as attempt:
                    made.append(attempt.checkpoint_id)
                assert attempt.snapshot is not None, attempt
            await assert_all_accepting(http, cluster)
    first, second = made
    assert first != second
    assert first.rsplit("-w", 1)[0] == second.rsplit("-w", 1)[0]  # same ledger id, seq and epoch
    for db, cid in ((backup, first), (original, second)):
        kinds = [e.kind for e in await read_events(f"sqlite+aiosqlite:///{db}", cid)]
        assert "attempt.published" in kinds, kinds
        assert "attempt.aborted" not in kinds, kinds
