"""Hand-made ledgers for the audit tests, written through the real `Ledger` API.

`Script` appends the events a coordinator would write for one attempt, one call at a time, so a
test can write a plausible attempt and then break exactly one rule. Server names decide the
component: `policy_model` is the policy model, names ending in `_agent` are agents, anything else
is a resources server. Paths come from the wire route table (`quiesce.coordinator.protocol`).

`forge_stale_event` is the one thing the API cannot do (the ledger fences stale writers): it
inserts a correctly chained row with an old epoch straight into a SQLite file, the way a writer
that bypassed the fence would.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, route
from quiesce.ledger import Ledger
from quiesce.ledger.canonical import canonical_text, chain_hash, row_bytes

POLICY = "policy_model"
AGENT_1 = "simple_agent"
AGENT_2 = "math_agent"
TOOLS = "tools"
PARTICIPANTS = (POLICY, AGENT_1, AGENT_2, TOOLS)


def component_of(server: str) -> str:
    if server == POLICY:
        return MODEL
    if server.endswith("_agent"):
        return AGENT
    return RESOURCES


def far_deadline() -> float:
    return time.time() + 3600.0


class Script:
    """Writes one coordinator's events through an open writer `Ledger`."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._n = 0
        self._prefix = uuid.uuid4().hex[:8]

    async def start(self, participants: Sequence[str] = PARTICIPANTS) -> None:
        await self.ledger.start_epoch(
            {"coordinator": {"host": "test", "pid": 1, "uuid": f"u{time.time_ns()}"}, "version": "test"}
        )
        await self.ledger.append(
            "discovery.completed",
            data={
                "participants": [
                    {
                        "name": name,
                        "component": component_of(name),
                        "mode": "export_restore",
                        "role": "policy" if name == POLICY else None,
                        "url": f"http://127.0.0.1:{8000 + i}",
                    }
                    for i, name in enumerate(participants)
                ],
            },
        )

    async def attempt(
        self,
        cid: str,
        *,
        kind: str = "save",
        deadline_ts: float | None = None,
        participants: Sequence[str] = PARTICIPANTS,
    ) -> None:
        await self.ledger.append(
            "attempt.started",
            checkpoint_id=cid,
            data={
                "kind": kind,
                "deadline_ts": far_deadline() if deadline_ts is None else deadline_ts,
                "participants": list(participants),
                "staging_dir": f"/snap/.staging/{cid}",
            },
        )

    async def phase(self, cid: str, phase: str) -> None:
        await self.ledger.append("phase.started", checkpoint_id=cid, data={"phase": phase})

    async def phase_done(self, cid: str, phase: str) -> None:
        await self.ledger.append("phase.completed", checkpoint_id=cid, data={"phase": phase, "summary": {}})

    async def phase_failed(self, cid: str, phase: str, server: str, reason: str) -> None:
        await self.ledger.append(
            "phase.failed", checkpoint_id=cid, data={"phase": phase, "server": server, "reason": reason}
        )

    async def send(self, cid: str, server: str, phase: str, operation: str) -> str:
        """Append a `call.sent` for `operation` on `server`; returns its call id."""
        self._n += 1
        call_id = f"{cid}-{self._prefix}-{self._n}"
        r = route(component_of(server), operation)
        await self.ledger.append(
            "call.sent",
            checkpoint_id=cid,
            server=server,
            call_id=call_id,
            data={
                "phase": phase,
                "method": r.method,
                "path": r.full_path,
                "url": f"http://127.0.0.1:9/{r.full_path}",
                "timeout_s": 30.0,
                "body": {"checkpoint_id": cid} if r.method == "POST" else None,
            },
        )
        return call_id

    async def reply(self, cid: str, server: str, call_id: str, status: int = 200, body: Any = None) -> None:
        await self.ledger.append(
            "call.replied",
            checkpoint_id=cid,
            server=server,
            call_id=call_id,
            data={"status": status, "body": {"state": "ok"} if body is None else body, "elapsed_s": 0.01},
        )

    async def fail(
        self,
        cid: str,
        server: str,
        call_id: str,
        *,
        error: str = "http",
        status: int | None = 409,
        code: str = "x",
    ) -> None:
        await self.ledger.append(
            "call.failed",
            checkpoint_id=cid,
            server=server,
            call_id=call_id,
            data={
                "error": error,
                "status": status,
                "code": code,
                "detail": f"{code} detail",
                "elapsed_s": 0.02,
            },
        )

    async def call(self, cid: str, server: str, phase: str, operation: str, status: int = 200) -> str:
        """A call answered with `status` (200: acknowledged)."""
        call_id = await self.send(cid, server, phase, operation)
        if status == 200:
            await self.reply(cid, server, call_id)
        else:
            await self.fail(cid, server, call_id, status=status)
        return call_id

    async def prepare(self, cid: str, servers: Sequence[str] = PARTICIPANTS) -> None:
        await self.phase(cid, "prepare")
        await self.call(cid, POLICY, "prepare", "pause")
        for s in servers:
            if component_of(s) == AGENT:
                await self.call(cid, s, "prepare", "prepare")
        for s in servers:
            if component_of(s) == RESOURCES:
                await self.call(cid, s, "prepare", "prepare")
        await self.call(cid, POLICY, "prepare", "status")
        await self.phase_done(cid, "prepare")

    async def commit(self, cid: str, servers: Sequence[str] = PARTICIPANTS) -> None:
        await self.phase(cid, "commit")
        for comp in (AGENT, MODEL, RESOURCES):
            for s in servers:
                if component_of(s) == comp:
                    await self.call(cid, s, "commit", "commit")
        await self.phase_done(cid, "commit")

    async def resume(self, cid: str, servers: Sequence[str] = PARTICIPANTS, phase: str = "resume") -> None:
        await self.phase(cid, phase)
        for comp in (RESOURCES, MODEL, AGENT):
            for s in servers:
                if component_of(s) == comp:
                    await self.call(cid, s, phase, "resume")
        await self.phase_done(cid, phase)

    async def publish(self, cid: str) -> None:
        await self.ledger.append(
            "attempt.publishing",
            checkpoint_id=cid,
            data={"staging_dir": f"/snap/.staging/{cid}", "final_dir": f"/snap/{cid}"},
        )
        await self.ledger.append(
            "attempt.published",
            checkpoint_id=cid,
            data={"final_dir": f"/snap/{cid}", "manifest_sha256": "0" * 64},
        )

    async def completed(self, cid: str, outcome: str = "published") -> None:
        await self.ledger.append(
            "attempt.completed", checkpoint_id=cid, data={"servers": list(PARTICIPANTS), "outcome": outcome}
        )

    async def aborted(
        self, cid: str, reason: str, resumed: Sequence[str] = (), left: Sequence[str] = ()
    ) -> None:
        await self.ledger.append("attempt.aborting", checkpoint_id=cid, data={"reason": reason})
        await self.ledger.append(
            "attempt.aborted",
            checkpoint_id=cid,
            data={"reason": reason, "resumed": list(resumed), "left_paused": list(left), "not_paused": []},
        )

    async def good_save(self, cid: str, deadline_ts: float | None = None) -> None:
        """A whole successful save attempt: prepare, commit, publish, resume, completed."""
        await self.attempt(cid, deadline_ts=deadline_ts)
        await self.prepare(cid)
        await self.commit(cid)
        await self.publish(cid)
        await self.resume(cid)
        await self.completed(cid)


def sqlite_path(url: str) -> Path:
    return Path(url.split(":///", 1)[1])


def forge_stale_event(
    url: str, *, epoch: int, checkpoint_id: str | None, kind: str, data: dict[str, Any]
) -> int:
    """Insert, chained after the head, an event with `epoch` (lower than the head's) into a SQLite
    ledger, bypassing the fence; returns its seq."""
    connection = sqlite3.connect(sqlite_path(url))
    try:
        seq, prev = connection.execute("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1").fetchone()
        seq += 1
        at = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        text = canonical_text(data)
        digest = chain_hash(
            prev,
            row_bytes(
                seq=seq,
                at=at,
                kind=kind,
                checkpoint_id=checkpoint_id,
                server=None,
                call_id=None,
                epoch=epoch,
                data_text=text,
                prev_hash=prev,
            ),
        )
        connection.execute(
            "INSERT INTO events (seq, at, kind, checkpoint_id, server, call_id, epoch, data, prev_hash, hash)"
            " VALUES (?, ?, ?, ?, NULL, NULL, ?, ?, ?, ?)",
            (seq, at, kind, checkpoint_id, epoch, text, prev, digest),
        )
        connection.commit()
        return int(seq)
    finally:
        connection.close()
