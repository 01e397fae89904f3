"""`quiesce status` / `Coordinator.status()`, the up-front refusal, and `resume | abort [ID]`,
against real reference servers and real ledgers.

Each held state is made for real (a plain restore, a coordinator that vanished mid-save, a dead
coordinator's rollback, another ledger's restore); the status must name the holder — id, kind,
since when — and the exact command it prints must free the servers when run.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, ServersHeld
from quiesce.ledger import Ledger
from quiesce.tools.cli.main import main as cli
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    control_logs,
    read_events,
    server_states,
)

pytestmark = pytest.mark.anyio

PARTICIPANTS = ("policy_model", "simple_agent", "tools")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    capsys.readouterr()
    code = cli(list(argv))
    captured = capsys.readouterr()
    out: Any = json.loads(captured.out) if "--json" in argv and captured.out.strip() else captured.out
    return code, out, captured.err


async def _in_thread(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    """The CLI (which runs its own event loop) from an async test: in a worker thread."""
    return await anyio.to_thread.run_sync(lambda: _cli(capsys, *argv))


async def _run_printed(capsys: pytest.CaptureFixture[str], command: str) -> tuple[int, Any, str]:
    """Run a command line exactly as `quiesce status` printed it (plus --json)."""
    argv = shlex.split(command)
    assert argv[0] == "quiesce"
    return await _in_thread(capsys, *argv[1:], "--json")


async def _epochs(url: str) -> int:
    async with Ledger.open(url, readonly=True) as ledger:
        return len([e async for e in ledger.read(kinds=["coordinator.started"])])


async def _posts(http: httpx.AsyncClient, cluster: Any) -> int:
    logs = await control_logs(http, cluster)
    return sum(1 for log in logs.values() for e in log if e["method"] == "POST")


@pytest.fixture
def config_file(cluster: Any, tmp_path: Path, token: str) -> Path:
    path: Path = cluster.write_config(
        tmp_path / "cluster.yaml", f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", "snaps"
    )
    return path


def _url(config_file: Path, name: str = "q.db") -> str:
    return f"sqlite+aiosqlite:///{config_file.parent / name}"


async def test_status_of_an_idle_cluster_takes_no_epoch_and_records_nothing(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any
) -> None:
    code, doc, _ = await _in_thread(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert code == 0
    async with Ledger.open(_url(config_file), readonly=True) as ledger:
        head = await ledger.head()
    code, doc, _ = await _in_thread(capsys, "status", "--config", str(config_file), "--json")
    assert code == 0
    assert (doc["idle"], doc["held"], doc["holders"]) == (True, False, [])
    assert [s["name"] for s in doc["servers"]] == list(cluster.urls)
    assert all(s["phase"] == "idle" and s["frees"] is None for s in doc["servers"])
    async with Ledger.open(_url(config_file), readonly=True) as ledger:
        assert await ledger.head() == head  # nothing appended, no epoch taken
    code, text, _ = await _in_thread(capsys, "status", "--config", str(config_file))
    assert code == 0
    assert "every server is idle" in text


async def test_status_names_a_plain_restore_and_the_command_it_prints_frees_it(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any
) -> None:
    assert (await _in_thread(capsys, "checkpoint", "--config", str(config_file), "--json"))[0] == 0
    code, doc, _ = await _in_thread(capsys, "restore", "--config", str(config_file), "--json")
    assert code == 0
    restore_id = doc["checkpoint_id"]
    code, doc, _ = await _in_thread(capsys, "status", "--config", str(config_file), "--json")
    assert code == 1
    events = await read_events(_url(config_file), restore_id)
    first_post = {
        e.server: e.at for e in reversed(events) if e.kind == "call.sent" and e.data["method"] == "POST"
    }
    held = {s["name"]: s for s in doc["servers"] if s["held"]}
    assert set(held) == set(PARTICIPANTS)
    command = f"quiesce resume --config {config_file} {restore_id}"
    for name, server in held.items():
        assert (server["phase"], server["held_by"], server["holder_kind"]) == (
            "restored_paused",
            restore_id,
            "restore",
        )
        assert server["since"] == first_post[name]
        assert server["frees"] == command
    [holder] = doc["holders"]
    assert holder["state"] == "restored, waiting for its resume"
    code, doc, _ = await _run_printed(capsys, command)
    assert (code, doc["outcome"]) == (0, "resumed")
    code, doc, _ = await _in_thread(capsys, "status", "--config", str(config_file), "--json")
    assert (code, doc["idle"]) == (0, True)
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)


async def test_status_does_not_disturb_a_checkpoint_in_progress(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any
) -> None:
    async with Coordinator.open(config_file) as coord:
        attempt = await coord.prepare(deadline_s=30)
        code, doc, err = await _in_thread(capsys, "status", "--config", str(config_file), "--json")
        assert code == 1, err
        held = {s["name"]: s for s in doc["servers"] if s["held"]}
        assert set(held) == set(PARTICIPANTS)
        assert {s["held_by"] for s in held.values()} == {attempt.checkpoint_id}
        assert held["policy_model"]["holder_kind"] == "save"
        assert held["policy_model"]["frees"] == (
            f"quiesce abort --config {config_file} {attempt.checkpoint_id}"
        )
        assert held["policy_model"]["deadline_left_s"] > 0
        # the coordinator at work was not fenced: it finishes its attempt
        await coord.commit(attempt)
        await coord.publish(attempt)
        await coord.resume(attempt)
        assert (await coord.status()).idle
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)
    await assert_protocol_ok(_url(config_file))


async def test_abort_and_resume_take_an_id(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any
) -> None:
    async with Coordinator.open(config_file) as coord:
        attempt = await coord.prepare(deadline_s=30)
        await coord.commit(attempt)  # the coordinator goes away with everything paused
    cid = attempt.checkpoint_id
    code, doc, err = await _in_thread(capsys, "abort", "--config", str(config_file), "not-an-id", "--json")
    assert code == 1
    said = err + (json.dumps(doc) if doc else "")  # the error: on stderr, or --json's document
    assert "not-an-id is not an attempt of this ledger" in " ".join(said.split())
    async with httpx.AsyncClient() as http:
        assert (await server_states(http, cluster))["policy_model"][0] == "committed_paused"
        code, doc, _ = await _in_thread(capsys, "abort", "--config", str(config_file), cid, "--json")
        assert code == 0
        assert doc == {
            "checkpoint_id": cid,
            "outcome": "aborted",
            "servers": ["tools", "policy_model", "simple_agent"],
        }
        await assert_all_accepting(http, cluster)
    code, doc, _ = await _in_thread(capsys, "resume", "--config", str(config_file), cid, "--json")
    assert (code, doc["outcome"]) == (0, "none")
    code, doc, _ = await _in_thread(capsys, "abort", "--config", str(config_file), "--json")
    assert (code, doc) == (0, {"checkpoint_id": None, "outcome": "none", "servers": []})
    await assert_protocol_ok(_url(config_file))


async def test_embedded_refusal_status_and_resume_by_id(
    cluster: Any, ledger_url: str, configure: Any
) -> None:
    config = configure(cluster, ledger_url)
    async with Coordinator.open(config) as coord:
        await coord.checkpoint(deadline_s=30)
        restored = await coord.restore()
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        await coord.discover()
        posts = await _posts(http, cluster)
        with pytest.raises(ServersHeld) as caught:
            await coord.prepare(deadline_s=30)
        assert await _posts(http, cluster) == posts  # refused before any request
        assert caught.value.held == dict.fromkeys(PARTICIPANTS, restored.checkpoint_id)
        message = str(caught.value)
        assert (
            f"held by checkpoint {restored.checkpoint_id} (restore: restored, waiting for its resume"
            in message
        )
        assert f"await coord.resume({restored.checkpoint_id!r})" in message
        with pytest.raises(ServersHeld):
            await coord.restore()
        status = await coord.status()
        assert [h.checkpoint_id for h in status.holders] == [restored.checkpoint_id]
        assert {s.name for s in status.servers if s.held} == set(PARTICIPANTS)
        outcome = await coord.resume(restored.checkpoint_id)
        assert (outcome.checkpoint_id, outcome.outcome) == (restored.checkpoint_id, "resumed")
        assert (await coord.status()).idle
        again = await coord.checkpoint(deadline_s=30)
        assert again.snapshot is not None
        await assert_all_accepting(http, cluster)
    await assert_protocol_ok(ledger_url)


async def test_another_ledgers_restore_is_named_and_resumed_from_a_new_ledger(
    capsys: pytest.CaptureFixture[str], cluster: Any, tmp_path: Path, token: str
) -> None:
    first = cluster.write_config(tmp_path / "a.yaml", f"sqlite+aiosqlite:///{tmp_path / 'a.db'}", "snaps")
    second = cluster.write_config(tmp_path / "b.yaml", f"sqlite+aiosqlite:///{tmp_path / 'b.db'}", "snaps")
    assert (await _in_thread(capsys, "checkpoint", "--config", str(first), "--json"))[0] == 0
    code, doc, _ = await _in_thread(capsys, "restore", "--config", str(first), "--json")
    foreign = doc["checkpoint_id"]
    # a fresh ledger, the same (held) servers
    code, doc, _ = await _in_thread(capsys, "status", "--config", str(second), "--json")
    assert code == 1
    [holder] = doc["holders"]
    assert (holder["checkpoint_id"], holder["kind"]) == (foreign, "unknown")
    assert holder["frees"] == f"quiesce resume --config {second} {foreign}"
    code, doc, err = await _in_thread(capsys, "checkpoint", "--config", str(second), "--json")
    assert (code, doc["outcome"]) == (1, "refused")
    assert f"held by checkpoint {foreign} (unknown: not an attempt of this ledger" in " ".join(err.split())
    code, doc, _ = await _in_thread(capsys, "resume", "--config", str(second), "--json")
    assert (code, doc["checkpoint_id"], doc["outcome"]) == (0, foreign, "resumed")
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)
    code, doc, _ = await _in_thread(capsys, "checkpoint", "--config", str(second), "--json")
    assert (code, doc["outcome"]) == (0, "published")
    await assert_protocol_ok(f"sqlite+aiosqlite:///{tmp_path / 'b.db'}")


async def test_a_restore_left_paused_shows_no_deadline_that_no_longer_applies(
    cluster: Any, ledger_url: str, configure: Any, tmp_path: Path
) -> None:
    """Once a restore ended, its servers stay paused until `resume`, whatever the time: the
    restore's deadline (still in their fences) is not shown as time left — neither while it is
    in the future nor once it has passed. Read through another ledger, where the restore may
    still be running, it is shown until it has passed. A save in progress shows its deadline."""
    config = configure(cluster, ledger_url)
    elsewhere = configure(cluster, f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    async with Coordinator.open(config) as coord, Coordinator.open(elsewhere, recover=False) as other:
        await coord.checkpoint(deadline_s=30)
        restored = await coord.restore(deadline_s=3)
        cid = restored.checkpoint_id

        def check(status: Any, *, left: bool) -> float:
            """The held servers' fence deadline; each shows time left only if `left`."""
            held = [s for s in status.servers if s.held]
            assert {s.name for s in held} == set(PARTICIPANTS)
            fences = set()
            for server in held:
                assert (server.phase, server.held_by) == ("restored_paused", cid)
                assert server.capabilities is not None
                fences.add(server.capabilities.deadline_ts)
                document = server.as_json()
                if left:
                    assert server.deadline_left_s is not None
                    assert server.deadline_left_s > 0
                    assert document["deadline_left_s"] == server.deadline_left_s
                else:
                    assert (server.deadline_left_s, document["deadline_left_s"]) == (None, None)
            [deadline] = fences  # every fence still reports the restore's deadline
            assert deadline is not None
            return float(deadline)

        mine = await coord.status()
        deadline = check(mine, left=False)
        assert deadline > time.time()  # in the future, yet it no longer applies
        [holder] = mine.holders
        assert (holder.kind, holder.state, holder.deadline_applies) == (
            "restore",
            "restored, waiting for its resume",
            False,
        )
        assert holder.frees.startswith("quiesce resume ")
        assert mine.as_json()["servers"][0]["frees"] == holder.frees
        check(await other.status(), left=True)  # another ledger's restore: it may still be running
        await anyio.sleep(max(0.0, deadline - time.time()) + 0.2)
        check(await coord.status(), left=False)
        check(await other.status(), left=False)  # passed, resting after a restore: paused until resume
        assert [h.frees for h in (await other.status()).holders] == [f"quiesce resume --config CONFIG {cid}"]

        await coord.resume(restored)
        attempt = await coord.prepare(deadline_s=30)
        during = await coord.status()
        model = during.server("policy_model")
        assert model is not None
        assert model.deadline_left_s is not None
        assert 0 < model.deadline_left_s <= 30  # a save in progress: its deadline still bounds it
        await coord.abort(attempt)
    async with httpx.AsyncClient() as http:
        await assert_all_accepting(http, cluster)
