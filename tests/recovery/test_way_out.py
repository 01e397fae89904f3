"""No server is ever left paused (issue 19): the three paths that broke that promise, as a new user
and a reviewer met them, against real reference servers, real ledgers and real processes.

1. A plain restore (servers restored and paused), then a checkpoint: the checkpoint is refused
   before any request leaves, naming the restore that holds the servers, since when, and the
   command that frees them; that command (`quiesce resume`) frees them.
2. `quiesce restore --resume` SIGKILLed in its resume phase (one server resumed, the others still
   restored and paused): `quiesce recover` finishes the resume; a second recover does nothing.
3. A new ledger (SQLite and PostgreSQL) against a cluster that already retired another ledger's
   checkpoint ids: its checkpoints get ids no Gym server has seen, and succeed.

And the wording: a checkpoint refused for a wrong control token says so, and does not claim a
server "could not be resumed" or was "left paused" when it never paused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.coordinator.crashpoints import CRASH_BEFORE_SEND
from quiesce.coordinator.protocol import CAPABILITIES_PATH, TOKEN_ENV
from quiesce.ledger import Ledger
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.cli.main import main as cli
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import IMPORT_ROOT
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    clear_faults,
    control_logs,
    read_events,
    server_states,
    set_faults,
)
from tests.recovery.helpers import Died, kind_is

GYM_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PARTICIPANTS = ("policy_model", "simple_agent", "tools")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """Run the CLI in this process; (exit code, stdout parsed as JSON when --json, stderr)."""
    capsys.readouterr()
    code = cli(list(argv))
    captured = capsys.readouterr()
    out: Any = captured.out
    if "--json" in argv and captured.out.strip():
        out = json.loads(captured.out)
    return code, out, captured.err


def _quiesce(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in its own process (this tree's code), so it can really be SIGKILLed."""
    environ = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "quiesce.tools.cli.main", *argv],
        cwd=str(IMPORT_ROOT),
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )


def _states(cluster: Any) -> dict[str, tuple[str, str]]:
    async def go() -> dict[str, tuple[str, str]]:
        async with httpx.AsyncClient() as http:
            return await server_states(http, cluster)

    return anyio.run(go)


def _posts(cluster: Any) -> int:
    async def go() -> int:
        async with httpx.AsyncClient() as http:
            logs = await control_logs(http, cluster)
        return sum(1 for log in logs.values() for e in log if e["method"] == "POST")

    return anyio.run(go)


def _all_accepting(cluster: Any) -> None:
    async def go() -> None:
        async with httpx.AsyncClient() as http:
            await assert_all_accepting(http, cluster)

    anyio.run(go)


@pytest.fixture
def config_file(cluster: Any, tmp_path: Path, token: str) -> Path:
    path: Path = cluster.write_config(
        tmp_path / "cluster.yaml", f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", "snaps"
    )
    return path


# -- 1. stuck for good -------------------------------------------------------------------------


def test_checkpoint_after_a_plain_restore_is_refused_up_front_and_resume_frees(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any
) -> None:
    code, doc, _ = _run(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert code == 0, doc
    code, doc, _ = _run(capsys, "restore", "--config", str(config_file), "--json")
    assert (code, doc["outcome"]) == (0, "restored")
    restore_id = doc["checkpoint_id"]
    assert {n: s[0] for n, s in _states(cluster).items() if n in PARTICIPANTS} == dict.fromkeys(
        PARTICIPANTS, "restored_paused"
    )

    posts = _posts(cluster)
    code, doc, err = _run(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert code == 1
    assert _posts(cluster) == posts, "the refused checkpoint sent a control request"
    text = " ".join(err.split())
    assert restore_id in text
    assert "(restore: restored, waiting for its resume; since " in text
    assert f"quiesce resume --config {config_file} {restore_id}" in text
    assert doc["outcome"] == "refused"

    # the command it names frees every server
    code, doc, _ = _run(capsys, "resume", "--config", str(config_file), "--json")
    assert code == 0, doc
    assert (doc["checkpoint_id"], doc["outcome"]) == (restore_id, "resumed")
    _all_accepting(cluster)
    code, doc, _ = _run(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert (code, doc["outcome"]) == (0, "published")
    anyio.run(assert_protocol_ok, f"sqlite+aiosqlite:///{config_file.parent / 'q.db'}")


# -- 2. an interrupted post-restore resume -----------------------------------------------------


def test_sigkill_in_the_resume_of_restore_resume_is_finished_by_recover(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any, token: str
) -> None:
    code, doc, _ = _run(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert code == 0, doc
    # the restore sends 3 POSTs (policy, agent, resources); its resume starts with tools (POST 4):
    # die right before POST 5 (the policy model's resume) — tools resumed, the others paused
    died = _quiesce(
        "restore", "--config", str(config_file), "--resume", "--json", env={CRASH_BEFORE_SEND: "5"}
    )
    assert died.returncode == -9, died.stderr
    states = _states(cluster)
    assert states["tools"] == ("idle", "accepting")
    assert states["policy_model"][0] == "restored_paused"
    assert states["simple_agent"][0] == "restored_paused"

    code, doc, err = _run(capsys, "recover", "--config", str(config_file), "--json")
    assert code == 0, err
    [found] = doc["attempts"]
    assert found["action"] == "resumed", found
    _all_accepting(cluster)
    # a second recover finds nothing
    code, doc, _ = _run(capsys, "recover", "--config", str(config_file), "--json")
    assert (code, doc["attempts"]) == (0, [])
    url = f"sqlite+aiosqlite:///{config_file.parent / 'q.db'}"
    events = anyio.run(read_events, url, found["checkpoint_id"])
    # not written "restored" before its resume ran: a restore --resume ends once, resumed
    assert [e.data["outcome"] for e in events if e.kind == "attempt.completed"] == ["resumed"]
    anyio.run(assert_protocol_ok, url)


# -- 3. ids unique across ledgers --------------------------------------------------------------


@pytest.fixture
def another_ledger(ledger_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A second fresh ledger on the same backend as `ledger_url`."""
    if ledger_url.startswith("sqlite"):
        return f"sqlite+aiosqlite:///{tmp_path / 'second.db'}"
    postgres = request.getfixturevalue("postgres")
    url: str = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    return url


@pytest.mark.anyio
async def test_a_new_ledger_against_a_cluster_that_retired_another_ledgers_ids(
    cluster: Any, ledger_url: str, another_ledger: str, configure: Any
) -> None:
    first = configure(cluster, ledger_url)
    seen: list[str] = []
    async with Coordinator.open(first) as coord:
        for _ in range(3):
            seen.append((await coord.checkpoint(deadline_s=20)).checkpoint_id)
    # a new ledger, the same long-running servers (which remember every retired id)
    second = configure(cluster, another_ledger)
    mine: list[str] = []
    for _ in range(3):  # one coordinator (one epoch) per checkpoint, as the CLI does
        async with Coordinator.open(second) as coord:
            mine.append((await coord.checkpoint(deadline_s=20)).checkpoint_id)
    assert not set(mine) & set(seen)
    for cid in seen + mine:
        assert GYM_ID.match(cid), cid
        assert len(cid) <= 128
    assert sorted(mine) == mine  # sortable within one ledger
    assert sorted(seen) == seen
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)
    async with Ledger.open(another_ledger, readonly=True) as ledger:
        rows = await ledger.attempts()
    assert [(r.checkpoint_id, r.outcome) for r in rows] == [(cid, "published") for cid in mine]
    await assert_protocol_ok(another_ledger)


# -- wording -----------------------------------------------------------------------------------


def test_a_wrong_token_says_so_and_no_server_is_called_left_paused(
    capsys: pytest.CaptureFixture[str],
    config_file: Path,
    cluster: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "not-the-servers-token")
    code, doc, err = _run(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert code == 1
    text = " ".join(err.split())
    assert "401" in text
    assert "set NEMO_GYM_CHECKPOINT_CONTROL_TOKEN to the Gym servers' control token" in text
    assert "could not resume" not in text.lower()
    assert doc["not_resumed"] == []
    _all_accepting(cluster)
    report = anyio.run(check_ledger, f"sqlite+aiosqlite:///{config_file.parent / 'q.db'}")
    assert report.violations == []
    assert not [w for w in report.warnings if "left paused" in w.message], report.warnings


# -- what the fence does not show -------------------------------------------------------------


async def _status(capsys: pytest.CaptureFixture[str], config_file: Path) -> tuple[int, Any, str]:
    return await anyio.to_thread.run_sync(
        lambda: _run(capsys, "status", "--config", str(config_file), "--json")
    )


async def _run_printed(capsys: pytest.CaptureFixture[str], command: str) -> tuple[int, Any, str]:
    """Run a command line exactly as `quiesce status` printed it (plus --json), off the event loop."""
    argv = shlex.split(command)
    assert argv[0] == "quiesce"
    return await anyio.to_thread.run_sync(lambda: _run(capsys, *argv[1:], "--json"))


@pytest.mark.anyio
async def test_an_agent_whose_admission_a_dead_rollback_left_closed_is_named_from_the_ledger(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any, die_after: Any
) -> None:
    """A rollout stuck in a model call keeps the agent from parking: its prepare is refused
    (`agent_prepare_incomplete`: fence back at idle, admission still closed) until the deadline,
    and the coordinator dies in the rollback before the agent's resume. The agent's fence says
    idle; only the ledger knows it is held — the status names it, and its command frees it."""
    model, agent = cluster.urls["policy_model"], cluster.urls["simple_agent"]
    async with httpx.AsyncClient(timeout=None) as http:
        await set_faults(http, model, [{"kind": "hang", "path": "/v1/responses", "rollout_id": "stuck"}])
        await client.start_rollouts(http, agent, {"stuck": 2})
        await anyio.sleep(0.3)
        die_after(kind_is("call.sent", server="simple_agent", phase="rollback"))
        with pytest.raises(Died):
            async with Coordinator.open(config_file, recover=False) as coord:
                await coord.checkpoint(deadline_s=2)
        caps = (await http.get(agent + CAPABILITIES_PATH)).json()
        assert (caps["phase"], caps["active_checkpoint_id"]) == ("idle", None)
        assert (await http.get(f"{agent}/gymsim/admin/state")).json()["admission_state"] != "accepting"
        code, doc, _ = await _status(capsys, config_file)
        assert code == 1
        held = {s["name"]: s for s in doc["servers"] if s["held"]}
        assert list(held) == ["simple_agent"]
        [holder] = doc["holders"]
        assert holder["kind"] == "save"
        assert (
            held["simple_agent"]["frees"] == f"quiesce abort --config {config_file} {holder['checkpoint_id']}"
        )
        code, doc, _ = await _run_printed(capsys, held["simple_agent"]["frees"])
        assert (code, doc["outcome"]) == (0, "aborted")
        await clear_faults(http, cluster)
        await assert_all_accepting(http, cluster)
        code, doc, _ = await _status(capsys, config_file)
        assert (code, doc["idle"]) == (0, True)
    await assert_protocol_ok(f"sqlite+aiosqlite:///{config_file.parent / 'q.db'}")


# -- a resume of a plain restore, interrupted --------------------------------------------------


@pytest.mark.anyio
async def test_an_interrupted_resume_of_a_plain_restore_is_finished_by_recovery(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    """The restore was left paused for the caller (terminal `restored`); the caller's resume then
    dies after its first request: the restore is unfinished again, and recovery finishes it."""
    config = configure(cluster, sqlite_url)
    async with Coordinator.open(config) as coord:
        await coord.checkpoint(deadline_s=30)
        restored = await coord.restore()
    die_after(kind_is("call.sent", phase="resume", method="POST"), nth=2)  # tools resumed, not the model
    with pytest.raises(Died):
        async with Coordinator.open(config) as coord:
            await coord.resume(restored.checkpoint_id)
    async with httpx.AsyncClient() as http:
        states = await server_states(http, cluster)
        assert states["tools"] == ("idle", "accepting")
        assert states["policy_model"][0] == "restored_paused"
        async with Coordinator.open(config) as coord:
            report = coord.last_recovery
            assert report is not None
            again = await coord.recover()
        await assert_all_accepting(http, cluster)
    [found] = report.attempts
    assert (found.checkpoint_id, found.found, found.action) == (restored.checkpoint_id, "resume", "resumed")
    assert again.attempts == ()
    events = await read_events(sqlite_url, restored.checkpoint_id)
    assert [e.data["outcome"] for e in events if e.kind == "attempt.completed"] == ["restored", "resumed"]
    await assert_protocol_ok(sqlite_url)


@pytest.mark.anyio
async def test_a_coordinator_that_dies_restoring_a_restarted_server_again_is_finished_by_recovery(
    cluster: Any, sqlite_url: str, configure: Any, die_after: Any
) -> None:
    """The agent restarted after a plain restore; the caller's resume finds it empty and dies as it
    restores it again. That happens inside the resume phase, so the restore is unfinished again:
    recovery restores the agent and resumes every server."""
    config = configure(cluster, sqlite_url)
    async with Coordinator.open(config) as coord:
        await coord.checkpoint(deadline_s=30)
        restored = await coord.restore()
    async with httpx.AsyncClient() as http:
        await client.restart(http, cluster.urls["simple_agent"])
        die_after(kind_is("call.sent", phase="restore", server="simple_agent"))
        with pytest.raises(Died):
            async with Coordinator.open(config) as coord:
                await coord.resume(restored.checkpoint_id)
        states = await server_states(http, cluster)
        assert states["tools"][0] == "restored_paused"  # nobody was resumed
        assert states["simple_agent"][0] == "idle"
        async with Coordinator.open(config) as coord:
            report = coord.last_recovery
        await assert_all_accepting(http, cluster)
    assert report is not None
    [found] = report.attempts
    assert (found.checkpoint_id, found.found, found.action) == (restored.checkpoint_id, "resume", "resumed")
    actions = {s.name: (s.action, s.result) for s in found.servers}
    assert actions["simple_agent"] == ("restore, resume", "resumed")
    assert actions["tools"] == ("resume", "resumed")
    events = await read_events(sqlite_url, restored.checkpoint_id)
    assert [e.data["outcome"] for e in events if e.kind == "attempt.completed"] == ["restored", "resumed"]
    sent = [
        (e.server, e.data["phase"]) for e in events if e.kind == "call.sent" and e.data["method"] == "POST"
    ]
    assert sent.count(("simple_agent", "restore")) == 3  # the first restore, the dead one's, recovery's
    await assert_protocol_ok(sqlite_url)


# -- ledgers written before the id rule --------------------------------------------------------


@pytest.mark.anyio
async def test_a_ledger_with_legacy_ids_keeps_working(
    cluster: Any, sqlite_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Attempts recorded under `e<epoch>-<seq>` ids (older versions) are shown, resumed and
    checked as before; new attempts on the same ledger get new ids, listed after them."""
    from quiesce.coordinator import attempt as attempt_module

    async def no_ledger_id(ledger: object) -> None:
        return None

    config = configure(cluster, sqlite_url)
    with monkeypatch.context() as patch:
        patch.setattr(attempt_module, "ledger_id", no_ledger_id)  # what older versions wrote
        async with Coordinator.open(config) as coord:
            old_save = await coord.checkpoint(deadline_s=30)
            old_restore = await coord.restore()
    assert re.match(r"^e1-\d{6}$", old_save.checkpoint_id)
    async with Coordinator.open(config) as coord:
        await coord.discover()
        status = await coord.status()
        assert [h.checkpoint_id for h in status.holders] == [old_restore.checkpoint_id]
        assert status.holders[0].kind == "restore"
        outcome = await coord.resume()
        assert (outcome.checkpoint_id, outcome.outcome) == (old_restore.checkpoint_id, "resumed")
        new = await coord.checkpoint(deadline_s=30)
        restored_again = await coord.restore(old_save.checkpoint_id, resume=True)
    assert new.checkpoint_id.startswith("q")
    async with Ledger.open(sqlite_url, readonly=True) as ledger:
        rows = await ledger.attempts()
    ids = [r.checkpoint_id for r in rows]
    assert ids == [
        old_save.checkpoint_id,
        old_restore.checkpoint_id,
        new.checkpoint_id,
        restored_again.checkpoint_id,
    ]
    assert sorted(ids) == ids
    code, text, _ = await anyio.to_thread.run_sync(
        lambda: _run(capsys, "show", old_restore.checkpoint_id, "--ledger", sqlite_url)
    )
    assert code == 0
    assert old_restore.checkpoint_id in text
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)
    await assert_protocol_ok(sqlite_url)
