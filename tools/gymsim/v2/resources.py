"""The v2 resources server: tool sessions seeded per episode attempt.

Data plane: `POST /seed_session {episode_id, seed}` → `{session_id}` (headers
`x-ng-checkpoint-verify`, and `x-ng-checkpoint-restart: 1` in restart-only mode), `POST /step
{episode_id, session_id, action}` → `{output}`, `POST /verify {session_id}` → `{reward}` (replay
mode: always admitted), `POST /close_session {session_id}` (never refused).

Rules (Gym's `_checkpoint/resources.py`; `mode` from `checkpoint_mode`: `export_restore` →
`exported`, `stateless`, `restart_only`):
- `exported`/`stateless`: closed admission makes data requests *wait* for resume (never refused);
  blockers are requests in flight and sessions of retired rollouts still being freed; export is
  `ResourcesSessionRecord{episode_id, session_id, state}` (`state` null when stateless).
- `restart_only`: only `/seed_session` waits; every live session's episode is a restart; nothing is
  exported; a restore with records → 409.
- A retired session id is refused (`stale_attempt`) until its rollout is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol_v2 import (
    CHECKPOINT_ERROR,
    RESTART_HEADER,
    STALE_ATTEMPT,
    VERIFY_HEADER,
    EpisodeId,
    PrepareReport,
    ResourcesSessionRecord,
    episode_of_key,
)
from quiesce.tools.gymsim.common import ControlRejection
from quiesce.tools.gymsim.v2 import logic
from quiesce.tools.gymsim.v2.errors import refuse
from quiesce.tools.gymsim.v2.plane import Participant, covers, report
from quiesce.tools.gymsim.v2.server import V2Server

Mode = Literal["exported", "stateless", "restart_only"]


class SeedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    seed: str


class StepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    session_id: str
    action: str


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    session_id: str


@dataclass
class ToolSession:
    episode: EpisodeId
    state: str | None
    steps: int = 0


class ResourcesParticipant(Participant):
    kind = "resources"
    record_model = ResourcesSessionRecord

    def __init__(self, mode: Mode) -> None:
        super().__init__()
        self.mode: Mode = mode
        self.closed = False
        self.sessions: dict[str, ToolSession] = {}
        self.in_flight: dict[str, int] = {}
        self.retired_ids: dict[str, str] = {}  #: session id → rollout id, refused until forget
        self.restored_keys: set[str] = set()  #: next-attempt keys of restored sessions not used yet

    async def close_admission(self) -> None:
        self.closed = True
        self.notify()

    async def open_admission(self) -> None:
        self.closed = False
        self.notify()

    async def admitted(self, *, seed: bool) -> None:
        """Wait while admission is closed for this request (restart-only holds only seeds)."""
        if self.mode == "restart_only" and not seed:
            return
        while self.closed:
            await self.changes.wait(None)

    def readiness(self) -> PrepareReport:
        counts = {"sessions": len(self.sessions)}
        if self.mode == "restart_only":
            return report([], counts, [s.episode.capture_key for s in self.sessions.values()])
        blockers = [
            self.sessions[sid].episode.capture_key
            for sid, n in self.in_flight.items()
            if n and sid in self.sessions
        ]
        return report(blockers, counts)

    async def retire(self, episode: EpisodeId) -> None:
        for sid in [sid for sid, s in self.sessions.items() if covers(episode, s.episode)]:
            while self.in_flight.get(sid):
                await self.changes.wait(1.0)
            self.sessions.pop(sid, None)
            self.retired_ids[sid] = episode.rollout_id
            self.restored_keys.discard(episode.capture_key)

    async def forget(self, rollout_ids: list[str]) -> None:
        await super().forget(rollout_ids)
        gone = set(rollout_ids)
        self.retired_ids = {sid: r for sid, r in self.retired_ids.items() if r not in gone}

    def check_session(self, session_id: str) -> ToolSession:
        if session_id in self.retired_ids:
            raise refuse(STALE_ATTEMPT, f"session {session_id} belongs to a retired attempt")
        session = self.sessions.get(session_id)
        if session is None:
            raise ControlRejection("unknown_session", f"no session {session_id}", 404)
        return session

    def export(self, scope: list[EpisodeId] | None) -> list[dict[str, Any]]:
        if self.mode == "restart_only":
            return []
        keep = None if scope is None else {e.capture_key for e in scope}
        return [
            ResourcesSessionRecord(episode_id=s.episode, session_id=sid, state=self._state(s)).model_dump(
                mode="json"
            )
            for sid, s in sorted(self.sessions.items())
            if keep is None or s.episode.capture_key in keep
        ]

    def _state(self, session: ToolSession) -> Any:
        return None if session.state is None else {"digest": session.state, "steps": session.steps}

    async def install(self, records: list[Any], scope: list[EpisodeId]) -> None:
        if self.mode == "restart_only" and records:
            raise refuse(CHECKPOINT_ERROR, "restart-only resources restore no sessions")
        if self.sessions or any(self.in_flight.values()):
            raise refuse(CHECKPOINT_ERROR, "resources restore requires a process without sessions")
        installed: dict[str, ToolSession] = {}
        for record in records:
            state = record.state
            if state is not None and not (isinstance(state, dict) and isinstance(state.get("digest"), str)):
                raise refuse(CHECKPOINT_ERROR, f"session {record.session_id}: malformed state")
            nxt = record.episode_id.next_attempt()
            installed[record.session_id] = ToolSession(
                nxt,
                None if state is None else state["digest"],
                0 if state is None else int(state.get("steps", 0)),
            )
        self.sessions = installed
        self.restored_keys = {s.episode.capture_key for s in installed.values()}

    def restored_pending(self) -> list[EpisodeId]:
        return [episode_of_key(k) for k in sorted(self.restored_keys)]

    async def delete_restored(self, episode: EpisodeId) -> None:
        key = episode.capture_key
        for sid in [sid for sid, s in self.sessions.items() if s.episode.capture_key == key]:
            del self.sessions[sid]
        self.restored_keys.discard(key)

    def status_extra(self) -> dict[str, Any]:
        return {"mode": self.mode, "verify": "replay", "retired_sessions": len(self.retired_ids)}


class ResourcesServer(V2Server):
    kind = "resources"
    participant: ResourcesParticipant

    def make_participant(self) -> ResourcesParticipant:
        modes: dict[str, Mode] = {
            "export_restore": "exported",
            "stateless": "stateless",
            "restart_only": "restart_only",
        }
        return ResourcesParticipant(modes[self.spec.checkpoint_mode])

    @property
    def res(self) -> ResourcesParticipant:
        return self.participant

    def debug_state(self) -> dict[str, Any]:
        return {"sessions": {sid: self.res._state(s) for sid, s in self.res.sessions.items()}}

    def add_routes(self) -> None:
        app = self.app
        res = self.res

        @app.post("/seed_session")
        async def seed(body: SeedRequest) -> JSONResponse:
            try:
                res.marks.check(body.episode_id)
                await res.admitted(seed=True)
                res.marks.check(body.episode_id)
            except ControlRejection as error:
                return error.response()
            sid = f"sess-{body.episode_id.capture_key}"
            stateless = res.mode == "stateless"
            res.sessions[sid] = ToolSession(body.episode_id, None if stateless else body.seed)
            res.notify()
            headers = {VERIFY_HEADER: "replay"}
            if res.mode == "restart_only":
                headers[RESTART_HEADER] = "1"
            return JSONResponse({"session_id": sid}, headers=headers)

        @app.post("/step")
        async def step(body: StepRequest) -> JSONResponse:
            try:
                res.marks.check(body.episode_id)
                await res.admitted(seed=False)
                session = res.check_session(body.session_id)
            except ControlRejection as error:
                return error.response()
            res.in_flight[body.session_id] = res.in_flight.get(body.session_id, 0) + 1
            res.restored_keys.discard(session.episode.capture_key)
            try:
                await self.latency()
                session.state, output = logic.resources_step(session.state, body.action)
                session.steps += 1
            finally:
                res.in_flight[body.session_id] -= 1
                res.notify()
            return JSONResponse({"output": output})

        @app.post("/verify")
        async def verify(body: SessionRequest) -> JSONResponse:
            try:
                session = res.check_session(body.session_id)
            except ControlRejection as error:
                return error.response()
            return JSONResponse({"reward": int(logic.digest("reward", session.state)[:2], 16) / 255})

        @app.post("/close_session")
        async def close(body: SessionRequest) -> JSONResponse:
            closed = res.sessions.pop(body.session_id, None)
            res.in_flight.pop(body.session_id, None)
            res.notify()
            return JSONResponse({"closed": closed is not None})
