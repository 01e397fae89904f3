"""Payload samples, a random event generator, raw SQL access, and a killed child writer for the
ledger tests."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from quiesce.ledger import AppendItem

COORDINATOR: dict[str, Any] = {"coordinator": {"host": "test", "pid": 1, "uuid": "u-1"}, "version": "0.1.0"}
SENT: dict[str, Any] = {
    "phase": "prepare",
    "method": "POST",
    "path": "/ng-control/v1/model-admission/pause",
    "url": "http://127.0.0.1:8001",
    "timeout_s": 5.0,
    "body": {"schema_version": 1, "checkpoint_id": "c1", "deadline_ts": 100.5},
}
REPLIED: dict[str, Any] = {"status": 200, "body": {"state": "paused"}, "elapsed_s": 0.01}
FAILED: dict[str, Any] = {"error": "timeout", "detail": "no reply", "elapsed_s": 5.0}


def started(kind: str = "save", participants: list[str] | None = None) -> dict[str, Any]:
    return {"kind": kind, "deadline_ts": 1000.25, "participants": participants or ["policy_model", "agent"]}


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> str:
    database = make_url(url).database
    assert database is not None
    return database


async def raw_sql(url: str, *statements: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Run statements directly on the database (bypassing the Ledger); rows of the last one."""
    engine = create_async_engine(url)
    rows: list[tuple[Any, ...]] = []
    try:
        async with engine.begin() as conn:
            for statement in statements:
                result = await conn.execute(text(statement), params or {})
                rows = [tuple(r) for r in result.all()] if result.returns_rows else []
    finally:
        await engine.dispose()
    return rows


def drop_triggers_sql(url: str) -> list[str]:
    """What a tamperer with the database's owner rights runs first: every append-only trigger dropped."""
    if is_sqlite(url):
        return [
            "DROP TRIGGER events_no_update",
            "DROP TRIGGER events_no_delete",
            "DROP TRIGGER events_insert_at_head",
        ]
    return [
        "DROP TRIGGER events_no_update_delete ON events",
        "DROP TRIGGER events_no_truncate ON events",
        "DROP TRIGGER events_insert_at_head ON events",
    ]


PHASES = ("prepare", "commit", "resume", "restore", "rollback")


def random_items(rng: random.Random, n: int) -> list[AppendItem]:
    """``n`` events of many interleaved attempts: phases, calls, failures, publishes, aborts, recovery."""
    items: list[AppendItem] = []
    live: list[str] = []
    ended: list[str] = []
    counter = 0
    call = 0
    while len(items) < n:
        roll = rng.random()
        if not live or roll < 0.04:
            cid = f"ckpt-{counter:05d}"
            counter += 1
            kind = rng.choice(["save", "restore"])
            items.append(
                AppendItem("attempt.started", checkpoint_id=cid, data=started(kind, [f"s{rng.randrange(5)}"]))
            )
            live.append(cid)
            continue
        cid = rng.choice(live)
        if roll < 0.05 and ended:
            cid = rng.choice(ended)  # late events on a finished attempt
        elif roll < 0.06:
            cid = f"unknown-{rng.randrange(3)}"  # events for an id that never started
        elif roll < 0.07:
            items.append(AppendItem("discovery.completed", data={"participants": [], "warnings": ["w"]}))
            continue
        action = rng.random()
        if action < 0.45:
            call += 1
            server = f"s{rng.randrange(5)}"
            items.append(
                AppendItem("call.sent", checkpoint_id=cid, server=server, call_id=f"k{call}", data=SENT)
            )
            if rng.random() < 0.8:
                items.append(
                    AppendItem(
                        "call.replied", checkpoint_id=cid, server=server, call_id=f"k{call}", data=REPLIED
                    )
                )
            else:
                items.append(
                    AppendItem(
                        "call.failed", checkpoint_id=cid, server=server, call_id=f"k{call}", data=FAILED
                    )
                )
        elif action < 0.6:
            items.append(AppendItem("phase.started", checkpoint_id=cid, data={"phase": rng.choice(PHASES)}))
        elif action < 0.68:
            items.append(
                AppendItem(
                    "phase.completed", checkpoint_id=cid, data={"phase": "prepare", "summary": {"n": 1}}
                )
            )
        elif action < 0.72:
            items.append(
                AppendItem("phase.failed", checkpoint_id=cid, data={"phase": "commit", "reason": "409"})
            )
        elif action < 0.77:
            items.append(
                AppendItem(
                    "attempt.publishing", checkpoint_id=cid, data={"staging_dir": "s", "final_dir": "f"}
                )
            )
        elif action < 0.81:
            items.append(
                AppendItem(
                    "attempt.published",
                    checkpoint_id=cid,
                    data={"final_dir": "f", "manifest_sha256": "0" * 64},
                )
            )
        elif action < 0.85:
            items.append(AppendItem("attempt.aborting", checkpoint_id=cid, data={"reason": "deadline"}))
        elif action < 0.89:
            items.append(
                AppendItem(
                    "attempt.aborted", checkpoint_id=cid, data={"reason": "deadline", "resumed": ["s1"]}
                )
            )
            if cid in live:
                live.remove(cid)
                ended.append(cid)
        elif action < 0.93:
            outcome = rng.choice(["published", "restored", "resumed"])
            items.append(
                AppendItem(
                    "attempt.completed", checkpoint_id=cid, data={"servers": ["s1"], "outcome": outcome}
                )
            )
            if cid in live:
                live.remove(cid)
                ended.append(cid)
        elif action < 0.97:
            items.append(
                AppendItem(
                    "recovery.settled",
                    checkpoint_id=cid,
                    server="s1",
                    data={
                        "reported_phase": "prepared",
                        "active_checkpoint_id": cid,
                        "action": "resume",
                        "result": "ok",
                    },
                )
            )
        else:
            pool = live + ended
            chosen = rng.sample(pool, min(len(pool), rng.randrange(1, 4)))
            outcomes = {c: rng.choice(["aborted", "abandoned", "published"]) for c in chosen}
            items.append(AppendItem("recovery.completed", data={"outcomes": outcomes}))
    return items[:n]


REPO = Path(__file__).resolve().parents[2]


def run_and_kill(code: str) -> tuple[str, int]:
    """Start ``code`` in a child Python, read its first line, SIGKILL it; (line, return code)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return line, proc.returncode
