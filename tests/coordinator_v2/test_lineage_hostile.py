"""Trainers that break the rollout lineage, against real v2 reference servers: one that runs two
attempts of a rollout at once, one whose scope still claims an attempt it retired. `check` names
each rollout with the events that show it; `--expect` names what the trainer's view gets wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, EpisodeId
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.cli.helpers import json_of, quiesce

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def test_two_attempts_of_one_rollout_running_at_once_are_named(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    tasks = make_tasks(2, turns=5)
    with v2_cluster() as running:
        first = Trainer(running.urls["environment"], http=http)
        second = Trainer(running.urls["environment"], http=http)  # a second worker, same task
        await first.start(tasks, paced=True)
        await second.start({"r0": tasks["r0"]}, paced=True, attempt=1)
        await first.advance(1)
        await second.advance(1)
        await first.wait_parked()
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            saved = await coord.checkpoint(deadline_s=20)
        await first.detach()
        await second.detach()
    assert saved.scope == ("r0", "r0-a1", "r1")  # derived from the environment's export
    report = await check_ledger(sqlite_url)
    assert [(v.rule, v.rollout_id, v.checkpoint_id) for v in report.violations] == [
        ("lineage-twice", "r0", saved.checkpoint_id)
    ]
    assert "attempts 0, 1 of rollout r0" in report.violations[0].message
    # the trainer's view, given as a file: it believes both attempts live
    ledger_file = sqlite_url.split("///", 1)[1]
    expect = tmp_path / "live.jsonl"
    expect.write_text(
        "".join(
            json.dumps(e) + "\n"
            for e in ({"rollout_id": "r0", "attempt": 0}, {"rollout_id": "r0", "attempt": 1})
        )
    )
    done = quiesce("check", "--ledger", ledger_file, "--expect", str(expect), "--json", cwd=tmp_path)
    assert done.returncode == 1
    found = json_of(done)["violations"]
    assert sorted((v["rule"], v["rollout_id"]) for v in found) == [
        ("lineage-expect", "r0"),  # attempt 0: the ledger has attempt 1 live
        ("lineage-expect", "r0"),  # two attempts held at once
        ("lineage-expect", "r1"),  # live in the ledger, not held by the trainer
        ("lineage-twice", "r0"),
    ]


async def test_a_scope_that_claims_a_retired_attempt_is_named(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
) -> None:
    tasks = make_tasks(2, turns=5)
    with v2_cluster() as running:
        trainer = Trainer(running.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(running, sqlite_url)) as coord:
            first = await coord.checkpoint(deadline_s=20)
            await coord.retire([EpisodeId(rollout_id="r1", attempt=0)], deadline_s=10)
            # the trainer still holds r1's attempt 0 live and names it in its next scope
            later = await coord.checkpoint(
                deadline_s=20,
                episodes=[EpisodeId(rollout_id="r0", attempt=0), EpisodeId(rollout_id="r1", attempt=0)],
            )
        await trainer.detach()
    assert first.scope == ("r0", "r1")
    report = await check_ledger(sqlite_url)
    named = sorted((v.rule, v.rollout_id, v.checkpoint_id) for v in report.violations)
    assert named == [
        ("lineage-inventory", "r1", later.checkpoint_id),  # no environment server exported it
        ("lineage-retired", "r1", later.checkpoint_id),
    ]
    retired = next(v for v in report.violations if v.rule == "lineage-retired")
    assert "retired up to attempt 0" in retired.message
