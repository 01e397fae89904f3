"""Failures around resume: after publication (snapshot stays published, the same id's resume is
retried), a failed restore (servers stay paused until an explicit resume), and in-process abort."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, PhaseError, QuiesceError, read_latest
from quiesce.coordinator.protocol import ROLLOUT_ID_HEADER
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    clear_faults,
    read_events,
    server_states,
    set_faults,
)

pytestmark = pytest.mark.anyio


async def test_failed_resume_after_publication_is_retried(
    cluster: Any, ledger_url: str, configure: Any
) -> None:
    config = configure(cluster, ledger_url)
    async with httpx.AsyncClient() as http:
        await set_faults(
            http,
            cluster.urls["simple_agent"],
            [{"kind": "fail", "path": "/agent-checkpoint/resume", "status": 503, "code": "busy", "times": 1}],
        )
        async with Coordinator.open(config) as coord:
            with pytest.raises(PhaseError) as caught:
                await coord.checkpoint(deadline_s=20)
            error = caught.value
            assert (error.phase, error.server, error.code) == ("resume", "simple_agent", "busy")
            assert error.not_resumed == ["simple_agent"]
            assert error.resumed == ["tools", "policy_model"]
            published = config.snapshots / str(error.checkpoint_id)
            assert read_latest(config.snapshots) == published  # published whatever happens next
            assert error.latest_snapshot == str(published)
            assert (await server_states(http, cluster))["simple_agent"][0] == "committed_paused"
        # a later coordinator (another process) retries the same checkpoint id's resume — its
        # recovery on open may already have done it; either way the attempt ends published
        async with Coordinator.open(config) as coord:
            outcome = await coord.resume()
        if outcome.outcome != "none":
            assert (outcome.checkpoint_id, outcome.outcome) == (error.checkpoint_id, "published")
            assert outcome.servers == ("tools", "policy_model", "simple_agent")
        await assert_all_accepting(http, cluster)
    completed = [
        ev for ev in await read_events(ledger_url, error.checkpoint_id) if ev.kind == "attempt.completed"
    ]
    assert [ev.data["outcome"] for ev in completed] == ["published"]
    await assert_protocol_ok(ledger_url)


async def test_failed_restore_stays_paused_until_resume(
    cluster: Any, sqlite_url: str, configure: Any
) -> None:
    config = configure(cluster, sqlite_url)
    async with httpx.AsyncClient() as http:
        async with Coordinator.open(config) as coord:
            await coord.checkpoint(deadline_s=20)
            await set_faults(
                http,
                cluster.urls["simple_agent"],
                [
                    {
                        "kind": "fail",
                        "path": "/agent-checkpoint/restore",
                        "status": 500,
                        "code": "broken",
                        "times": 1,
                    }
                ],
            )
            with pytest.raises(PhaseError) as caught:
                await coord.restore()
            error = caught.value
            assert (error.phase, error.server, error.code) == ("restore", "simple_agent", "broken")
            assert error.not_resumed == ["policy_model", "simple_agent"]
            assert error.resumed == []
            states = await server_states(http, cluster)
            assert states["policy_model"] == ("restored_paused", "paused")  # half-restored state must not run
            assert states["tools"] == ("idle", "accepting")  # never contacted
        async with Coordinator.open(config) as coord:
            outcome = await coord.resume()
        assert (outcome.checkpoint_id, outcome.outcome) == (error.checkpoint_id, "resumed")
        assert outcome.servers == ("policy_model", "simple_agent")
        await assert_all_accepting(http, cluster)
    await assert_protocol_ok(sqlite_url)


async def test_step_wise_abort(cluster: Any, sqlite_url: str, configure: Any) -> None:
    config = configure(cluster, sqlite_url)
    async with httpx.AsyncClient() as http, Coordinator.open(config) as coord:
        attempt = await coord.prepare(deadline_s=20)
        with pytest.raises(Exception, match="resume or abort it first"):
            await coord.prepare()
        outcome = await coord.abort()
        assert (outcome.checkpoint_id, outcome.outcome) == (attempt.checkpoint_id, "aborted")
        assert outcome.servers == ("tools", "policy_model", "simple_agent")
        assert outcome.left_paused == ()
        await assert_all_accepting(http, cluster)
        again = await coord.prepare(deadline_s=20)  # a new attempt is allowed now
        await coord.commit(again)
        await coord.publish(again)
        await coord.resume(again)
        assert read_latest(config.snapshots) == again.snapshot
        rows = await coord.history()
        assert [r.outcome for r in rows] == ["aborted", "published"]
        # paged: the newest one, then the page before it; unknown anchors are refused
        assert await coord.history(limit=1) == rows[1:]
        assert await coord.history(limit=1, before=rows[1].checkpoint_id) == rows[:1]
        assert await coord.history(before=rows[0].checkpoint_id) == []
        assert await coord.history(outcome="published") == rows[1:]
        with pytest.raises(QuiesceError, match="no attempt 'q-none' in the ledger"):
            await coord.history(before="q-none")
    await assert_protocol_ok(sqlite_url)


async def test_caller_cancellation_rolls_back(cluster: Any, sqlite_url: str, configure: Any) -> None:
    config = configure(cluster, sqlite_url)
    model = cluster.urls["policy_model"]
    async with httpx.AsyncClient(timeout=None) as http, Coordinator.open(config) as coord:
        await set_faults(http, model, [{"kind": "hang", "path": "/v1/responses", "rollout_id": "stuck"}])

        def broken_progress(_: object) -> None:
            raise RuntimeError("a display bug must not disturb the attempt")

        coord.set_progress(broken_progress)
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: http.post(
                    f"{model}/v1/responses", json={"input": "x"}, headers={ROLLOUT_ID_HEADER: "stuck"}
                )
            )
            await anyio.sleep(0.2)
            with anyio.move_on_after(1.0) as scope:  # the trainer gives up long before the deadline
                await coord.checkpoint(deadline_s=30)
            assert scope.cancelled_caught
            await clear_faults(http, cluster)
        await assert_all_accepting(http, cluster)
        rows = await coord.history()
        assert [r.outcome for r in rows] == ["aborted"]
    events = await read_events(sqlite_url, rows[0].checkpoint_id)
    aborted = next(ev for ev in events if ev.kind == "attempt.aborted")
    assert "interrupted by" in aborted.data["reason"]
    assert aborted.data["resumed"] == ["tools", "policy_model", "simple_agent"]
    await assert_protocol_ok(sqlite_url)
