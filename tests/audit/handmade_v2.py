"""Hand-made ledgers of Gym's unified plane (v2) for the audit tests, written through the real
`Ledger` API: `V2Script` appends what the coordinator writes for a v2 attempt (the bodies and
replies it records), one call at a time, so a test can write a plausible attempt and then break
exactly one rule. Servers: one of each kind, named as the default v2 cluster names them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from quiesce.coordinator.protocol_v2 import ROUTES
from quiesce.ledger import Ledger

ENV = "environment"
MODEL = "policy_model"
AGENT = "agent"
RES = "resources"
V2_PARTICIPANTS = (ENV, MODEL, AGENT, RES)
KIND = {ENV: "environment", MODEL: "model", AGENT: "agent", RES: "resources"}
RESUME_ORDER = (RES, AGENT, MODEL, ENV)
RETIRE_ORDER = (ENV, AGENT, MODEL, RES)


def episodes(keys: Sequence[str]) -> list[dict[str, Any]]:
    """Body form of capture keys (`r1` → `{"rollout_id": "r1", "attempt": 0}`)."""
    out = []
    for key in keys:
        rollout, _, n = key.rpartition("-a")
        out.append(
            {"rollout_id": rollout, "attempt": int(n)}
            if rollout and n.isdigit()
            else {"rollout_id": key, "attempt": 0}
        )
    return out


class V2Script:
    """Writes one coordinator's v2 events through an open writer `Ledger`."""

    def __init__(self, ledger: Ledger, folders: Mapping[str, str] | None = None) -> None:
        self.ledger = ledger
        self.folders = dict(folders or {})
        self._n = 0
        self._prefix = uuid.uuid4().hex[:8]

    async def start(self) -> None:
        await self.ledger.start_epoch(
            {"coordinator": {"host": "test", "pid": 1, "uuid": f"u{time.time_ns()}"}, "version": "test"}
        )
        await self.ledger.append(
            "discovery.completed",
            data={
                "participants": [
                    {
                        "name": name,
                        "component": KIND[name],
                        "mode": "export_restore",
                        "role": {"model": "policy"}.get(KIND[name], KIND[name]),
                        "url": f"http://127.0.0.1:{8100 + i}",
                        "plane": "v2",
                        **({"folder": self.folders[name]} if name in self.folders else {}),
                    }
                    for i, name in enumerate(V2_PARTICIPANTS)
                ],
            },
        )

    async def attempt(
        self, cid: str, *, kind: str = "save", stop: bool = False, source: str | None = None
    ) -> None:
        data: dict[str, Any] = {
            "kind": kind,
            "plane": "v2",
            "deadline_ts": time.time() + 3600.0,
            "participants": list(V2_PARTICIPANTS),
            "stop": stop,
        }
        if kind == "save":
            data["staging_dir"] = f"/snap/.staging/{cid}"
        else:
            data["snapshot_dir"] = f"/snap/{source}"
            data["source_checkpoint_id"] = source
        await self.ledger.append("attempt.started", checkpoint_id=cid, data=data)

    async def event(self, kind: str, cid: str | None, **data: Any) -> None:
        await self.ledger.append(kind, checkpoint_id=cid, data=data)

    async def phase(self, cid: str, phase: str) -> None:
        await self.event("phase.started", cid, phase=phase)

    async def phase_done(self, cid: str, phase: str) -> None:
        await self.event("phase.completed", cid, phase=phase, summary={})

    async def send(
        self, cid: str | None, server: str, phase: str, operation: str, body: Mapping[str, Any] | None = None
    ) -> str:
        """A `call.sent` of `operation` (its default body carries `cid`); returns its call id."""
        self._n += 1
        call_id = f"{cid}/{self._n}" if cid is not None else f"e1-{phase}/{self._prefix}{self._n}"
        route = ROUTES[operation]
        sent = dict(body) if body is not None else {"checkpoint_id": cid, "deadline_ts": time.time() + 3600.0}
        await self.ledger.append(
            "call.sent",
            checkpoint_id=cid,
            server=server,
            call_id=call_id,
            data={
                "phase": phase,
                "method": route.method,
                "path": route.full_path,
                "url": f"http://127.0.0.1:9{route.full_path}",
                "timeout_s": 30.0,
                "body": sent if route.method == "POST" else None,
            },
        )
        return call_id

    async def reply(self, cid: str | None, server: str, call_id: str, body: Any, status: int = 200) -> None:
        await self.ledger.append(
            "call.replied",
            checkpoint_id=cid,
            server=server,
            call_id=call_id,
            data={"status": status, "body": body, "elapsed_s": 0.01},
        )

    async def fail(
        self, cid: str | None, server: str, call_id: str, *, status: int = 409, code: str = "x"
    ) -> None:
        await self.ledger.append(
            "call.failed",
            checkpoint_id=cid,
            server=server,
            call_id=call_id,
            data={"error": "http", "status": status, "code": code, "detail": code, "elapsed_s": 0.01},
        )

    async def call(
        self,
        cid: str | None,
        server: str,
        phase: str,
        operation: str,
        reply: Any,
        body: Mapping[str, Any] | None = None,
    ) -> str:
        call_id = await self.send(cid, server, phase, operation, body)
        await self.reply(cid, server, call_id, reply)
        return call_id

    # -- building blocks ------------------------------------------------------------------------

    async def prepare_one(
        self,
        cid: str,
        server: str,
        *,
        phase: str = "prepared",
        restarts: Sequence[str] = (),
        sent_id: str | None = None,
    ) -> None:
        body = {"checkpoint_id": sent_id or cid, "deadline_ts": time.time() + 3600.0}
        report = {
            "ready": phase == "prepared",
            "blockers": [],
            "blocker_count": 0,
            "counts": {},
            "restarts": list(restarts),
        }
        await self.call(cid, server, "prepare", "prepare", {"phase": phase, "report": report}, body)

    async def prepare(self, cid: str, restarts: Mapping[str, Sequence[str]] | None = None) -> None:
        await self.phase(cid, "prepare")
        for server in V2_PARTICIPANTS:
            await self.prepare_one(cid, server, restarts=(restarts or {}).get(server, ()))
        await self.phase_done(cid, "prepare")

    def commit_body(
        self, cid: str, scope: Sequence[str] | None, *, stop: bool = False, folder: str | None = None
    ) -> dict[str, Any]:
        return {
            "checkpoint_id": cid,
            "deadline_ts": time.time() + 3600.0,
            "checkpoint_dir": folder or f"/snap/.staging/{cid}",
            "episode_ids": episodes(scope) if scope is not None else None,
            "stop": stop,
        }

    async def commit_one(
        self, cid: str, server: str, scope: Sequence[str] | None, exported: Sequence[str], **body: Any
    ) -> None:
        reply = {
            "phase": "committed",
            "manifest": {"kind": KIND[server], "checkpoint_id": cid},
            "episode_ids": sorted(exported),
        }
        await self.call(cid, server, "commit", "commit", reply, self.commit_body(cid, scope, **body))

    async def commit(
        self,
        cid: str,
        scope: Sequence[str],
        *,
        derived: bool = True,
        stop: bool = False,
        restarts: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """The environment first with no scope (derived), or everyone with the given scope."""
        await self.phase(cid, "commit")
        rest: Sequence[str] = V2_PARTICIPANTS
        if derived:
            await self.commit_one(cid, ENV, None, scope, stop=stop)
            rest = V2_PARTICIPANTS[1:]
        await self.event(
            "episodes.scoped",
            cid,
            scope=list(scope),
            source="derived" if derived else "given",
            restarts={n: list(k) for n, k in (restarts or {}).items()},
        )
        for server in rest:
            await self.commit_one(cid, server, scope, scope, stop=stop)
        await self.event("episodes.exported", cid, exported={s: list(scope) for s in V2_PARTICIPANTS})
        await self.phase_done(cid, "commit")

    async def renew(self, cid: str, servers: Sequence[str] = V2_PARTICIPANTS) -> None:
        for server in servers:
            await self.call(cid, server, "renew", "renew", {"lease_expires_at": time.time() + 600.0})

    async def publish(self, cid: str) -> None:
        await self.event(
            "attempt.publishing", cid, staging_dir=f"/snap/.staging/{cid}", final_dir=f"/snap/{cid}"
        )
        await self.event("attempt.published", cid, final_dir=f"/snap/{cid}", manifest_sha256="0" * 64)

    async def resume(self, cid: str, phase: str = "resume", order: Sequence[str] = RESUME_ORDER) -> None:
        if phase == "resume":
            await self.phase(cid, phase)
        for server in order:
            await self.call(cid, server, phase, "resume", {"phase": "idle", "idempotent": False})
        if phase == "resume":
            await self.phase_done(cid, phase)

    async def completed(
        self, cid: str, outcome: str = "published", servers: Sequence[str] = RESUME_ORDER
    ) -> None:
        await self.event("attempt.completed", cid, servers=list(servers), outcome=outcome)

    async def good_save(self, cid: str, scope: Sequence[str] = ("r0", "r1")) -> None:
        """A whole published save: prepare by stage, derived commit, renewals, publish, resume."""
        await self.attempt(cid)
        await self.prepare(cid)
        await self.commit(cid, scope)
        await self.renew(cid)
        await self.publish(cid)
        await self.resume(cid)
        await self.completed(cid)

    async def restore_one(
        self,
        cid: str,
        server: str,
        source: str,
        inventory: Sequence[str],
        *,
        ok: bool = True,
        sent_id: str | None = None,
    ) -> None:
        body = {
            "checkpoint_id": sent_id or cid,
            "deadline_ts": time.time() + 3600.0,
            "checkpoint_dir": f"/snap/{source}",
            "episode_ids": episodes(inventory),
        }
        call_id = await self.send(cid, server, "restore", "restore", body)
        if ok:
            restored = [f"{k}-a1" for k in inventory]
            await self.reply(
                cid,
                server,
                call_id,
                {"phase": "restored", "source_checkpoint_id": source, "restored": restored},
            )
        else:
            await self.fail(cid, server, call_id, code="checkpoint_error")

    async def good_restore(self, cid: str, source: str, inventory: Sequence[str] = ("r0", "r1")) -> None:
        """A restore then its resume."""
        await self.attempt(cid, kind="restore", source=source)
        await self.phase(cid, "restore")
        for server in V2_PARTICIPANTS:
            await self.restore_one(cid, server, source, inventory)
        await self.phase_done(cid, "restore")
        await self.event(
            "episodes.restored",
            cid,
            source_checkpoint_id=source,
            scope=list(inventory),
            restored={s: [f"{k}-a1" for k in inventory] for s in V2_PARTICIPANTS},
        )
        await self.resume(cid)
        await self.completed(cid, "resumed")

    async def retire(
        self,
        cid: str | None,
        op_id: str,
        keys: Sequence[str],
        *,
        order: Sequence[str] = RETIRE_ORDER,
        reason: str = "retired by request",
        phase: str = "retire",
    ) -> None:
        """A retire of `keys` on `order`: outside any attempt (`cid` None), or under an attempt."""
        for server in order:
            body = {"checkpoint_id": op_id, "deadline_ts": time.time() + 60.0, "episode_ids": episodes(keys)}
            await self.call(cid, server, phase, "retire", {"retired": list(keys)}, body)
        await self.event(
            "episodes.retired", cid, episodes=list(keys), servers=list(order), reason=reason, failed={}
        )

    async def failed_restore(
        self,
        cid: str,
        source: str,
        inventory: Sequence[str] = ("r0", "r1"),
        *,
        retire_on: Sequence[str] = RETIRE_ORDER,
        resume_on: Sequence[str] = RESUME_ORDER,
    ) -> None:
        """A restore the resources server refuses, cleaned up: retire the next attempts, resume."""
        await self.attempt(cid, kind="restore", source=source)
        await self.phase(cid, "restore")
        for server in V2_PARTICIPANTS:
            await self.restore_one(cid, server, source, inventory, ok=server != RES)
        await self.ledger.append(
            "phase.failed", checkpoint_id=cid, data={"phase": "restore", "server": RES, "reason": "refused"}
        )
        await self.event("attempt.aborting", cid, reason="restore failed at resources")
        await self.retire(
            cid, cid, [f"{k}-a1" for k in inventory], order=retire_on, reason="clean up a failed restore"
        )
        await self.resume(cid, "rollback", resume_on)
        await self.event(
            "attempt.aborted", cid, reason="restore failed at resources", resumed=list(resume_on)
        )
