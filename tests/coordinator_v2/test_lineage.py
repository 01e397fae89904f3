"""The rollout lineage against real v2 reference servers: a save, a restore into a fresh cluster,
and a trainer that continues all but one restored attempt and forgets one it finished — `check` is
clean (every rollout accounted for) until a save shows
the dropped one lost, then names it (API and CLI, `--expect` too), and `quiesce rollouts` tells
its lineage."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, EpisodeId
from quiesce.ledger import Ledger
from quiesce.ledger.lineage import read_lineage
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.cli.helpers import json_of, quiesce

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def test_a_dropped_restored_attempt_is_lost_and_named(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    sqlite_url: str,
    http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    tasks = make_tasks(4, turns=5)
    with v2_cluster() as first:
        trainer = Trainer(first.urls["environment"], http=http)
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(first, sqlite_url)) as coord:
            saved = await coord.checkpoint(deadline_s=20)
        await trainer.detach()
    assert saved.scope == ("r0", "r1", "r2", "r3")
    assert saved.snapshot is not None

    with v2_cluster() as second:
        async with Coordinator.open(config_of(second, sqlite_url)) as coord:
            restored = await coord.restore(saved.snapshot, resume=True)
            assert restored.state == "completed"
            # the trainer continues r0..r2 and never sends r3's /run
            await trainer.continue_on(second.urls["environment"], ["r0", "r1", "r2"], paced=True)
            # r0 runs to its end; the trainer holds its result and forgets it
            await trainer.unpace(["r0"])
            await trainer.wait_done(["r0"])
            await coord.forget(["r0"], deadline_s=10)
            await trainer.wait_parked()
            # restored, not saved since: every attempt is owed a save, none is lost yet
            clean = await check_ledger(sqlite_url)
            assert clean.violations == [], clean.violations
            assert clean.rollouts == {"live": 3, "restarted": 0, "retired": 0, "finished": 1, "lost": 0}
            kept = [EpisodeId(rollout_id=f"r{i}", attempt=1) for i in (1, 2)]
            later = await coord.checkpoint(deadline_s=20, episodes=kept)
        await trainer.detach()

    report = await check_ledger(sqlite_url)
    assert [(v.rule, v.rollout_id, v.checkpoint_id) for v in report.violations] == [
        ("lineage-lost", "r3", later.checkpoint_id)
    ]
    assert restored.checkpoint_id in report.violations[0].message
    assert report.rollouts == {"live": 2, "restarted": 0, "retired": 0, "finished": 1, "lost": 1}
    async with Ledger.open(sqlite_url, readonly=True) as ledger:
        lineage = await read_lineage(ledger)
    r3 = lineage.rollouts["r3"]
    assert [(s.what, s.attempt, s.checkpoint_id) for s in r3.steps] == [
        ("captured", 0, saved.checkpoint_id),
        ("continued", 1, restored.checkpoint_id),
        ("lost", 1, later.checkpoint_id),
    ]
    assert {r: (x.state, x.attempt) for r, x in lineage.rollouts.items() if r != "r3"} == {
        "r0": ("finished", 1),
        "r1": ("live", 1),
        "r2": ("live", 1),
    }
    assert [s.what for s in lineage.rollouts["r0"].steps] == ["captured", "continued", "forgotten"]

    # the same through the CLI, as a real process
    ledger_file = sqlite_url.split("///", 1)[1]
    shown = json_of(quiesce("rollouts", "--ledger", ledger_file, "--rollout", "r3", "--json", cwd=tmp_path))
    assert [(r["rollout_id"], r["state"]) for r in shown["rollouts"]] == [("r3", "lost")]
    assert [s["what"] for s in shown["rollouts"][0]["steps"]] == ["captured", "continued", "lost"]
    assert [v["rule"] for v in shown["violations"]] == ["lost"]
    done = quiesce("check", "--ledger", ledger_file, "-o", "jsonl", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [(x["rule"], x.get("rollout_id")) for x in lines if x["severity"] == "violation"] == [
        ("lineage-lost", "r3")
    ]
    # the trainer's own view: it believes r3's restored attempt is live too
    expect = tmp_path / "live.jsonl"
    expect.write_text("".join(json.dumps({"rollout_id": f"r{i}", "attempt": 1}) + "\n" for i in (1, 2, 3)))
    done = quiesce("check", "--ledger", ledger_file, "--expect", str(expect), "--json", cwd=tmp_path)
    assert done.returncode == 1
    found = json_of(done)
    assert sorted((v["rule"], v["rollout_id"]) for v in found["violations"]) == [
        ("lineage-expect", "r3"),
        ("lineage-lost", "r3"),
    ]
    unknown = quiesce("rollouts", "--ledger", ledger_file, "--rollout", "nope", cwd=tmp_path)
    assert unknown.returncode == 1
    assert "never recorded rollout nope" in unknown.stderr
    assert "Traceback" not in unknown.stderr
