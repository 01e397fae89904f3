"""The v2 agent server: one session per episode attempt, each turn a policy call and a tool call.

Data plane: `POST /v1/turn {episode_id, turn, observation}` → `{action}`; `POST /v1/close
{episode_id}` ends the session (and its resources session). A turn of a new session seeds a
resources session (`/seed_session`); every turn calls the policy model (`/v1/responses`) and the
resources server (`/step`).

Rules (Gym's `_checkpoint/agent.py`):
- `checkpoint_mode: export_restore` (native sessions): closed admission refuses a new session 409
  `checkpoint_parked`; a turn of an existing session waits for resume. Blockers: sessions running a
  turn. Export: `AgentSessionRecord{episode_id, session_key, session}` per session in the scope.
- `checkpoint_mode: restart_only`: every live session is reported under `restarts`, nothing is
  exported, a restore with records → 409.
- Restarts reach the environment on the reply of the turn that opened the session (gymsim's agent
  seed): `x-ng-checkpoint-restart: 1` when this agent is restart-only (Gym's `RestartOnlyAgentParticipant`
  sets it on its seed reply, `seed_agent_session` in `base_responses_api_agent.py`), or when the
  resources seed reply carried it. Gym's single-agent-turn environment server reads both seed replies
  itself (`seed_restarts` in `_checkpoint/steps.py`); here the agent seeds the resources server, so it
  relays the header, and — like Gym's legacy `/run` agent, which calls `LegacyRun.mark_restart` on such
  a seed reply — marks its own session a restart: listed under `restarts`, never a blocker, never
  exported (a scope naming it → 409 `restart_in_scope`). Later turn replies carry no header (the
  environment's mark sticks), as in Gym, where only a seed reply carries it: a restart-only agent
  reports its in-flight `/run` and `/v1/responses` calls as restarts in its own prepare report
  (`RestartOnlyTrackingMiddleware`), but those replies mark nothing.
- Marks change no report already given: a session is marked while its opening turn runs, and a
  session being opened (its resources seed in flight) or running unmarked blocks prepare, as Gym's
  `AgentSessionParticipant.seeding` does; a new session is refused while admission is closed.
- Restore needs no live sessions; sessions come back under the next-attempt key.
- A request of a retired attempt is 409 `stale_attempt`; a missing rollout id is 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol_v2 import (
    CHECKPOINT_ERROR,
    CHECKPOINT_PARKED,
    RESTART_HEADER,
    AgentSessionRecord,
    EpisodeId,
    PrepareReport,
    episode_of_key,
)
from quiesce.tools.gymsim.common import ControlRejection
from quiesce.tools.gymsim.v2 import logic
from quiesce.tools.gymsim.v2.errors import refuse
from quiesce.tools.gymsim.v2.plane import Participant, covers, report
from quiesce.tools.gymsim.v2.server import DownstreamError, V2Server


class TurnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    turn: int = 0
    observation: str


class CloseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId


@dataclass
class Session:
    episode: EpisodeId
    digest: str
    resources_session: str | None
    turns: int = 0
    running: bool = False
    #: the resources seed reply said it cannot capture its session: a restart (module docstring)
    restart: bool = False

    def dump(self) -> dict[str, Any]:
        return {"digest": self.digest, "resources_session": self.resources_session, "turns": self.turns}


class AgentParticipant(Participant):
    kind = "agent"
    record_model = AgentSessionRecord

    def __init__(self, *, restart_only: bool) -> None:
        super().__init__()
        self.restart_only = restart_only
        self.accepting = True
        self.sessions: dict[str, Session] = {}
        self.restored: dict[str, Session] = {}
        #: capture keys whose session is being opened (its resources seed in flight): blockers, so a
        #: session never appears, or turns out a restart, after a prepare reported without it
        self.seeding: set[str] = set()

    async def close_admission(self) -> None:
        self.accepting = False
        self.notify()

    async def open_admission(self) -> None:
        self.accepting = True
        self.notify()

    def readiness(self) -> PrepareReport:
        if self.restart_only:
            return report([], {"sessions": len(self.sessions)}, list(self.sessions))
        running = [k for k, s in self.sessions.items() if s.running and not s.restart]
        running += sorted(self.seeding)
        restarts = [k for k, s in self.sessions.items() if s.restart]
        counts = {"sessions": len(self.sessions), "restored_pending": len(self.restored)}
        return report(running, counts, restarts)

    async def retire(self, episode: EpisodeId) -> None:
        for key in [k for k, s in self.sessions.items() if covers(episode, s.episode)]:
            while key in self.sessions and self.sessions[key].running:
                await self.changes.wait(1.0)
            self.sessions.pop(key, None)
        for key in [k for k in self.restored if covers(episode, episode_of_key(k))]:
            del self.restored[key]

    def export(self, scope: list[EpisodeId] | None) -> list[dict[str, Any]]:
        if self.restart_only:
            return []
        keep = None if scope is None else {e.capture_key for e in scope}
        held = {**self.sessions, **self.restored}
        return [
            AgentSessionRecord(
                episode_id=episode_of_key(key), session_key=key, session=held[key].dump()
            ).model_dump(mode="json")
            for key in sorted(held)
            if (keep is None or key in keep) and not held[key].restart
        ]

    async def install(self, records: list[Any], scope: list[EpisodeId]) -> None:
        if self.restart_only and records:
            raise refuse(CHECKPOINT_ERROR, "a restart-only agent restores no sessions")
        if self.sessions or self.restored:
            raise refuse(CHECKPOINT_ERROR, "agent restore requires a process without live sessions")
        restored: dict[str, Session] = {}
        for record in records:
            session = record.session
            if not (isinstance(session, dict) and isinstance(session.get("digest"), str)):
                raise refuse(CHECKPOINT_ERROR, f"agent session {record.session_key} is malformed")
            nxt = record.episode_id.next_attempt()
            restored[nxt.capture_key] = Session(
                nxt, session["digest"], session.get("resources_session"), int(session.get("turns", 0))
            )
        self.restored = restored

    def restored_pending(self) -> list[EpisodeId]:
        return [episode_of_key(k) for k in self.restored]

    async def delete_restored(self, episode: EpisodeId) -> None:
        self.restored.pop(episode.capture_key, None)

    def status_extra(self) -> dict[str, Any]:
        return {"accepting": self.accepting}


class AgentServer(V2Server):
    kind = "agent"
    participant: AgentParticipant

    def make_participant(self) -> AgentParticipant:
        return AgentParticipant(restart_only=self.spec.checkpoint_mode == "restart_only")

    @property
    def agent(self) -> AgentParticipant:
        return self.participant

    def add_routes(self) -> None:
        app = self.app

        @app.post("/v1/turn")
        async def turn(body: TurnRequest) -> JSONResponse:
            try:
                action, restart = await self.turn(body)
            except (ControlRejection, DownstreamError) as error:
                return error.response()
            return JSONResponse({"action": action}, headers={RESTART_HEADER: "1"} if restart else None)

        @app.post("/v1/close")
        async def close(body: CloseRequest) -> JSONResponse:
            session = self.agent.sessions.pop(body.episode_id.capture_key, None)
            self.agent.notify()
            if session is not None and session.resources_session is not None and self.spec.resources:
                try:
                    await self.call(
                        self.spec.resources,
                        "/close_session",
                        {"session_id": session.resources_session},
                        body.episode_id,
                    )
                except DownstreamError as error:
                    return error.response()
            return JSONResponse({"closed": session is not None})

    def debug_state(self) -> dict[str, Any]:
        return {
            "sessions": {k: s.dump() | {"running": s.running} for k, s in self.agent.sessions.items()},
            "restored_pending": sorted(self.agent.restored),
        }

    async def _session(self, episode: EpisodeId, observation: str) -> tuple[Session, bool]:
        """The episode's session, and whether this turn opened it (gymsim's agent seed)."""
        agent = self.agent
        key = episode.capture_key
        session = agent.sessions.get(key)
        if session is not None:
            while not agent.accepting:
                await agent.changes.wait(None)
            return session, False
        if not agent.accepting:
            raise refuse(CHECKPOINT_PARKED, "agent admission is closed for a checkpoint")
        session = agent.restored.pop(key, None)
        if session is None:
            resources_session = None
            restart = False
            if self.spec.resources is not None:
                agent.seeding.add(key)
                agent.notify()
                try:
                    reply = await self.call(
                        self.spec.resources,
                        "/seed_session",
                        {"episode_id": episode.model_dump(), "seed": logic.resources_seed(observation)},
                        episode,
                    )
                finally:
                    agent.seeding.discard(key)
                resources_session = str(reply.json()["session_id"])
                restart = reply.headers.get(RESTART_HEADER) == "1"
            session = Session(episode, logic.initial_session(observation), resources_session, restart=restart)
        agent.sessions[key] = session
        agent.notify()
        return session, True

    async def turn(self, body: TurnRequest) -> tuple[str, bool]:
        """One turn: (the action, whether the reply carries `x-ng-checkpoint-restart: 1`)."""
        agent = self.agent
        agent.marks.check(body.episode_id)
        session, opened = await self._session(body.episode_id, body.observation)
        restart = opened and (agent.restart_only or session.restart)
        agent.marks.check(body.episode_id)
        session.running = True
        agent.notify()
        try:
            await self.latency()
            prompt = logic.agent_prompt(session.digest, body.observation)
            policy = self.spec.policy
            assert policy is not None
            reply = await self.call(
                policy,
                "/v1/responses",
                {"episode_id": body.episode_id.model_dump(), "input": prompt},
                body.episode_id,
            )
            output = str(reply.json()["output"])
            tool = logic.resources_step(None, output)[1]
            if self.spec.resources is not None and session.resources_session is not None:
                step = await self.call(
                    self.spec.resources,
                    "/step",
                    {
                        "episode_id": body.episode_id.model_dump(),
                        "session_id": session.resources_session,
                        "action": output,
                    },
                    body.episode_id,
                )
                tool = str(step.json()["output"])
            session.digest, action = logic.agent_update(session.digest, output, tool)
            session.turns += 1
            return action, restart
        finally:
            session.running = False
            agent.notify()
