"""Rollback: every failure before publication resumes every touched server and keeps the old LATEST.

Each case first publishes a snapshot, then fails an attempt in one way (a lost reply in prepare,
a 500 in commit, a drain that cannot finish before the deadline, a tampered manifest at publish)
and checks: the error names phase, server, reason and who was resumed; every server is idle and
accepting; the previous snapshot is still LATEST; the staging folder is gone; the ledger records
the abort; rollouts still finish with no turn lost or run twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, DeadlineExceeded, PhaseError, read_latest
from quiesce.coordinator.protocol import AGENT_PREPARE_INCOMPLETE, ROLLOUT_ID_HEADER, agent_instance_dir
from quiesce.ledger import Ledger
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    clear_faults,
    control_log,
    read_events,
    set_faults,
)

pytestmark = pytest.mark.anyio


async def _start_rollouts(http: httpx.AsyncClient, cluster: Any) -> None:
    for name in ("policy_model", "tools"):
        await http.post(f"{cluster.urls[name]}/gymsim/admin/options", json={"latency_s": 0.01})
    # long enough to be mid-rollout when the checkpoint comes: a finished one is held until acknowledged
    await client.start_rollouts(http, cluster.urls["simple_agent"], {f"r{i}": 40 for i in range(3)})
    await client.wait_turns(http, cluster.urls["simple_agent"], 1)


async def _check_rolled_back(
    http: httpx.AsyncClient, cluster: Any, config: Any, error: PhaseError, previous: Path
) -> None:
    await assert_all_accepting(http, cluster)
    assert read_latest(config.snapshots) == previous
    assert error.latest_snapshot == str(previous)
    assert error.not_resumed == []
    assert error.checkpoint_id is not None
    assert not (config.staging_root / error.checkpoint_id).exists()
    async with Ledger.open(config.ledger, readonly=True) as ledger:
        row = await ledger.attempt(error.checkpoint_id)
    assert row is not None
    assert row.outcome == "aborted"
    events = await read_events(config.ledger, error.checkpoint_id)
    aborted = [ev for ev in events if ev.kind == "attempt.aborted"]
    assert len(aborted) == 1
    assert aborted[0].data["left_paused"] == []
    assert sorted(aborted[0].data["resumed"] + aborted[0].data["not_paused"]) == sorted(error.resumed)
    # rollback resumes were sent in resume order, after attempt.aborting
    aborting = next(ev.seq for ev in events if ev.kind == "attempt.aborting")
    rollback = [ev for ev in events if ev.kind == "call.sent" and ev.data["phase"] == "rollback"]
    assert all(ev.seq > aborting for ev in rollback)
    order = {"tools": 0, "policy_model": 1, "simple_agent": 2}
    assert [ev.server for ev in rollback] == sorted(
        (ev.server for ev in rollback), key=lambda s: order[str(s)]
    )
    rollouts = await client.wait_finished(http, cluster.urls["simple_agent"], timeout_s=60)
    assert client.turn_log_problems(rollouts) == []
    await assert_protocol_ok(config.ledger)


async def test_lost_reply_in_prepare(cluster: Any, ledger_url: str, configure: Any) -> None:
    config = configure(cluster, ledger_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        previous = (await coord.checkpoint(deadline_s=20)).snapshot
        assert previous is not None
        await _start_rollouts(http, cluster)
        await set_faults(
            http,
            cluster.urls["simple_agent"],
            [{"kind": "drop", "path": "/agent-checkpoint/prepare", "times": 1}],
        )
        with pytest.raises(PhaseError) as caught:
            await coord.checkpoint(deadline_s=20)
        error = caught.value
        assert not isinstance(error, DeadlineExceeded)
        assert (error.phase, error.server) == ("prepare", "simple_agent")
        assert "connect" in error.reason
        # the agent applied the prepare although its reply was lost: it was touched and resumed
        assert error.resumed == ["policy_model", "simple_agent"]
        assert "Latest snapshot" in str(error)
        await _check_rolled_back(http, cluster, config, error, previous)


async def test_500_in_commit(cluster: Any, ledger_url: str, configure: Any) -> None:
    config = configure(cluster, ledger_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        previous = (await coord.checkpoint(deadline_s=20)).snapshot
        assert previous is not None
        await _start_rollouts(http, cluster)
        await set_faults(
            http,
            cluster.urls["tools"],
            [
                {
                    "kind": "fail",
                    "path": "/resources-checkpoint/commit",
                    "status": 500,
                    "code": "disk_full",
                    "times": 1,
                }
            ],
        )
        with pytest.raises(PhaseError) as caught:
            await coord.checkpoint(deadline_s=20)
        error = caught.value
        assert (error.phase, error.server, error.code) == ("commit", "tools", "disk_full")
        assert error.resumed == ["tools", "policy_model", "simple_agent"]
        await _check_rolled_back(http, cluster, config, error, previous)
    failed = [ev for ev in await read_events(config.ledger, error.checkpoint_id) if ev.kind == "call.failed"]
    assert [(ev.server, ev.data["error"], ev.data["status"], ev.data["code"]) for ev in failed] == [
        ("tools", "http", 500, "disk_full")
    ]


async def test_drain_deadline_expires(cluster: Any, ledger_url: str, configure: Any) -> None:
    config = configure(cluster, ledger_url)
    model = cluster.urls["policy_model"]
    async with httpx.AsyncClient(timeout=None) as http, Coordinator.open(config) as coord:
        previous = (await coord.checkpoint(deadline_s=20)).snapshot
        assert previous is not None
        await _start_rollouts(http, cluster)
        # one data-plane request that never finishes: the drain cannot end
        await set_faults(http, model, [{"kind": "hang", "path": "/v1/responses", "rollout_id": "stuck"}])
        reports: list[int] = []
        coord.set_progress(lambda p: reports.append(p.inflight) if p.inflight is not None else None)
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: http.post(
                    f"{model}/v1/responses", json={"input": "x"}, headers={ROLLOUT_ID_HEADER: "stuck"}
                )
            )
            await anyio.sleep(0.2)
            with pytest.raises(DeadlineExceeded) as caught:
                await coord.checkpoint(deadline_s=2.0)
            await clear_faults(http, cluster)  # releases the hung request
        coord.set_progress(None)
        error = caught.value
        assert error.phase == "prepare"
        assert error.server == "policy_model"
        assert "in flight" in error.reason
        assert reports
        assert reports[-1] >= 1
        assert error.resumed == ["tools", "policy_model", "simple_agent"]
        await _check_rolled_back(http, cluster, config, error, previous)
    polls = [
        ev
        for ev in await read_events(config.ledger, error.checkpoint_id)
        if ev.kind == "call.replied" and "inflight_total" in (ev.data.get("body") or {})
    ]
    assert polls  # each drain poll's reply is in the ledger
    assert polls[-1].data["body"]["inflight_total"] >= 1


async def test_tampered_manifest_fails_publish(cluster: Any, ledger_url: str, configure: Any) -> None:
    config = configure(cluster, ledger_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        previous = (await coord.checkpoint(deadline_s=20)).snapshot
        assert previous is not None
        await _start_rollouts(http, cluster)
        with pytest.raises(PhaseError) as caught:  # noqa: PT012 - the failure is at the block's exit
            async with coord.save(deadline_s=20) as attempt:
                assert attempt.staging_dir is not None
                manifest = attempt.staging_dir / agent_instance_dir("simple_agent") / "manifest.json"
                manifest.write_bytes(manifest.read_bytes() + b" ")
        error = caught.value
        assert (error.phase, error.server) == ("publish", "simple_agent")
        assert "manifest_digest" in error.reason
        assert error.resumed == ["tools", "policy_model", "simple_agent"]
        await _check_rolled_back(http, cluster, config, error, previous)
        assert not (config.snapshots / attempt.checkpoint_id).exists()
    kinds = [ev.kind for ev in await read_events(config.ledger, error.checkpoint_id)]
    assert "attempt.publishing" not in kinds


async def test_exception_in_save_block_rolls_back(cluster: Any, sqlite_url: str, configure: Any) -> None:
    config = configure(cluster, sqlite_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        previous = (await coord.checkpoint(deadline_s=20)).snapshot
        assert previous is not None
        with pytest.raises(RuntimeError, match="trainer failed") as caught:
            async with coord.save(deadline_s=20):
                raise RuntimeError("trainer failed")
        assert any("rolled back" in note for note in getattr(caught.value, "__notes__", []))
        await assert_all_accepting(http, cluster)
        assert read_latest(config.snapshots) == previous
        rows = await coord.history()
        assert [r.outcome for r in rows] == ["published", "aborted"]


async def test_agent_prepare_incomplete_is_retried(cluster: Any, ledger_url: str, configure: Any) -> None:
    config = configure(cluster, ledger_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        await set_faults(
            http,
            cluster.urls["simple_agent"],
            [
                {
                    "kind": "fail",
                    "path": "/agent-checkpoint/prepare",
                    "status": 409,
                    "code": AGENT_PREPARE_INCOMPLETE,
                    "times": 3,
                }
            ],
        )
        attempt = await coord.checkpoint(deadline_s=20)
        assert attempt.snapshot is not None
        await assert_all_accepting(http, cluster)
    events = await read_events(config.ledger, attempt.checkpoint_id)
    prepares = [
        ev
        for ev in events
        if ev.kind == "call.sent" and ev.data["path"].endswith("/agent-checkpoint/prepare")
    ]
    assert len(prepares) == 4
    failed = [ev for ev in events if ev.kind == "call.failed"]
    assert [ev.data["code"] for ev in failed] == [AGENT_PREPARE_INCOMPLETE] * 3


async def test_a_commit_whose_files_do_not_match_its_digest_is_rolled_back(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """A valid commit reply whose `manifest_digest` is not the sha256 of the manifest it wrote:
    the coordinator checks the agents' files before the model's commit is called, and the
    resources' after theirs; either way the attempt rolls back naming the server, nothing is
    published, and every server accepts again."""
    config = configure(cluster, sqlite_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        for server, path in (
            ("simple_agent", "/agent-checkpoint/commit"),
            ("tools", "/resources-checkpoint/commit"),
        ):
            await set_faults(http, cluster.urls[server], [{"kind": "wrong_digest", "path": path, "times": 1}])
            with pytest.raises(PhaseError) as caught:
                await coord.checkpoint(deadline_s=20)
            assert (caught.value.phase, caught.value.server) == ("commit", server)
            assert "manifest_digest e3b0c44298fc" in caught.value.reason
            assert "does not match the sha256" in caught.value.reason
            await assert_all_accepting(http, cluster)
        commits = [
            e for e in await control_log(http, cluster.urls["policy_model"]) if e["path"].endswith("/commit")
        ]
        assert len(commits) == 1, "the model commit runs only once the agents' files were verified"
        assert coord.latest_snapshot is None
        assert (await coord.checkpoint(deadline_s=20)).snapshot is not None
    failed = [ev for ev in await read_events(config.ledger) if ev.kind == "phase.failed"]
    assert [(ev.data["phase"], ev.server) for ev in failed] == [
        ("commit", "simple_agent"),
        ("commit", "tools"),
    ]


async def test_protocol_failures_are_recorded(cluster: Any, sqlite_url: str, configure: Any) -> None:
    config = configure(cluster, sqlite_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        await set_faults(
            http,
            cluster.urls["tools"],
            [{"kind": "wrong_schema", "path": "/resources-checkpoint/prepare", "times": 1}],
        )
        with pytest.raises(PhaseError) as caught:
            await coord.checkpoint(deadline_s=20)
        assert (caught.value.phase, caught.value.server) == ("prepare", "tools")
        await set_faults(
            http,
            cluster.urls["simple_agent"],
            [{"kind": "malformed", "path": "/agent-checkpoint/commit", "times": 1}],
        )
        with pytest.raises(PhaseError) as caught2:
            await coord.checkpoint(deadline_s=20)
        assert (caught2.value.phase, caught2.value.server) == ("commit", "simple_agent")
        await assert_all_accepting(http, cluster)
    failed = [ev for ev in await read_events(config.ledger) if ev.kind == "call.failed"]
    assert [(ev.server, ev.data["error"]) for ev in failed] == [
        ("tools", "protocol"),
        ("simple_agent", "protocol"),
    ]
    assert "does not match" in failed[0].data["detail"]
    assert "not valid JSON" in failed[1].data["detail"]


async def _checkpoint_with_a_slow_agent_commit(
    http: httpx.AsyncClient, cluster: Any, coord: Coordinator, *, seconds: float, deadline_s: float
) -> DeadlineExceeded:
    """A checkpoint, rollouts running, whose agent commit takes `seconds` inside its fence (once):
    past `deadline_s`, so the checkpoint fails; its error."""
    await _start_rollouts(http, cluster)
    fault = {"kind": "delay", "when": "during", "path": "/agent-checkpoint/commit", "seconds": seconds}
    await set_faults(http, cluster.urls["simple_agent"], [{**fault, "times": 1}])
    with pytest.raises(DeadlineExceeded) as caught:
        await coord.checkpoint(deadline_s=deadline_s)
    return caught.value


async def test_a_commit_still_running_when_its_call_timed_out_is_waited_for_then_resumed(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """The agent's commit outlasts the attempt's deadline: the coordinator's call times out while
    the server still commits. A resume sent then is refused (409 invalid_phase) and the commit,
    once done, would leave the agent paused for good; the rollback reads its fence first, waits
    for the commit to end, then resumes it."""
    config = configure(cluster, sqlite_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        previous = (await coord.checkpoint(deadline_s=20)).snapshot
        assert previous is not None
        error = await _checkpoint_with_a_slow_agent_commit(http, cluster, coord, seconds=4.0, deadline_s=2.5)
        assert (error.phase, error.server) == ("commit", "simple_agent")
        assert "simple_agent" in error.resumed
        await _check_rolled_back(http, cluster, config, error, previous)
    events = await read_events(config.ledger, error.checkpoint_id)
    agent_rollback = [
        (ev.kind, ev.data.get("path"))
        for ev in events
        if ev.server == "simple_agent" and ev.kind == "call.sent" and ev.data["phase"] == "rollback"
    ]
    # its fence was read (until the commit ended) before the one resume it needed
    assert agent_rollback[-1] == ("call.sent", "/ng-control/v1/agent-checkpoint/resume")
    assert len(agent_rollback) >= 2
    assert all(path == "/ng-control/v1/capabilities" for _, path in agent_rollback[:-1])


async def test_a_commit_that_outlasts_the_rollback_budget_is_left_paused_saying_so(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    """The commit still runs when the rollback's budget ends: the agent is not counted as never
    paused — it is named left paused, with why; once its commit ended, `resume ID` frees it."""
    config = configure(cluster, sqlite_url, control_timeout_s=1.0)
    agent = cluster.urls["simple_agent"]
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        await coord.checkpoint(deadline_s=20)
        error = await _checkpoint_with_a_slow_agent_commit(http, cluster, coord, seconds=6.0, deadline_s=2.0)
        assert error.not_resumed == ["simple_agent"]
        assert "simple_agent" not in error.resumed
        assert "committing of this checkpoint was still running" in str(error)
        events = await read_events(config.ledger, error.checkpoint_id)
        aborted = next(ev for ev in events if ev.kind == "attempt.aborted")
        assert (aborted.data["left_paused"], "simple_agent" in aborted.data["not_paused"]) == (
            ["simple_agent"],
            False,
        )
        caps = (await http.get(f"{agent}/ng-control/v1/capabilities")).json()
        assert (caps["phase"], caps["active_checkpoint_id"]) == ("committing", error.checkpoint_id)
        with anyio.fail_after(20):
            while await _agent_phase(http, agent) != "committed_paused":  # noqa: ASYNC110 (another process)
                await anyio.sleep(0.1)
        outcome = await coord.resume(error.checkpoint_id)
        assert "simple_agent" in outcome.resumed
        await assert_all_accepting(http, cluster)
        rollouts = await client.wait_finished(http, cluster.urls["simple_agent"], timeout_s=60)
    assert client.turn_log_problems(rollouts) == []
    await assert_protocol_ok(config.ledger)


async def _agent_phase(http: httpx.AsyncClient, agent: str) -> str:
    return str((await http.get(f"{agent}/ng-control/v1/capabilities")).json()["phase"])
