"""The `rollout_refs` projection (revision 0006) and one rollout's lineage read through it.

Property: on generated ledgers — random saves (published, aborted, left open, published late),
restores, retires, forgets and acknowledgements over a few rollouts, on both planes' event
shapes, with rediscoveries that list only some servers — `read_rollout_lineage(ledger, [r])`
equals the whole ledger's `read_lineage` for r: its record (state, attempt, steps, what it is
owed, its retire mark), its violations and its warnings. The events are appended by
`Ledger.append_many` into a real SQLite file (and a real PostgreSQL database for a few seeds).
Also: the projection is written with the events, backfilled by the migration, and an edited,
deleted or added row is found by `replay` and `check` and fixed by `replay --rebuild`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiesce.ledger import (
    AppendItem,
    Ledger,
    LedgerError,
    downgrade_schema,
    event_from_raw,
    replay_url,
    upgrade_schema,
)
from quiesce.ledger.layout import HEAD_REVISION
from quiesce.ledger.lineage import LineageFold, LineageReport, read_lineage
from quiesce.ledger.replay import REFS_TABLE
from quiesce.ledger.rollout_refs import REF_KINDS, read_rollout_lineage, refs_of_rows, rollout_ids
from quiesce.ledger.sqlite_reads import read_rollout_lineage_now
from quiesce.ledger.urls import plain_sqlite_path
from quiesce.tools.audit.cli import check_ledger
from tests.ledger.helpers import COORDINATOR, SENT, is_sqlite, raw_sql

pytestmark = pytest.mark.anyio

V2_SERVERS = {"env": "environment", "model": "model"}
V1_AGENTS = ("agent_a", "agent_b")
ACK = "completed_result_acknowledgement"


def _key(rollout: str, attempt: int) -> str:
    return rollout if attempt == 0 else f"{rollout}-a{attempt}"


class Gen:
    """A random ledger's events, as `AppendItem`s in order."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.items: list[AppendItem] = []
        self.n = 0
        self.open: list[tuple[str, str]] = []  # saves started, not yet ended: (cid, plane)
        self.rollouts = [f"r{i}" for i in range(self.rng.randint(2, 5))]
        self.v1_ids = [*self.rollouts, "x-a1"]  # a v1 rollout id may end in -a<n>

    def add(self, event_kind: str, cid: str | None = None, server: str | None = None, **data: Any) -> None:
        call = f"k{len(self.items)}" if event_kind.startswith("call.") else None
        self.items.append(AppendItem(event_kind, checkpoint_id=cid, server=server, call_id=call, data=data))

    def cid(self) -> str:
        self.n += 1
        return f"c{self.n}"

    def pairs(self, ids: list[str], k: int) -> list[tuple[str, int]]:
        rng = self.rng
        return [(rng.choice(ids), rng.randint(0, 2)) for _ in range(rng.randint(0, k))]

    def discover(self) -> None:
        rng = self.rng
        names = [*V2_SERVERS, *V1_AGENTS]
        listed = names if rng.random() < 0.6 else rng.sample(names, rng.randint(1, len(names)))
        participants = []
        for name in listed:
            component = V2_SERVERS.get(name, "agent")
            features = [ACK] if name == "agent_a" or rng.random() < 0.3 else []
            participants.append(
                {
                    "name": name,
                    "component": component,
                    "mode": "export_restore",
                    "url": "http://h",
                    "features": features,
                }
            )
        self.add("discovery.completed", participants=participants)

    def end(self, cid: str) -> None:
        if self.rng.random() < 0.8:
            self.add("attempt.published", cid, final_dir="/f", manifest_sha256="0" * 64)
            if self.rng.random() < 0.05:  # recorded twice: the second changes nothing
                self.add("attempt.published", cid, final_dir="/f", manifest_sha256="0" * 64)
        else:
            self.add("attempt.aborted", cid, reason="x")

    def save_v2(self) -> None:
        rng, cid = self.rng, self.cid()
        servers = list(V2_SERVERS) if rng.random() < 0.8 else ["model"]
        self.add("attempt.started", cid, kind="save", plane="v2", participants=servers, deadline_ts=1.0)
        self.add("call.sent", cid, "model", **SENT)
        for _ in range(2 if rng.random() < 0.1 else 1):  # a later scope replaces an earlier one
            scope = [_key(r, a) for r, a in self.pairs(self.rollouts, 4)]
            restarts = (
                {"env": [_key(r, a) for r, a in self.pairs(self.rollouts, 2)]} if rng.random() < 0.3 else {}
            )
            self.add("episodes.scoped", cid, scope=scope, source="given", restarts=restarts)
        exported = {s: [k for k in scope if rng.random() < 0.85] for s in servers}
        self.add("episodes.exported", cid, exported=exported)
        self.later(cid, "v2")

    def save_v1(self) -> None:
        rng, cid = self.rng, self.cid()
        self.add("attempt.started", cid, kind="save", participants=list(V1_AGENTS), deadline_ts=1.0)
        for agent in V1_AGENTS if rng.random() < 0.5 else [rng.choice(V1_AGENTS)]:
            pairs = self.pairs(self.v1_ids, 3)
            self.add(
                "rollouts.captured",
                cid,
                captured={agent: [{"rollout_id": r, "attempt": a} for r, a in pairs]},
            )
        self.later(cid, "v1")

    def later(self, cid: str, plane: str) -> None:
        if self.rng.random() < 0.3:
            self.open.append((cid, plane))  # ended later, or never
        else:
            self.end(cid)

    def restore_v2(self) -> None:
        rng, cid = self.rng, self.cid()
        self.add(
            "attempt.started", cid, kind="restore", plane="v2", participants=list(V2_SERVERS), deadline_ts=1.0
        )
        keys = [_key(r, a + 1) for r, a in self.pairs(self.rollouts, 4)]
        restored = {s: keys for s in V2_SERVERS if rng.random() < 0.9}
        self.add(
            "episodes.restored",
            cid,
            source_checkpoint_id=f"c{rng.randint(1, self.n)}",
            scope=[],
            restored=restored,
        )
        if rng.random() < 0.5:
            self.add("attempt.completed", cid, servers=list(V2_SERVERS), outcome="restored")

    def restore_v1(self) -> None:
        rng, cid = self.rng, self.cid()
        self.add("attempt.started", cid, kind="restore", participants=list(V1_AGENTS), deadline_ts=1.0)

        def groups(k: int) -> dict[str, list[dict[str, Any]]]:
            return {
                agent: [{"rollout_id": r, "attempt": a + 1} for r, a in self.pairs(self.v1_ids, k)]
                for agent in V1_AGENTS
                if rng.random() < 0.7
            }

        self.add(
            "rollouts.continued", cid, source_checkpoint_id="c1", continued=groups(3), discarded=groups(1)
        )

    def retire(self) -> None:
        rng = self.rng
        cid = rng.choice([None, None, f"c{max(self.n, 1)}"])
        keys = [_key(r, a) for r, a in self.pairs(self.rollouts, 2)]
        self.add("episodes.retired", cid, episodes=keys, servers=list(V2_SERVERS), reason="by request")

    def forget(self) -> None:
        ids = self.rng.sample(self.rollouts, self.rng.randint(1, 2))
        self.add("rollouts.forgotten", rollout_ids=ids, servers=list(V2_SERVERS))

    def acknowledge(self) -> None:
        pairs = self.pairs(self.v1_ids, 2)
        agent = self.rng.choice(V1_AGENTS)
        self.add(
            "rollouts.acknowledged",
            None,
            agent,
            executions=[{"rollout_id": r, "attempt": a} for r, a in pairs],
        )

    def build(self, steps: int) -> list[AppendItem]:
        self.discover()
        moves = [
            (self.save_v2, 5),
            (self.save_v1, 4),
            (self.restore_v2, 2),
            (self.restore_v1, 2),
            (self.retire, 2),
            (self.forget, 1),
            (self.acknowledge, 2),
            (self.discover, 1),
        ]
        for _ in range(steps):
            if self.open and self.rng.random() < 0.3:
                cid, _ = self.open.pop(self.rng.randrange(len(self.open)))
                if self.rng.random() < 0.9:
                    self.end(cid)
                continue
            move = self.rng.choices([m for m, _ in moves], weights=[w for _, w in moves])[0]
            move()
        return self.items


async def _write(url: str, items: list[AppendItem]) -> None:
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch(COORDINATOR)
        for start in range(0, len(items), 7):  # several transactions, several events each
            await ledger.append_many(items[start : start + 7])


def _of(report: LineageReport, rollout: str) -> tuple[Any, ...]:
    return (
        report.rollouts.get(rollout),
        [v for v in report.violations if v.rollout_id == rollout],
        [v for v in report.warnings if v.rollout_id == rollout],
    )


async def _assert_equal(url: str) -> LineageReport:
    async with Ledger.open(url, readonly=True) as ledger:
        full = await read_lineage(ledger)
        ids = sorted(full.rollouts)
        for rollout in [*ids, "never-seen"]:
            fast = await read_rollout_lineage(ledger, [rollout])
            assert _of(fast, rollout) == _of(full, rollout), rollout
            assert set(fast.rollouts) <= {rollout}
        together = await read_rollout_lineage(ledger, ids)
        assert together.rollouts == full.rollouts
        assert together.violations == full.violations
        assert together.warnings == full.warnings
    path = plain_sqlite_path(url)
    if path is not None:  # the cold command's path: the same reads on this thread, no event loop
        for rollout in [*ids[:8], "never-seen"]:
            now = read_rollout_lineage_now(Path(path), [rollout])
            assert now is not None
            assert _of(now, rollout) == _of(full, rollout), rollout
        now = read_rollout_lineage_now(Path(path), ids)
        assert now is not None
        assert (now.rollouts, now.violations, now.warnings) == (full.rollouts, full.violations, full.warnings)
    return full


@pytest.mark.parametrize("seed", range(60))
async def test_one_rollouts_lineage_equals_the_whole_ledgers(tmp_path: Path, seed: int) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    await _write(url, Gen(seed).build(40))
    full = await _assert_equal(url)
    assert full.rollouts  # the generator names rollouts


async def test_the_generated_ledgers_reach_every_state_and_rule(tmp_path: Path) -> None:
    """The property above is worth what the generator covers: together its ledgers show every
    state and every rule."""
    states: set[str] = set()
    rules: set[str] = set()
    for seed in range(60):
        gen = Gen(seed)
        gen.build(40)
        fold = LineageFold()
        for seq, item in enumerate(gen.items, start=1):
            raw = (
                seq,
                "t",
                item.kind,
                item.checkpoint_id,
                item.server,
                None,
                1,
                json.dumps(item.data),
                "",
                "",
            )
            fold.feed(event_from_raw(raw))
        report = fold.finish()
        states |= {r.state for r in report.rollouts.values()}
        rules |= {v.rule for v in report.violations} | {f"warn-{v.rule}" for v in report.warnings}
    assert states == {"live", "restarted", "retired", "finished", "lost"}
    assert {"lost", "twice", "retired", "inventory", "warn-lost"} <= rules


@pytest.mark.postgres
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_one_rollouts_lineage_on_postgres(ledger_url: str, seed: int) -> None:
    if is_sqlite(ledger_url):
        pytest.skip("the SQLite runs are above")
    await _write(ledger_url, Gen(seed).build(40))
    await _assert_equal(ledger_url)


async def _refs(url: str) -> list[tuple[str, int]]:
    return sorted((str(r), int(s)) for r, s in await raw_sql(url, "SELECT rollout_id, seq FROM rollout_refs"))


async def _derived(url: str) -> list[tuple[str, int]]:
    async with Ledger.open(url, readonly=True) as ledger:
        rows = [(e.seq, e.kind, e.data) async for e in ledger.read()]
    return sorted((r, seq) for seq, kind, data in rows for r in rollout_ids(kind, data))


async def test_refs_are_written_with_their_events_and_backfilled_by_the_migration(ledger_url: str) -> None:
    await _write(ledger_url, Gen(7).build(40))
    written = await _refs(ledger_url)
    assert written
    assert written == await _derived(ledger_url)
    await downgrade_schema(ledger_url, "0005")
    assert (await upgrade_schema(ledger_url))[1] == HEAD_REVISION
    assert await _refs(ledger_url) == written


async def test_a_ledger_at_0005_is_refused_naming_the_upgrade(ledger_url: str) -> None:
    await _write(ledger_url, Gen(3).build(10))
    await downgrade_schema(ledger_url, "0005")
    path = plain_sqlite_path(ledger_url)
    if path is not None:  # the loop-free read leaves an old ledger to the Ledger, which says why
        assert read_rollout_lineage_now(Path(path), ["r0"]) is None
    with pytest.raises(LedgerError, match="quiesce db upgrade --ledger"):
        await Ledger.connect(ledger_url, readonly=True)


async def test_an_edited_deleted_or_added_ref_is_found_and_rebuilt(ledger_url: str) -> None:
    await _write(ledger_url, Gen(11).build(40))
    report = await replay_url(ledger_url)
    assert report.ok, report.differences
    rollout, seq = (await _refs(ledger_url))[0]
    # the projection is not append-only: a tamperer can change it, and replay finds every change
    await raw_sql(
        ledger_url,
        f"DELETE FROM rollout_refs WHERE rollout_id = '{rollout}' AND seq = {seq}",
        "INSERT INTO rollout_refs (rollout_id, seq) VALUES ('ghost', 2)",
    )
    report = await replay_url(ledger_url)
    found = {(d.checkpoint_id, d.column, d.live, d.rebuilt) for d in report.differences}
    assert found == {
        (REFS_TABLE, f"rollout {rollout}, seq {seq}", None, "present"),
        (REFS_TABLE, "rollout ghost, seq 2", "present", None),
    }
    checked = await check_ledger(ledger_url)
    assert checked.projection.ok is False
    assert len(checked.projection.differences) == 2
    other_rollout, other_seq = (await _refs(ledger_url))[-1]
    await raw_sql(
        ledger_url,
        f"UPDATE rollout_refs SET rollout_id = 'edited' WHERE rollout_id = '{other_rollout}'"
        f" AND seq = {other_seq}",
    )
    assert len((await replay_url(ledger_url)).differences) == 4
    await replay_url(ledger_url, rebuild=True)
    assert (await replay_url(ledger_url)).ok
    assert await _refs(ledger_url) == await _derived(ledger_url)


def test_each_kind_names_what_the_fold_reads() -> None:
    pairs = [
        {"rollout_id": "a-a1", "attempt": 0},
        {"rollout_id": 3, "attempt": 1},
        {"rollout_id": "b", "attempt": "1"},
    ]
    assert rollout_ids("episodes.scoped", {"scope": ["a", "a-a2"], "restarts": {"env": ["c-a1"]}}) == [
        "a",
        "c",
    ]
    assert rollout_ids("episodes.exported", {"exported": {"env": ["d-a3"], "m": "no list"}}) == ["d"]
    assert rollout_ids("episodes.restored", {"restored": {"env": ["e-a1"]}, "scope": ["zz"]}) == ["e"]
    assert rollout_ids("episodes.retired", {"episodes": ["f", "f-a1"]}) == ["f"]
    assert rollout_ids("rollouts.forgotten", {"rollout_ids": ["g", 7]}) == ["7", "g"]
    assert rollout_ids("rollouts.captured", {"captured": {"agent": pairs}}) == ["a-a1"]
    assert rollout_ids("rollouts.acknowledged", {"executions": pairs}) == ["a-a1"]
    assert rollout_ids(
        "rollouts.continued",
        {"continued": {"x": pairs[:1]}, "discarded": {"y": [{"rollout_id": "h", "attempt": 0}]}},
    ) == ["a-a1", "h"]
    assert rollout_ids("call.sent", {"scope": ["a"]}) == []
    assert list(
        refs_of_rows(
            [
                (5, "episodes.retired", '{"episodes": ["z"]}'),
                (6, "call.sent", "{}"),
                (7, "episodes.retired", "[1]"),
            ]
        )
    ) == [("z", 5)]
    assert "discovery.completed" not in REF_KINDS


_ROLLOUT = """
import sys
from quiesce.tools.cli.main import main

code = main(["rollouts", "--ledger", sys.argv[1], "--rollout", sys.argv[2], "--json"])
print("MODULES", *sorted(sys.modules))
raise SystemExit(code)
"""


def test_rollouts_rollout_json_reads_one_lineage_and_imports_only_what_it_needs(tmp_path: Path) -> None:
    """`quiesce rollouts --rollout ID --json` (a cold process) shows the rollout as the whole fold
    does, and loads no SQLAlchemy, alembic, pydantic, rich or wire models — nor anyio or asyncio:
    a SQLite ledger's named rollouts are read without an event loop."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    anyio.run(_write, url, Gen(5).build(40))
    full = anyio.run(_full, url)
    rollout = sorted(full.rollouts)[0]
    done = subprocess.run(
        [sys.executable, "-c", _ROLLOUT, str(tmp_path / "ledger.db"), rollout],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
    )
    document, _, modules = done.stdout.partition("MODULES ")
    shown = json.loads(document)
    assert shown["rollouts"] == [full.rollouts[rollout].to_json()]
    assert shown["violations"] == [v.to_json() for v in full.violations if v.rollout_id == rollout]
    heavy = ("sqlalchemy", "alembic", "pydantic", "rich", "httpx", "fastapi", "anyio", "asyncio")
    loaded = [m for m in modules.split() if m.split(".")[0] in heavy]
    loaded += [m for m in modules.split() if m in ("quiesce.ledger.payloads", "quiesce.coordinator.protocol")]
    assert loaded == []


async def _full(url: str) -> LineageReport:
    async with Ledger.open(url, readonly=True) as ledger:
        return await read_lineage(ledger)
