"""Reference resources server (tool state), spec §5.

Each rollout attempt has a session `(rollout_id, attempt_index)` holding a state
digest and a revision. `POST /tools/step` is a mutation: under the session's lock
(held for `latency_s`), state := sha256(state, input), revision += 1; the reply
carries `x-nemo-gym-resource-state-revision`. The first mutation creates the
session from the rollout id alone, so the state depends only on the rollout's
exact mutation history, never on its attempt.

Checkpoint rules:
- status reports `state` as the admission state (`accepting`, or `paused` from prepare or
  restore until resume), as real Gym does — not the fence phase;
- prepare closes mutation admission (mutations then get 409
  `resources_admission_closed` with `{"error": {"code", "message"}}`), then takes
  every session's lock within the budget — each admitted mutation finishes first;
  a lock timeout releases what it took and answers 409 `resources_checkpoint_error` (the
  fence returns to idle) — admission stays closed, as in Gym, until a resume reopens it.
- commit writes `resources/<name>/<rollout_id>.a<attempt>.json` per session, then
  `manifest.json`; durable before it answers.
- restore closes admission, then refuses (409 `unsafe_resources_restore`) once this process
  applied any mutation — admission stays closed, as in Gym, until a resume; otherwise it
  verifies every digest, installs attempt n's sessions as attempt n+1 and keeps admission
  closed until resume.
- resume releases the locks and reopens admission.

`POST /verify` (read-only, never gated) scores a finished rollout with the judge
model; without a judge it scores locally with the same formula.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Query, Request
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol import (
    ATTEMPT_INDEX_HEADER,
    CHECKPOINT_ID_PATTERN,
    PHASES,
    RESOURCE_REVISION_HEADER,
    RESOURCES,
    RESOURCES_ADMISSION_CLOSED,
    RESOURCES_CHECKPOINT_ERROR,
    ROLLOUT_ID_HEADER,
    UNSAFE_RESOURCES_RESTORE,
    CheckpointDirBody,
    CommonBody,
    Phase,
    ResourcesCommitReply,
    ResourcesPrepareReply,
    ResourcesRestoreReply,
    ResourcesResumeReply,
    ResourcesStatusReply,
    StatusQuery,
    resources_dir,
    route,
    sha256_hex,
)
from quiesce.tools.gymsim.base import GymServer
from quiesce.tools.gymsim.common import (
    RESTORE_FAILED,
    ROLLOUT_ID_RE,
    ArtifactWriter,
    ControlRejection,
    error_response,
    read_manifest,
)
from quiesce.tools.gymsim.fence import OpRule, rule

_STATUS_PHASES: frozenset[Phase] = frozenset(p for p in PHASES if p != "idle")

RolloutId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN)]


class StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str
    turn: int | None = None


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: RolloutId
    attempt_index: int = Field(default=0, ge=0)
    digest: str


@dataclass
class Session:
    rollout_id: str
    attempt_index: int
    state: str
    revision: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def document(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "rollout_id": self.rollout_id,
            "attempt_index": self.attempt_index,
            "revision": self.revision,
            "state": self.state,
        }


def session_seed(rollout_id: str) -> str:
    return sha256_hex(f"gymsim-session|{rollout_id}".encode())


def score(text: str) -> float:
    """A reward in [0, 1) from a judge's output text."""
    return int(sha256_hex(text.encode("utf-8"))[:8], 16) / 2**32


class ResourcesServer(GymServer):
    """A resources server with per-session tool state and revisions."""

    component = RESOURCES
    concurrency_contract = "serialized_per_session"
    features = ("resources_session_revisions_v1",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sessions: dict[tuple[str, int], Session] = {}
        self.accepting = True
        self.served_stateful = False
        self._held: list[Session] = []
        super().__init__(*args, **kwargs)

    def admission_state(self) -> str:
        return "accepting" if self.accepting else "paused"

    def fence_rules(self) -> dict[str, OpRule]:
        return {
            "prepare": rule(("idle",), "preparing", "prepared"),
            "commit": rule(("prepared",), "committing", "committed_paused"),
            "restore": rule(("idle",), "restoring", "restored_paused"),
            "resume": rule(
                ("idle", "prepared", "committed_paused", "restored_paused"), None, "idle", retires=True
            ),
        }

    def debug_state(self) -> dict[str, Any]:
        return {
            "served_stateful": self.served_stateful,
            "sessions": len(self.sessions),
            "locked_sessions": sum(1 for s in self.sessions.values() if s.lock.locked()),
        }

    # -- routes ------------------------------------------------------------------------------

    def add_routes(self) -> None:
        app = self.app

        @app.post("/tools/step")
        async def step(body: StepBody, request: Request) -> JSONResponse:
            return await self._step(body, request)

        @app.post("/verify")
        async def verify(body: VerifyBody) -> JSONResponse:
            return await self._verify(body)

        @self.control_route("POST", route(RESOURCES, "prepare").full_path)
        async def prepare(body: CommonBody) -> JSONResponse:
            return await self.control("prepare", body, lambda: self._prepare(body))

        @self.control_route("GET", route(RESOURCES, "status").full_path)
        async def status(q: Annotated[StatusQuery, Query()]) -> JSONResponse:
            return await self.query(lambda: self._status(q))

        @self.control_route("POST", route(RESOURCES, "commit").full_path)
        async def commit(body: CheckpointDirBody) -> JSONResponse:
            return await self.control("commit", body, lambda: self._commit(body))

        @self.control_route("POST", route(RESOURCES, "restore").full_path)
        async def restore(body: CheckpointDirBody) -> JSONResponse:
            return await self.control("restore", body, lambda: self._restore(body))

        @self.control_route("POST", route(RESOURCES, "resume").full_path)
        async def resume(body: CommonBody) -> JSONResponse:
            return await self.control("resume", body, self._resume)

    async def _step(self, body: StepBody, request: Request) -> JSONResponse:
        rollout_id = request.headers.get(ROLLOUT_ID_HEADER, "")
        attempt_raw = request.headers.get(ATTEMPT_INDEX_HEADER, "0")
        if not ROLLOUT_ID_RE.match(rollout_id) or not attempt_raw.isdigit():
            return error_response(
                400,
                "invalid_request",
                f"{ROLLOUT_ID_HEADER} and {ATTEMPT_INDEX_HEADER} are required",
                key="message",
            )
        if not self.accepting:
            return error_response(
                409,
                RESOURCES_ADMISSION_CLOSED,
                "resources admission is closed for a checkpoint",
                key="message",
            )
        key = (rollout_id, int(attempt_raw))
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = Session(rollout_id, key[1], session_seed(rollout_id))
        async with session.lock:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            session.state = sha256_hex(json.dumps([session.state, body.input]).encode("utf-8"))
            session.revision += 1
            self.served_stateful = True
            revision = session.revision
            result = session.state[:16]
        return JSONResponse(
            {"result": result, "revision": revision}, headers={RESOURCE_REVISION_HEADER: str(revision)}
        )

    async def _verify(self, body: VerifyBody) -> JSONResponse:
        session = self.sessions.get((body.rollout_id, body.attempt_index))
        if session is None:
            return error_response(
                404,
                "unknown_session",
                f"no session {body.rollout_id} attempt {body.attempt_index}",
                key="message",
            )
        question = f"{body.rollout_id}|{session.state}|{session.revision}|{body.digest}"
        if self.spec.judge is None:
            verdict = sha256_hex(question.encode("utf-8"))
        else:
            judge_url = self.ctx.peer_url(self.spec.judge)
            reply = await self.ctx.http.get().post(
                f"{judge_url}/v1/responses",
                json={"model": self.spec.judge, "input": question, "metadata": {"purpose": "verify"}},
                headers={ROLLOUT_ID_HEADER: body.rollout_id, ATTEMPT_INDEX_HEADER: str(body.attempt_index)},
            )
            if reply.status_code != 200:
                return error_response(
                    502, "judge_failed", f"judge answered {reply.status_code}", key="message"
                )
            verdict = str(reply.json()["output_text"])
        return JSONResponse(
            {
                "rollout_id": body.rollout_id,
                "attempt_index": body.attempt_index,
                "revision": session.revision,
                "verdict": verdict,
                "reward": score(verdict),
            }
        )

    # -- control operations ------------------------------------------------------------------

    def _release(self) -> None:
        for session in self._held:
            if session.lock.locked():
                session.lock.release()
        self._held.clear()

    async def _prepare(self, body: CommonBody) -> dict[str, Any]:
        self.accepting = False
        until = time.monotonic() + body.budget_s(time.time())
        try:
            for session in list(self.sessions.values()):
                async with asyncio.timeout(max(0.0, until - time.monotonic())):
                    await session.lock.acquire()
                self._held.append(session)
        except TimeoutError as exc:  # as Gym: admission stays closed until a resume reopens it
            self._release()
            raise ControlRejection(
                RESOURCES_CHECKPOINT_ERROR, "could not lock every session within the budget"
            ) from exc
        except BaseException:
            self._release()
            raise
        return ResourcesPrepareReply(sessions=len(self.sessions), state="prepared").model_dump(mode="json")

    async def _status(self, q: StatusQuery) -> dict[str, Any]:
        self.fence.check_query(q.checkpoint_id, _STATUS_PHASES)
        held = {id(s) for s in self._held}
        reply = ResourcesStatusReply.model_validate(
            {
                "checkpoint_id": q.checkpoint_id,
                "state": self.admission_state(),  # real Gym: the admission state, not the fence phase
                "admission_state": self.admission_state(),
                "sessions": len(self.sessions),
                "per_session": [
                    {
                        "rollout_id": s.rollout_id,
                        "attempt_index": s.attempt_index,
                        "revision": s.revision,
                        "locked": id(s) in held,
                    }
                    for s in sorted(self.sessions.values(), key=lambda s: (s.rollout_id, s.attempt_index))
                ],
            }
        )
        return reply.model_dump(mode="json")

    async def _commit(self, body: CheckpointDirBody) -> dict[str, Any]:
        sessions = sorted(self.sessions.values(), key=lambda s: (s.rollout_id, s.attempt_index))
        documents = [s.document() for s in sessions]
        folder = resources_dir(self.instance)

        def write() -> str:
            writer = ArtifactWriter(body.checkpoint_dir, folder)
            for document in documents:
                data = (json.dumps(document, sort_keys=True) + "\n").encode("utf-8")
                writer.write(f"{document['rollout_id']}.a{document['attempt_index']}.json", data, 1)
            return writer.write_manifest(
                {
                    "schema_version": 1,
                    "component": RESOURCES,
                    "name": self.instance,
                    "checkpoint_id": body.checkpoint_id,
                    "sessions": len(documents),
                }
            )

        digest = await asyncio.to_thread(write)
        return ResourcesCommitReply(sessions=len(documents), manifest_digest=digest).model_dump(mode="json")

    async def _restore(self, body: CheckpointDirBody) -> dict[str, Any]:
        self.accepting = False  # as Gym: closed first, also when the restore is then refused
        if self.served_stateful:
            raise ControlRejection(
                UNSAFE_RESOURCES_RESTORE,
                f"{self.name} already applied mutations; restore into a fresh process",
            )
        folder = resources_dir(self.instance)
        manifest, contents = await asyncio.to_thread(read_manifest, body.checkpoint_dir, folder)
        try:
            documents = [json.loads(data) for data in contents.values()]
            restored = [
                Session(
                    rollout_id=str(d["rollout_id"]),
                    attempt_index=int(d["attempt_index"]) + 1,
                    state=str(d["state"]),
                    revision=int(d["revision"]),
                )
                for d in documents
            ]
            source_id = str(manifest["checkpoint_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlRejection(RESTORE_FAILED, f"bad resources checkpoint in {folder}: {exc!r}") from exc
        if any(not ROLLOUT_ID_RE.match(s.rollout_id) for s in restored):
            raise ControlRejection(RESTORE_FAILED, f"bad rollout id in {folder}")
        self.accepting = False
        for session in restored:
            self.sessions[(session.rollout_id, session.attempt_index)] = session
        return ResourcesRestoreReply(sessions=len(restored), source_checkpoint_id=source_id).model_dump(
            mode="json"
        )

    async def _resume(self) -> dict[str, Any]:
        self._release()
        self.accepting = True
        return ResourcesResumeReply(state="accepting").model_dump(mode="json")
