"""The v2 environment server: it owns episodes and records a boundary after every turn.

Data plane: `POST /run {episode_id, task, paced}` runs one episode to its end and answers
`{episode_id, capture_key, result, turns, continued_from}`. Each turn calls the agent's `/v1/turn`
(which calls the policy model and the resources server); between turns the episode is at a
boundary `{turn, state, turns}`.

Rules (Gym's `_checkpoint/environment.py` and `steps.py`):
- Closed admission: a new `/run` gets 409 `checkpoint_parked`; running episodes park at their next
  boundary. Blockers are episodes mid-turn (and retired ones not yet stopped).
- Restarts: an agent turn reply with `x-ng-checkpoint-restart: 1` marks the episode a restart for
  good — listed under `restarts`, never a blocker (unless retired), never exported, so a commit with
  no scope leaves it out and one whose scope names it is refused 409 `restart_in_scope`. The reply
  that carries it is the one of the turn that opened the agent's session — gymsim's seed: the agent
  sets it when it is restart-only, and relays it from a restart-only resources server's
  `/seed_session` reply. Gym's single-agent-turn environment server does the same from its own two
  seed replies (`seed_restarts`, then `checkpoint_restart`, which ends in `EpisodeSteps.mark_restart`
  of `_checkpoint/steps.py`). Gym marks only while no checkpoint is open, so the restarts a prepare
  reported never change during it; here a turn is a wait step, so an unmarked episode mid-turn
  blocks prepare and is marked before the environment can report prepared — the same guarantee.
- After a restore a restart has no record: its replacement attempt starts over from its task (turn
  0), and, a result being a pure function of its task (`logic.py`), still finishes with it.
- Export: every live episode that is not a restart, at its boundary, plus restored-but-unstarted
  records in the scope.
- Restore needs no live episodes; records are held under the next-attempt key (`restored_pending`)
  until that attempt's `/run` starts and continues from the boundary; a different task → 409.
- `paced: true` episodes wait at each boundary until the trainer grants turns
  (`POST /gymsim/admin/episodes/advance`); `hold` keeps an episode mid-turn (a blocker) until `release`.
- Multi-worker (`workers: N` > 1, `worker_mode: coordinator`): N worker tables, each closed and
  reporting on its own; an episode runs on the least-loaded worker. The coordinator's merged report,
  status and manifest extras are `workers.py`'s (Gym's `_checkpoint/participant_workers.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from fastapi import Body
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol_v2 import (
    CHECKPOINT_ERROR,
    CHECKPOINT_PARKED,
    RESTART_HEADER,
    STALE_ATTEMPT,
    EnvironmentRecord,
    EpisodeId,
    PrepareReport,
    episode_of_key,
)
from quiesce.tools.gymsim.common import ControlRejection
from quiesce.tools.gymsim.v2 import logic
from quiesce.tools.gymsim.v2.errors import refuse
from quiesce.tools.gymsim.v2.plane import Participant, covers, report
from quiesce.tools.gymsim.v2.server import DownstreamError, V2Server


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    task: Any = None
    paced: bool = False


class _Retired(Exception):
    """The episode was retired while it ran."""


class _ShuttingDown(Exception):
    """The server is stopping: its episodes end without a result (503)."""


@dataclass
class Episode:
    """One live attempt on one worker."""

    episode: EpisodeId
    task_digest: str
    turns: int
    turn: int
    state: str
    worker: int
    continued_from: int | None = None
    allowed: int | None = None  #: paced: turns granted so far (None: free running)
    mid_turn: bool = False
    held: bool = False
    restart: bool = False
    retired: bool = False
    turn_task: asyncio.Task[tuple[str, bool]] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def key(self) -> str:
        return self.episode.capture_key

    def boundary(self) -> dict[str, Any]:
        return {"turn": self.turn, "state": self.state, "turns": self.turns}


class EnvironmentParticipant(Participant):
    kind = "environment"
    record_model = EnvironmentRecord

    def __init__(self, workers: int = 1) -> None:
        super().__init__()
        self.workers = workers
        self.closed = [False] * workers
        self.live: dict[str, Episode] = {}
        self.restored: dict[str, EnvironmentRecord] = {}
        self.shutting_down = False

    # -- data plane --------------------------------------------------------------------------

    def begin(self, episode: EpisodeId, task: Any, *, paced: bool) -> Episode:
        """Register a starting attempt (continuing its restored boundary, if one is held)."""
        self.marks.check(episode)
        key = episode.capture_key
        if key in self.live:
            raise refuse(CHECKPOINT_ERROR, f"episode {key} is already running")
        worker = min(range(self.workers), key=lambda w: (self._load(w), w))
        if self.closed[worker]:
            raise refuse(CHECKPOINT_PARKED, "episode admission is closed for a checkpoint")
        digest = logic.task_digest(task)
        record = self.restored.get(key)
        ep = Episode(episode, digest, logic.turns_of(task), 0, logic.initial_state(task), worker)
        if record is not None:
            if record.task_digest != digest:
                raise refuse(CHECKPOINT_ERROR, f"episode {key} continues a checkpoint of a different task")
            boundary = record.boundary
            if not (isinstance(boundary, dict) and isinstance(boundary.get("turn"), int)):
                raise refuse(CHECKPOINT_ERROR, f"episode {key}: restored boundary is malformed")
            del self.restored[key]
            ep.turn, ep.state, ep.continued_from = boundary["turn"], str(boundary["state"]), boundary["turn"]
        ep.allowed = ep.turn if paced else None
        self.live[key] = ep
        self.notify()
        return ep

    def _load(self, worker: int) -> int:
        return sum(1 for ep in self.live.values() if ep.worker == worker)

    def end(self, ep: Episode) -> None:
        if self.live.get(ep.key) is ep:
            del self.live[ep.key]
        ep.done.set()
        self.notify()

    async def at_boundary(self, ep: Episode) -> None:
        """Wait until the episode may start its next turn: admission open, a turn granted."""
        while True:
            if ep.retired:
                raise _Retired()
            if self.shutting_down:
                raise _ShuttingDown()
            parked = self.closed[ep.worker] or (ep.allowed is not None and ep.turn >= ep.allowed)
            if not parked:
                return
            await self.changes.wait(None)

    async def released(self, ep: Episode) -> None:
        while ep.held and not ep.retired and not self.shutting_down:
            await self.changes.wait(None)

    # -- participant -------------------------------------------------------------------------

    async def close_admission(self) -> None:
        self.closed = [True] * self.workers
        self.notify()

    async def open_admission(self) -> None:
        self.closed = [False] * self.workers
        self.notify()

    def _worker_report(self, worker: int) -> PrepareReport:
        mine = [ep for ep in self.live.values() if ep.worker == worker]
        blockers = [ep.key for ep in mine if (ep.mid_turn or ep.retired) and not ep.restart]
        restarts = [ep.key for ep in mine if ep.restart]
        return report(blockers, {"episodes": len(mine)}, restarts)

    def readiness(self) -> PrepareReport:
        parts = [self._worker_report(w) for w in range(self.workers)]
        blockers = [ep.key for ep in self.live.values() if (ep.mid_turn or ep.retired) and not ep.restart]
        counts = {
            "episodes": sum(p.counts["episodes"] for p in parts),
            "restored_pending": len(self.restored),
        }
        return report(blockers, counts, [k for p in parts for k in p.restarts])

    async def retire(self, episode: EpisodeId) -> None:
        for ep in [ep for ep in self.live.values() if covers(episode, ep.episode)]:
            ep.retired = True
            if ep.turn_task is not None:
                ep.turn_task.cancel()
            self.notify()
            await ep.done.wait()
        for key in [k for k in self.restored if covers(episode, episode_of_key(k))]:
            del self.restored[key]

    def export(self, scope: list[EpisodeId] | None) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for ep in sorted(self.live.values(), key=lambda e: e.key):
            if ep.restart:
                continue
            record = EnvironmentRecord(
                episode_id=ep.episode, task_digest=ep.task_digest, boundary=ep.boundary()
            )
            records.append(record.model_dump(mode="json"))
        keep = None if scope is None else {e.capture_key for e in scope}
        for key in sorted(self.restored):
            if keep is None or key in keep:
                records.append(
                    self.restored[key].model_dump(mode="json")
                    | {"episode_id": episode_of_key(key).model_dump()}
                )
        return records

    async def install(self, records: list[Any], scope: list[EpisodeId]) -> None:
        if self.live or self.restored:
            raise refuse(CHECKPOINT_ERROR, "environment restore requires a process without live episodes")
        self.restored = {r.episode_id.next_attempt().capture_key: r for r in records}

    def restored_pending(self) -> list[EpisodeId]:
        return [episode_of_key(k) for k in self.restored]

    async def delete_restored(self, episode: EpisodeId) -> None:
        self.restored.pop(episode.capture_key, None)

    def status_extra(self) -> dict[str, Any]:
        return {"restored_pending": sorted(self.restored)}


class EnvironmentServer(V2Server):
    kind = "environment"
    participant: EnvironmentParticipant

    def make_participant(self) -> EnvironmentParticipant:
        if self.spec.worker_mode == "coordinator" and self.spec.workers > 1:
            from quiesce.tools.gymsim.v2.workers import CoordinatedEnvironment  # it subclasses this module's

            return CoordinatedEnvironment(self.spec.workers)
        return EnvironmentParticipant()

    @property
    def env(self) -> EnvironmentParticipant:
        return self.participant

    def add_routes(self) -> None:
        app = self.app

        @app.post("/run")
        async def run(body: RunRequest) -> JSONResponse:
            return await self.run_episode(body)

        @app.get("/gymsim/admin/episodes")
        async def episodes() -> JSONResponse:
            return JSONResponse(self.episodes())

        @app.post("/gymsim/admin/episodes/advance")
        async def advance(
            rollout_ids: list[str] | None = Body(default=None, embed=True),  # noqa: B008
            turns: int = Body(default=1, embed=True, ge=0),
        ) -> JSONResponse:
            for ep in self._select(rollout_ids):
                if ep.allowed is not None:
                    ep.allowed += turns
            self.env.notify()
            return JSONResponse(self.episodes())

        @app.post("/gymsim/admin/episodes/unpace")
        async def unpace(rollout_ids: list[str] | None = Body(default=None, embed=True)) -> JSONResponse:  # noqa: B008
            for ep in self._select(rollout_ids):
                ep.allowed = None
            self.env.notify()
            return JSONResponse(self.episodes())

        @app.post("/gymsim/admin/episodes/hold")
        async def hold(rollout_ids: list[str] = Body(embed=True)) -> JSONResponse:  # noqa: B008
            self.held.update(rollout_ids)
            return JSONResponse({"held": sorted(self.held)})

        @app.post("/gymsim/admin/episodes/release")
        async def release(rollout_ids: list[str] | None = Body(default=None, embed=True)) -> JSONResponse:  # noqa: B008
            self.held.difference_update(self.held if rollout_ids is None else rollout_ids)
            for ep in self.env.live.values():
                ep.held = ep.episode.rollout_id in self.held
            self.env.notify()
            return JSONResponse({"held": sorted(self.held)})

    held: set[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.held = set()
        super().__init__(*args, **kwargs)

    def _select(self, rollout_ids: list[str] | None) -> list[Episode]:
        return [
            ep for ep in self.env.live.values() if rollout_ids is None or ep.episode.rollout_id in rollout_ids
        ]

    def episodes(self) -> dict[str, Any]:
        return {
            ep.key: {
                "rollout_id": ep.episode.rollout_id,
                "attempt": ep.episode.attempt,
                "turn": ep.turn,
                "turns": ep.turns,
                "allowed": ep.allowed,
                "mid_turn": ep.mid_turn,
                "held": ep.held,
                "restart": ep.restart,
                "worker": ep.worker,
            }
            for ep in self.env.live.values()
        }

    def debug_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"episodes": self.episodes()}
        worker_reports = getattr(self.env, "worker_reports", None)  # the coordinator's (workers.py)
        if worker_reports is not None:
            state["worker_reports"] = worker_reports()
        return state

    async def run_episode(self, body: RunRequest) -> JSONResponse:
        env = self.env
        try:
            ep = env.begin(body.episode_id, body.task, paced=body.paced)
        except ControlRejection as rejection:
            return rejection.response()
        try:
            while ep.turn < ep.turns:
                await env.at_boundary(ep)
                ep.held = ep.episode.rollout_id in self.held
                ep.mid_turn = True
                env.notify()
                ep.turn_task = asyncio.create_task(self._turn(ep))
                try:
                    action, restart = await ep.turn_task
                except asyncio.CancelledError:
                    if ep.retired:
                        raise _Retired() from None
                    if env.shutting_down:
                        raise _ShuttingDown() from None
                    raise
                finally:
                    ep.turn_task = None
                    ep.mid_turn = False
                ep.restart = ep.restart or restart
                ep.state = logic.env_step(ep.state, ep.turn, action)
                ep.turn += 1
                env.notify()
            if self.spec.agent is not None:
                with contextlib.suppress(DownstreamError):
                    await self.call(
                        self.spec.agent, "/v1/close", {"episode_id": ep.episode.model_dump()}, ep.episode
                    )
            return JSONResponse(
                {
                    "episode_id": ep.episode.model_dump(),
                    "capture_key": ep.key,
                    "result": ep.state,
                    "turns": ep.turns,
                    "continued_from": ep.continued_from,
                }
            )
        except _Retired:
            return refuse(STALE_ATTEMPT, f"episode {ep.key} was retired").response()
        except _ShuttingDown:
            return JSONResponse(
                {"error": {"code": "shutting_down", "detail": "server stopping"}}, status_code=503
            )
        except DownstreamError as error:
            return error.response()
        finally:
            env.end(ep)

    async def _turn(self, ep: Episode) -> tuple[str, bool]:
        """One turn: wait while held, then ask the agent for its action (and whether it restarts)."""
        await self.env.released(ep)
        if self.spec.agent is None:
            return logic.digest("no-agent", ep.state)[:24], False
        reply = await self.call(
            self.spec.agent,
            "/v1/turn",
            {"episode_id": ep.episode.model_dump(), "turn": ep.turn, "observation": ep.state},
            ep.episode,
        )
        return str(reply.json()["action"]), reply.headers.get(RESTART_HEADER) == "1"

    async def aclose(self) -> None:
        self.env.shutting_down = True
        self.env.notify()
        for ep in list(self.env.live.values()):
            if ep.turn_task is not None:
                ep.turn_task.cancel()
        await super().aclose()
