"""The v2 policy model server: a ledger of calls per episode attempt.

Data plane: `POST /v1/responses {episode_id, input}` → `{id, output}`; the output depends on the
input and on how many calls the ledger already holds for that capture key.

Rules (Gym's `_checkpoint/model.py`):
- Closed admission: a new call *waits* for resume (Gym's later model); a call already admitted runs
  on, but its response is held until resume (its ledger row stays undelivered). Nothing streams, so
  nothing blocks prepare.
- Commit requires `episode_ids` (null → 409 `checkpoint_error`) and exports one
  `ModelRecord{episode_id, rows, generation_cuts}` per scoped key holding delivered rows; the reply
  adds `staging_keys` and `staging_keys_by_episode`.
- Restore needs a fresh server that has served no call; rows are imported under the next attempt.
- An auxiliary model (`instance_role: auxiliary`, a judge) is not a participant: no control routes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol_v2 import CHECKPOINT_ERROR, EpisodeId, ModelRecord, PrepareReport
from quiesce.tools.gymsim.common import ControlRejection
from quiesce.tools.gymsim.v2 import logic
from quiesce.tools.gymsim.v2.errors import refuse
from quiesce.tools.gymsim.v2.plane import Participant, covers, report
from quiesce.tools.gymsim.v2.server import V2Server


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    episode_id: EpisodeId | None = None
    input: str


class ModelParticipant(Participant):
    kind = "model"
    record_model = ModelRecord

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.calls = 0
        self.ledger: dict[str, list[dict[str, Any]]] = {}
        self.episodes: dict[str, EpisodeId] = {}
        self.restored_cuts: list[str] = []

    async def close_admission(self) -> None:
        self.closed = True
        self.notify()

    async def open_admission(self) -> None:
        self.closed = False
        self.notify()

    async def admitted(self) -> None:
        while self.closed:
            await self.changes.wait(None)

    def readiness(self) -> PrepareReport:
        held = sum(1 for rows in self.ledger.values() for row in rows if not row["delivered"])
        return report([], {"episodes": len(self.ledger), "calls": self.calls, "held": held})

    async def retire(self, episode: EpisodeId) -> None:
        for key in [k for k, e in self.episodes.items() if covers(episode, e)]:
            self.ledger.pop(key, None)
            self.episodes.pop(key, None)

    def _rows(self, key: str) -> list[dict[str, Any]]:
        return [
            {k: row[k] for k in ("model_call_id", "request_digest", "output")}
            for row in self.ledger.get(key, [])
            if row["delivered"]
        ]

    def export(self, scope: list[EpisodeId] | None) -> list[dict[str, Any]]:
        if scope is None:
            raise refuse(
                CHECKPOINT_ERROR, "a model commit needs episode_ids (the episodes the controller continues)"
            )
        records = []
        for episode in sorted(set(scope), key=lambda e: e.capture_key):
            rows = self._rows(episode.capture_key)
            if rows:
                records.append(ModelRecord(episode_id=episode, rows=rows).model_dump(mode="json"))
        return records

    def commit_extra(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        by_episode = {
            EpisodeId.model_validate(r["episode_id"]).capture_key: sorted(
                row["model_call_id"] for row in r["rows"]
            )
            for r in records
        }
        keys = sorted({k for keys in by_episode.values() for k in keys})
        return {"staging_keys": keys, "staging_keys_by_episode": by_episode}

    async def install(self, records: list[Any], scope: list[EpisodeId]) -> None:
        if self.calls or self.ledger:
            raise refuse(CHECKPOINT_ERROR, "model restore requires a fresh server that has served no call")
        for record in records:
            nxt = record.episode_id.next_attempt()
            self.ledger[nxt.capture_key] = [dict(row) | {"delivered": True} for row in record.rows]
            self.episodes[nxt.capture_key] = nxt
            self.restored_cuts.extend(cut.model_call_id for cut in record.generation_cuts)

    def status_extra(self) -> dict[str, Any]:
        return {"restored_generation_cuts": sorted(self.restored_cuts)}


class ModelServer(V2Server):
    kind = "model"

    def make_participant(self) -> ModelParticipant | None:
        return None if self.spec.instance_role == "auxiliary" else ModelParticipant()

    def add_routes(self) -> None:
        @self.app.post("/v1/responses")
        async def responses(body: ResponsesRequest) -> JSONResponse:
            model = self.participant
            if not isinstance(model, ModelParticipant):  # a judge: stateless answers
                return JSONResponse({"id": "judge", "output": logic.model_output(body.input, 0)})
            if body.episode_id is None:
                return refuse("rollout_id_required", "a policy call names its episode").response()
            try:
                return JSONResponse(await self.respond(model, body.episode_id, body.input))
            except ControlRejection as error:
                return error.response()

    async def respond(self, model: ModelParticipant, episode: EpisodeId, prompt: str) -> dict[str, Any]:
        model.marks.check(episode)
        await model.admitted()
        model.marks.check(episode)
        key = episode.capture_key
        rows = model.ledger.setdefault(key, [])
        model.episodes[key] = episode
        model.calls += 1
        row = {
            "model_call_id": f"{key}.call-{len(rows)}",
            "request_digest": logic.digest("request", prompt),
            "output": logic.model_output(prompt, len(rows)),
            "delivered": False,
        }
        rows.append(row)
        model.notify()
        await self.latency()
        await model.admitted()  # a response computed while admission closed is held until resume
        row["delivered"] = True
        model.notify()
        return {"id": row["model_call_id"], "output": row["output"]}

    def debug_state(self) -> dict[str, Any]:
        model = self.participant
        if not isinstance(model, ModelParticipant):
            return {}
        return {"ledger": {k: len(v) for k, v in model.ledger.items()}}
