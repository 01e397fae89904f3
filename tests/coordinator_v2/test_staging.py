"""The staging folder is made beside the prepare phase (`coordinator/staging.py`), on both planes,
against real reference servers and a real SQLite ledger: it is there, durable and with every
server's folder, when the prepare returns — before any commit request; a rollback removes it; a
save in place makes nothing before its commit; a folder that cannot be made still fails the
commit phase, not the prepare.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, PhaseError
from quiesce.coordinator.attempt import next_checkpoint_id
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.coordinator.helpers import assert_staging_made
from tests.coordinator_v2.helpers import events, phases, sent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def _parked(http: httpx.AsyncClient, url: str) -> Trainer:
    trainer = Trainer(url, http=http)
    await trainer.start(make_tasks(3, turns=4), paced=True)
    await trainer.advance(2)
    await trainer.wait_parked()
    return trainer


async def test_the_staging_folder_is_there_when_the_prepare_returns_and_a_rollback_removes_it(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    token: str,
) -> None:
    with v2_cluster() as running:
        trainer = await _parked(http, running.urls["environment"])
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            attempt = await coord.prepare(deadline_s=20)
            staging = assert_staging_made(attempt)
            assert await sent(sqlite_url, "commit") == []  # made before any commit request
            assert set((await phases(http, running.urls, token)).values()) == {"prepared"}
            await coord.abort(attempt)
        assert not staging.exists()
        assert set((await phases(http, running.urls, token)).values()) == {"idle"}
        await trainer.detach()


async def test_a_save_in_place_makes_nothing_before_its_commit(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    into = tmp_path / "rl" / "step_3"
    into.mkdir(parents=True)
    (into / "trainer_state.pt").write_bytes(b"weights")
    with v2_cluster() as running:
        trainer = await _parked(http, running.urls["environment"])
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            attempt = await coord.prepare(deadline_s=20, into=into)
            assert attempt.staging_identity is None
            assert sorted(p.name for p in into.iterdir()) == ["trainer_state.pt"]
            assert not (tmp_path / "snapshots" / ".staging" / attempt.checkpoint_id).exists()
            await coord.abort(attempt)
        assert sorted(p.name for p in into.iterdir()) == ["trainer_state.pt"]
        await trainer.detach()


async def test_a_staging_path_that_cannot_be_used_fails_the_commit_not_the_prepare(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    token: str,
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with v2_cluster() as running:
        trainer = await _parked(http, running.urls["environment"])
        config = config_of(running, sqlite_url)
        async with Coordinator.open(config) as coord:
            await coord.discover()
            upcoming = await next_checkpoint_id(coord._ctx.ledger)
            config.staging_root.mkdir(parents=True)
            (config.staging_root / upcoming).symlink_to(outside, target_is_directory=True)
            attempt = await coord.prepare(deadline_s=20)
            assert attempt.checkpoint_id == upcoming
            assert attempt.state == "prepared"
            with pytest.raises(PhaseError, match="a symlink, not a folder quiesce made") as caught:
                await coord.commit(attempt)
            assert caught.value.phase == "commit"
        assert await sent(sqlite_url, "commit") == []  # no server was asked to write through it
        assert list(outside.iterdir()) == []
        assert set((await phases(http, running.urls, token)).values()) == {"idle"}
        failed = await events(sqlite_url, "phase.failed")
        assert [ev.data["phase"] for ev in failed] == ["commit"]
        await trainer.detach()
