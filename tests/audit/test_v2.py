"""The audit tools on Gym's unified plane (v2).

A ledger written by the real coordinator against the v2 reference servers — a save whose caller's
block outlasts a renewal, a retire and a forget outside any attempt, a stop-checkpoint, a restore
the resources server refuses (cleaned up: retired, everyone resumed) and a restore then resume —
checks clean; `show`, `history`, the report and `replay --rebuild` cover it. Hand-made ledgers
(`handmade_v2.V2Script`) that break one v2 rule each are flagged with that rule, at the right
seq and server.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import ClusterConfig, Coordinator, PhaseError
from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.ledger import Event, Ledger
from quiesce.ledger.replay import replay_url
from quiesce.tools.audit.attempts import build_attempt
from quiesce.tools.audit.check import CheckReport, check_events
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.audit.report import render_report
from quiesce.tools.audit.source import attempt_events, load_views, open_readonly, read_operations
from quiesce.tools.cli.main import main
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.audit.handmade_v2 import (
    AGENT,
    ENV,
    MODEL,
    RES,
    RESUME_ORDER,
    V2_PARTICIPANTS,
    V2Script,
)
from tests.coordinator_v2.conftest import config_of, http, v2_cluster

__all__ = ["config_of", "http", "v2_cluster"]

pytestmark = pytest.mark.anyio


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'v2.db'}"


async def _events(url: str) -> list[Event]:
    async with open_readonly(url) as ledger:
        return [e async for e in ledger.read()]


async def _check(url: str) -> CheckReport:
    return check_events(await _events(url))


async def _main(argv: list[str]) -> int:
    """The CLI, in a worker thread (it runs its own event loop)."""
    return await anyio.to_thread.run_sync(main, argv)


# ---------------------------------------------------------------------------------------------
# A real ledger
# ---------------------------------------------------------------------------------------------


async def _real_ledger(
    v2_cluster: Callable[..., Any], config_of: Callable[..., ClusterConfig], url: str, http: httpx.AsyncClient
) -> dict[str, str]:
    ids: dict[str, str] = {}
    with v2_cluster() as first:
        trainer = Trainer(first.urls["environment"], http=http)
        await trainer.start(make_tasks(4, turns=6), paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        async with Coordinator.open(config_of(first, url)) as coord:
            async with coord.save(deadline_s=1.5) as saved:
                await anyio.sleep(1.2)  # renewals every 0.5 s keep the servers paused
            ids["save"] = saved.checkpoint_id
            await coord.retire([EpisodeId(rollout_id="r3")])
            await coord.forget(["r3"])
            stop = await coord.checkpoint(deadline_s=20, stop=True)
            ids["stop"] = stop.checkpoint_id
        await trainer.detach()
    assert stop.snapshot is not None
    with v2_cluster() as second:  # not fresh: it runs an episode, so its servers refuse a restore
        other = Trainer(second.urls["environment"], http=http)
        await other.start(make_tasks(1, turns=6, prefix="x"), paced=True)
        async with Coordinator.open(config_of(second, url)) as coord:
            with pytest.raises(PhaseError) as failed:
                await coord.restore(stop.snapshot)
        await other.detach()
    assert failed.value.checkpoint_id is not None
    ids["failed_restore"] = failed.value.checkpoint_id
    with v2_cluster() as third:
        async with Coordinator.open(config_of(third, url)) as coord:
            ids["restore"] = (await coord.restore(stop.snapshot, resume=True)).checkpoint_id
    return ids


@pytest.mark.timeout(180)
async def test_a_real_v2_ledger_checks_clean_and_shows_its_episodes(
    v2_cluster: Callable[..., Any],
    config_of: Callable[..., ClusterConfig],
    url: str,
    http: httpx.AsyncClient,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ids = await _real_ledger(v2_cluster, config_of, url, http)

    report = await check_ledger(url)
    assert report.violations == []
    assert report.warnings == []
    assert report.chain.ok is True
    assert report.attempts == {cid: "judged" for cid in ids.values()}
    assert await _main(["check", "--ledger", url]) == 0
    for cid in ids.values():  # each attempt alone (with its discovery) checks clean too
        assert await _main(["check", "--ledger", url, cid]) == 0
    capsys.readouterr()

    views = {v.checkpoint_id: v for v in await load_views(url, None, 100)}
    saved = views[ids["save"]]
    assert saved.plane == "v2"
    assert saved.v2 is not None
    assert saved.v2.kinds == {ENV: "environment", MODEL: "model", AGENT: "agent", RES: "resources"}
    assert saved.v2.scope == ("r0", "r1", "r2", "r3")
    assert saved.v2.scope_source == "derived"
    assert {n: len(k) for n, k in saved.v2.exported.items()} == dict.fromkeys(V2_PARTICIPANTS, 4)
    assert saved.v2.renewals >= len(V2_PARTICIPANTS)
    assert saved.v2.last_lease is not None
    stop = views[ids["stop"]]
    assert stop.v2 is not None
    assert stop.v2.stop
    assert stop.outcome == "published"
    assert stop.v2.scope == ("r0", "r1", "r2")  # r3 was retired
    failed = views[ids["failed_restore"]]
    assert failed.outcome == "aborted"
    assert failed.v2 is not None
    assert [(o.operation, o.items, o.reason) for o in failed.v2.operations] == [
        ("retire", ("r0-a1", "r1-a1", "r2-a1"), "clean up a failed restore")
    ]
    restored = views[ids["restore"]]
    assert restored.outcome == "resumed"
    assert restored.v2 is not None
    assert restored.v2.restored_from == ids["stop"]
    assert restored.v2.restored[ENV] == ("r0-a1", "r1-a1", "r2-a1")

    assert await _main(["show", "--ledger", url, ids["save"]]) == 0
    out = capsys.readouterr().out
    assert "plane: v2 (Gym's unified checkpoint plane)" in out
    assert "scope: 4 episodes (derived)" in out
    assert "exported: environment 4, policy_model 4, agent 4, resources 4" in out
    assert f"renewals: {saved.v2.renewals}, last lease until" in out
    assert await _main(["show", "--ledger", url, ids["restore"]]) == 0
    out = capsys.readouterr().out
    assert f"restored 3 episodes from {ids['stop']}" in out
    assert await _main(["show", "--ledger", url, "--json", ids["save"]]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["plane"] == "v2"
    assert shown["v2"]["scope_size"] == 4
    assert shown["v2"]["exported_counts"][ENV] == 4

    operations = await read_operations(url)
    assert [(o.operation, o.items, o.checkpoint_id) for o in operations] == [
        ("retire", ("r3",), None),
        ("forget", ("r3",), None),
    ]
    assert await _main(["history", "--ledger", url]) == 0
    out = capsys.readouterr().out
    assert "operations" in out
    assert "1 episode: r3" in out
    assert "1 rollout: r3" in out

    page = render_report(list(views.values()), source=url)
    assert page.count('<ul class="v2">') == len(ids)
    assert "scope: 4 episodes (derived)" in page

    # replay rebuilds the same projection from a ledger holding every v2 event kind
    db = tmp_path / "v2.db"
    with sqlite3.connect(db) as connection:
        before = connection.execute("SELECT * FROM attempts ORDER BY checkpoint_id").fetchall()
        connection.execute("DELETE FROM attempts")
    rebuilt = await replay_url(url, rebuild=True)
    assert rebuilt.chain_ok
    assert rebuilt.rebuilt
    assert {d.checkpoint_id for d in rebuilt.differences} == set(ids.values())  # each row was missing
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT * FROM attempts ORDER BY checkpoint_id").fetchall() == before
    assert (await replay_url(url)).ok


# ---------------------------------------------------------------------------------------------
# Hand-made ledgers: one broken rule each
# ---------------------------------------------------------------------------------------------

Scenario = Callable[[V2Script], Awaitable[None]]


async def _good(s: V2Script) -> None:
    await s.good_save("sv")
    await s.retire(None, "op-1", ["r5"])
    await s.good_restore("rs", "sv")
    await s.failed_restore("rf", "sv")


async def test_hand_made_v2_attempts_check_clean(url: str) -> None:
    async with Ledger.open(url) as ledger:
        s = V2Script(ledger)
        await s.start()
        await _good(s)
    report = await _check(url)
    assert report.violations == []
    assert report.warnings == []
    assert report.attempts == {"sv": "judged", "rs": "judged", "rf": "judged"}


async def _stage_order(s: V2Script) -> None:
    await s.attempt("ck")
    await s.phase("ck", "prepare")
    await s.prepare_one("ck", ENV)
    await s.prepare_one("ck", MODEL, phase="preparing")  # not prepared yet...
    await s.prepare_one("ck", AGENT)  # ...and the next stage is asked: BAD


async def _same_id(s: V2Script) -> None:
    await s.attempt("ck")
    await s.phase("ck", "prepare")
    await s.prepare_one("ck", ENV, phase="preparing")
    await s.prepare_one("ck", ENV, sent_id="other")  # asked again under another id: BAD


async def _commit_before_prepared(s: V2Script) -> None:
    await s.attempt("ck")
    await s.phase("ck", "prepare")
    for server in (ENV, MODEL, AGENT):
        await s.prepare_one("ck", server)
    await s.prepare_one("ck", RES, phase="preparing")
    await s.phase("ck", "commit")
    await s.commit_one("ck", ENV, None, ["r0"])  # resources never answered prepared: BAD


async def _commit_other_folder(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.phase("ck", "commit")
    await s.event("episodes.scoped", "ck", scope=["r0"], source="given", restarts={})
    await s.commit_one("ck", ENV, ["r0"], ["r0"])
    await s.commit_one("ck", MODEL, ["r0"], ["r0"], folder="/elsewhere")  # BAD


async def _commit_no_scope_to_model(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.phase("ck", "commit")
    await s.commit_one("ck", ENV, None, ["r0"])
    await s.event("episodes.scoped", "ck", scope=["r0"], source="derived", restarts={})
    await s.commit_one("ck", MODEL, None, ["r0"])  # BAD: only the environment may get none


async def _scope_holds_a_restart(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck", restarts={AGENT: ["r1"]})
    await s.phase("ck", "commit")
    await s.event("episodes.scoped", "ck", scope=["r0", "r1"], source="given", restarts={})  # BAD


async def _commit_outside_scope(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.phase("ck", "commit")
    await s.event("episodes.scoped", "ck", scope=["r0"], source="given", restarts={})
    await s.commit_one("ck", ENV, ["r0", "r9"], ["r0"])  # BAD: r9 is not in the scope


async def _renew_after_resume(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.commit("ck", ["r0"])
    await s.publish("ck")
    await s.resume("ck")
    await s.renew("ck", [AGENT])  # BAD
    await s.completed("ck")


async def _resume_out_of_order(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.commit("ck", ["r0"])
    await s.publish("ck")
    await s.resume("ck", order=(RES, ENV, MODEL, AGENT))  # the environment before the agent: BAD
    await s.completed("ck")


async def _published_before_committed(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.phase("ck", "commit")
    await s.event("episodes.scoped", "ck", scope=["r0"], source="given", restarts={})
    for server in (ENV, MODEL, AGENT):
        await s.commit_one("ck", server, ["r0"], ["r0"])
    call_id = await s.send("ck", RES, "commit", "commit", s.commit_body("ck", ["r0"]))
    await s.fail("ck", RES, call_id)
    await s.publish("ck")  # BAD: resources never committed
    await s.resume("ck")
    await s.completed("ck")


async def _stop_resumed(s: V2Script) -> None:
    await s.attempt("ck", stop=True)
    await s.prepare("ck")
    await s.commit("ck", ["r0"], stop=True)
    await s.publish("ck")
    await s.resume("ck")  # BAD: a stop-checkpoint resumes nobody
    await s.completed("ck", servers=[])


async def _restore_other_inventory(s: V2Script) -> None:
    await s.good_save("sv")
    await s.attempt("rs", kind="restore", source="sv")
    await s.phase("rs", "restore")
    for server in (ENV, MODEL, AGENT):
        await s.restore_one("rs", server, "sv", ["r0", "r1"])
    await s.restore_one("rs", RES, "sv", ["r0"])  # BAD


async def _restore_under_the_snapshots_id(s: V2Script) -> None:
    await s.good_save("sv")
    await s.good_restore("sv2", "sv2")  # BAD: the restore's id is its snapshot's


async def _failed_restore_not_retired_everywhere(s: V2Script) -> None:
    await s.good_save("sv")
    await s.failed_restore("rf", "sv", retire_on=(ENV, AGENT, MODEL))  # BAD: resources not retired


async def _failed_restore_not_resumed_everywhere(s: V2Script) -> None:
    await s.good_save("sv")
    await s.failed_restore("rf", "sv", resume_on=(RES, AGENT, MODEL))  # BAD: environment not resumed


async def _retire_out_of_order(s: V2Script) -> None:
    await s.retire(None, "op", ["r1"], order=(ENV, MODEL, AGENT, RES))  # the model before the agent: BAD


async def _retire_during_save(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.retire(None, "op", ["r1"])  # BAD: ck is open
    await s.resume("ck", "rollback")
    await s.event("attempt.aborted", "ck", reason="x", resumed=list(RESUME_ORDER))


async def _prepared_never_resumed(s: V2Script) -> None:
    await s.attempt("ck")
    await s.prepare("ck")
    await s.resume("ck", "rollback", order=(RES, AGENT, MODEL))  # BAD: the environment stays paused
    await s.event("attempt.aborted", "ck", reason="x", resumed=[RES, AGENT, MODEL])


#: scenario, the (rule, server) of its first violation, and the event that shows it:
#: (kind, server, nth such event) — or "terminal" for the attempt's last event.
CASES: dict[str, tuple[Scenario, str, str | None, tuple[str, str | None, int] | str]] = {
    "stage_order": (_stage_order, "stage_order", AGENT, ("call.sent", AGENT, 0)),
    "same_id": (_same_id, "same_id", ENV, ("call.sent", ENV, 1)),
    "commit_before_prepared": (_commit_before_prepared, "commit", ENV, ("call.sent", ENV, 1)),
    "commit_other_folder": (_commit_other_folder, "commit", MODEL, ("call.sent", MODEL, 1)),
    "commit_no_scope_to_model": (_commit_no_scope_to_model, "commit", MODEL, ("call.sent", MODEL, 1)),
    "scope_holds_a_restart": (_scope_holds_a_restart, "scope", AGENT, ("episodes.scoped", None, 0)),
    "commit_outside_scope": (_commit_outside_scope, "scope", ENV, ("call.sent", ENV, 1)),
    "renew_after_resume": (_renew_after_resume, "renew", AGENT, ("call.sent", AGENT, 3)),
    "resume_out_of_order": (_resume_out_of_order, "stage_order", MODEL, ("call.sent", MODEL, 2)),
    "published_before_committed": (
        _published_before_committed,
        "publish",
        RES,
        ("attempt.publishing", None, 0),
    ),
    "stop_resumed": (_stop_resumed, "stop", RES, ("call.sent", RES, 2)),
    "restore_other_inventory": (_restore_other_inventory, "restore", RES, ("call.sent", RES, 4)),
    "restore_under_the_snapshots_id": (
        _restore_under_the_snapshots_id,
        "restore",
        None,
        ("attempt.started", None, 1),
    ),
    "failed_restore_not_retired": (_failed_restore_not_retired_everywhere, "all_or_nothing", RES, "terminal"),
    "failed_restore_not_resumed": (_failed_restore_not_resumed_everywhere, "all_or_nothing", ENV, "terminal"),
    "retire_out_of_order": (_retire_out_of_order, "retire_order", AGENT, ("call.sent", AGENT, 0)),
    "retire_during_save": (_retire_during_save, "retire_during_save", ENV, ("call.sent", ENV, 1)),
    "prepared_never_resumed": (_prepared_never_resumed, "unsettled", ENV, "terminal"),
}


def _seq(events: list[Event], where: tuple[str, str | None, int] | str) -> int:
    if where == "terminal":
        return max(e.seq for e in events if e.kind in ("attempt.aborted", "attempt.completed"))
    assert isinstance(where, tuple)
    kind, server, nth = where
    return [e.seq for e in events if e.kind == kind and (server is None or e.server == server)][nth]


@pytest.mark.parametrize("case", list(CASES))
async def test_each_broken_v2_rule_is_flagged(url: str, case: str) -> None:
    scenario, rule, server, where = CASES[case]
    async with Ledger.open(url) as ledger:
        s = V2Script(ledger)
        await s.start()
        await scenario(s)
    events = await _events(url)
    report = check_events(events)
    assert report.violations, f"{case}: nothing flagged"
    first = report.violations[0]
    assert (first.rule, first.server, first.seq) == (rule, server, _seq(events, where)), report.to_json()
    # nothing of v1's step order is judged on the unified plane
    assert all(v.rule != "order" for v in report.violations)


async def test_show_names_blockers_restarts_and_cleanup(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    async with Ledger.open(url) as ledger:
        s = V2Script(ledger)
        await s.start()
        await s.attempt("blocked")
        await s.phase("blocked", "prepare")
        await s.prepare_one("blocked", ENV, phase="preparing")
        await s.event("episodes.blocked", "blocked", blockers={ENV: ["r1", "r2"]}, counts={ENV: 7})
        await s.resume("blocked", "rollback", order=(ENV,))
        await s.event("attempt.aborted", "blocked", reason="not ready", resumed=[ENV])
        await s.attempt("ck")
        await s.prepare("ck", restarts={AGENT: ["r2"]})
        await s.commit("ck", ["r0", "r1"], restarts={AGENT: ["r2"]})
        await s.publish("ck")
        await s.resume("ck")
        await s.completed("ck")
    assert (await _check(url)).violations == []
    assert await _main(["show", "--ledger", url, "blocked"]) == 0
    assert "blocked: environment by 7 episodes (r1, r2)" in capsys.readouterr().out
    assert await _main(["show", "--ledger", url, "ck"]) == 0
    out = capsys.readouterr().out
    assert "scope: 2 episodes (derived)" in out
    assert "restarts (left out of the scope): agent: r2" in out
    async with open_readonly(url) as ledger:
        view = build_attempt("ck", await attempt_events(ledger, "ck"))
    assert view.v2 is not None
    assert view.v2.restarts == {AGENT: ("r2",)}
    assert view.to_json()["v2"]["scope_size"] == 2


async def test_each_server_commits_into_its_own_folder_of_one_staging_folder(url: str) -> None:
    # servers with a `folder` (one Gym deployment each) get the staging folder plus that folder;
    # the rule compares what is left once each server's own folder is taken off
    folders = {ENV: "gym-instances/d0", MODEL: "gym-instances/d0", AGENT: "gym-instances/d1"}
    async with Ledger.open(url) as ledger:
        s = V2Script(ledger, folders)
        await s.start()
        await s.attempt("ok")
        await s.prepare("ok")
        await s.phase("ok", "commit")
        await s.event("episodes.scoped", "ok", scope=["r0"], source="given", restarts={})
        for server in (ENV, MODEL, AGENT, RES):
            own = folders.get(server)
            await s.commit_one(
                "ok", server, ["r0"], ["r0"], folder="/snap/.staging/ok" + (f"/{own}" if own else "")
            )
        await s.phase_done("ok", "commit")
        await s.publish("ok")
        await s.resume("ok")
        await s.completed("ok")
        # an agent sent the other deployment's folder: not the same staging folder once its own is off
        await s.attempt("bad")
        await s.prepare("bad")
        await s.phase("bad", "commit")
        await s.event("episodes.scoped", "bad", scope=["r0"], source="given", restarts={})
        await s.commit_one("bad", ENV, ["r0"], ["r0"], folder="/snap/.staging/bad/gym-instances/d0")
        await s.commit_one("bad", AGENT, ["r0"], ["r0"], folder="/snap/.staging/bad/gym-instances/d0")
    report = await _check(url)
    assert [(v.rule, v.checkpoint_id, v.server) for v in report.violations][:1] == [("commit", "bad", AGENT)]
    assert all(v.checkpoint_id != "ok" for v in report.violations)
