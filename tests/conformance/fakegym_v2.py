"""A tiny participant of Gym's unified control plane (v2) for the v2 checker's own tests, with
switchable faults.

Independent of `tools/gymsim` on purpose: the checker must be proven against a server whose every
deviation is known. It keeps the phase machine of Gym's `_checkpoint/control.py` (replay of prepare
and commit, the resumed-id fence, conflicts, leases with a watcher, retire marks, deadlines,
validation before auth) for one participant holding a few live episodes, writes the storage
layout on commit, and never restores (restores go into fresh servers; it answers 422
`invalid_checkpoint_state` for a folder without a manifest). Each fault breaks exactly one rule:

- `no_auth` — the bearer token is not checked;
- `accept_extra` — unknown body fields (and so `schema_version`) are accepted;
- `loose_episodes` — episode ids are not validated (a `-a1` suffix, a negative attempt, extras);
- `no_replay` — a prepare is not recorded (a repeat is refused `invalid_phase`);
- `no_conflict` — a second id while one is active is not refused;
- `never_fence` — resume does not remember the id (no `stale_checkpoint` afterwards);
- `wrong_digest` — the manifest's `records_sha256` is not the file's;
- `unsorted_manifest` — the manifest is written without sorted keys;
- `capture_key_records` — a record's `episode_id` is a capture-key string;
- `no_staging_keys` — a model's commit reply lacks `staging_keys`;
- `lease_shrinks` — renew sets the lease from the deadline it was given, even an earlier one;
- `ignore_deadline` — a passed deadline is not refused;
- `keeps_marks` — forget leaves the retire marks;
- `no_lease_expiry` — nothing resumes a participant whose lease expired;
- `nan_500` — a non-finite deadline raises (uvicorn answers 500 and closes the connection: real Gym);
- `missing_extras` — the status lacks its kind's fields;
- `null_scope_ok` — a model accepts a commit with `episode_ids: null`;
- `retire_anywhere` — retire and forget are allowed while a checkpoint is open;
- `second_write` — a commit retry into another dir writes there again;
- `slow_commit` — a commit in phase prepared waits for `released` (to cancel a checker mid-call).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StringConstraints, ValidationError

from quiesce.coordinator.protocol_v2 import PREFIX, EpisodeId, capture_key_of, episode_of_key

FAULTS_V2 = frozenset(
    {
        "no_auth",
        "accept_extra",
        "loose_episodes",
        "no_replay",
        "no_conflict",
        "never_fence",
        "wrong_digest",
        "unsorted_manifest",
        "capture_key_records",
        "no_staging_keys",
        "lease_shrinks",
        "ignore_deadline",
        "keeps_marks",
        "no_lease_expiry",
        "nan_500",
        "missing_extras",
        "null_scope_ok",
        "retire_anywhere",
        "second_write",
        "slow_commit",
    }
)

Id = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class _Body(BaseModel):
    """Every request's fields; `episode_ids` are checked on their own (`loose_episodes`)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_id: Id
    deadline_ts: FiniteFloat


class _Dir(_Body):
    checkpoint_dir: NonEmpty


class _Commit(_Dir):
    episode_ids: list[Any] | None = None
    stop: bool = False


class _Restore(_Dir):
    episode_ids: list[Any]


class _Retire(_Body):
    episode_ids: Annotated[list[Any], Field(min_length=1)]


class _Forget(_Body):
    rollout_ids: Annotated[list[str], Field(min_length=1)]


_MODELS: dict[str, type[_Body]] = {
    "prepare": _Body,
    "renew": _Body,
    "resume": _Body,
    "commit": _Commit,
    "restore": _Restore,
    "retire": _Retire,
    "forget": _Forget,
}
_LOOSE: dict[str, type[_Body]] = {
    op: type(f"Loose{model.__name__}", (model,), {"model_config": ConfigDict(extra="ignore")})
    for op, model in _MODELS.items()
}


class _LooseEpisode(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rollout_id: str
    attempt: int = 0

    @property
    def capture_key(self) -> str:
        return capture_key_of(self.rollout_id, self.attempt)


class ControlError(Exception):
    def __init__(self, code: str, detail: str, status: int = 409) -> None:
        super().__init__(detail)
        self.code, self.detail, self.status = code, detail, status

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"code": self.code, "detail": self.detail}}, status_code=self.status)


class FakeGymV2:
    """State of one fake v2 participant; `app` serves it."""

    def __init__(
        self,
        kind: str,
        instance: str,
        token: str,
        *,
        faults: frozenset[str] = frozenset(),
        grace_s: float = 600.0,
        live: tuple[str, ...] = ("r1", "r2-a1"),
    ) -> None:
        unknown = faults - FAULTS_V2
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self.kind, self.instance, self.token = kind, instance, token
        self.faults = faults
        self.grace_s = grace_s
        self.live = [episode_of_key(key) for key in live]
        self.phase = "idle"
        self.checkpoint_id: str | None = None
        self.lease: float | None = None
        self.resumed: OrderedDict[str, None] = OrderedDict()
        self.results: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
        self.marks: dict[str, int] = {}
        self.writes: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.released = threading.Event()
        self.commit_waiting = threading.Event()
        self._lease_task: asyncio.Task[None] | None = None
        self.app = self._build()

    # -- HTTP ------------------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        if "no_auth" in self.faults:
            return True
        header = request.headers.get("authorization", "")
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())

    def _build(self) -> FastAPI:
        app = FastAPI()
        unauthorized = ControlError("unauthorized", "missing or invalid bearer token", 401)

        @app.get(PREFIX + "/status")
        async def status(request: Request) -> Any:
            if not self._authorized(request):
                return unauthorized.response()
            return self.status()

        for op in _MODELS:
            self._add_post(app, op, unauthorized)
        return app

    def _add_post(self, app: FastAPI, op: str, unauthorized: ControlError) -> None:
        model = (_LOOSE if "accept_extra" in self.faults else _MODELS)[op]

        @app.post(f"{PREFIX}/{op}")
        async def handler(request: Request) -> Any:
            raw = await request.body()
            try:
                document = json.loads(raw)
                if "nan_500" in self.faults and not math.isfinite(float(document.get("deadline_ts", 0))):
                    raise RuntimeError("cannot render a non-finite input")  # uvicorn: 500, connection closed
                body = model.model_validate(document)
                episodes = self._episodes(getattr(body, "episode_ids", None))
            except ValidationError as exc:
                detail = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
                return JSONResponse({"detail": detail}, status_code=422)
            except (ValueError, TypeError, AttributeError) as exc:
                return JSONResponse(
                    {"detail": [{"type": "json_invalid", "loc": ["body"], "msg": str(exc)}]}, 422
                )
            if not self._authorized(request):  # validation first, as real Gym
                return unauthorized.response()
            if op == "commit" and "slow_commit" in self.faults and self.phase == "prepared":
                self.commit_waiting.set()
                await anyio.to_thread.run_sync(self.released.wait)
            try:
                return await getattr(self, op)(body, episodes)
            except ControlError as error:
                return error.response()

    def _episodes(self, raw: list[Any] | None) -> list[Any] | None:
        if raw is None:
            return None
        model: type[BaseModel] = _LooseEpisode if "loose_episodes" in self.faults else EpisodeId
        return [model.model_validate(item) for item in raw]

    # -- phase machine ---------------------------------------------------------------------------

    def _admit(self, checkpoint_id: str, allowed: set[str]) -> None:
        if checkpoint_id in self.resumed:
            raise ControlError("stale_checkpoint", f"{checkpoint_id} was resumed")
        if self.checkpoint_id not in (None, checkpoint_id) and "no_conflict" not in self.faults:
            raise ControlError("checkpoint_conflict", f"{self.checkpoint_id} is active")
        if self.phase not in allowed:
            raise ControlError("invalid_phase", f"not valid in phase {self.phase}")

    def _within(self, body: _Body) -> None:
        if body.deadline_ts <= time.time() and "ignore_deadline" not in self.faults:
            raise ControlError("deadline_exceeded", "deadline passed")

    def _renew(self, body: _Body) -> None:
        expires = body.deadline_ts + self.grace_s
        self.lease = expires if "lease_shrinks" in self.faults else max(self.lease or 0.0, expires)
        if "no_lease_expiry" not in self.faults and (self._lease_task is None or self._lease_task.done()):
            self._lease_task = asyncio.get_running_loop().create_task(self._watch(body.checkpoint_id))

    async def _watch(self, checkpoint_id: str) -> None:
        while self.lease is not None and self.checkpoint_id == checkpoint_id:
            remaining = self.lease - time.time()
            if remaining > 0:
                await asyncio.sleep(remaining)
                continue
            self._reopen(checkpoint_id)

    def _reopen(self, checkpoint_id: str) -> None:
        if "never_fence" not in self.faults:
            self.resumed[checkpoint_id] = None
            while len(self.resumed) > 64:
                self.resumed.popitem(last=False)
        self.results = {k: v for k, v in self.results.items() if k[0] != checkpoint_id}
        self.writes.pop(checkpoint_id, None)
        self.phase, self.checkpoint_id, self.lease = "idle", None, None
        task, self._lease_task = self._lease_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def report(self) -> dict[str, Any]:
        return {
            "ready": True,
            "blockers": [],
            "blocker_count": 0,
            "counts": {"episodes": len(self.live)},
            "restarts": [],
        }

    def status(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, Any]] = {
            "environment": {"restored_pending": []},
            "agent": {"accepting": self.phase == "idle"},
            "resources": {"mode": "exported", "verify": "wait", "retired_sessions": 0},
            "model": {"restored_generation_cuts": []},
        }
        extras = by_kind[self.kind]
        return {
            "kind": self.kind,
            "instance": self.instance,
            "phase": self.phase,
            "checkpoint_id": self.checkpoint_id,
            "lease_expires_at": self.lease,
            "retired_rollouts": len(self.marks),
            "report": self.report(),
            **({} if "missing_extras" in self.faults else extras),
        }

    async def prepare(self, body: _Body, _: Any) -> dict[str, Any]:
        recorded = self.results.get((body.checkpoint_id, "prepare"))
        if recorded is not None:
            return recorded[1]
        self._admit(body.checkpoint_id, {"idle", "preparing"})
        self.checkpoint_id, self.phase = body.checkpoint_id, "prepared"
        self._renew(body)
        result = {"phase": self.phase, "report": self.report()}
        if "no_replay" not in self.faults:
            self.results[(body.checkpoint_id, "prepare")] = (None, result)
        return result

    async def renew(self, body: _Body, _: Any) -> dict[str, Any]:
        self._admit(body.checkpoint_id, {"preparing", "prepared", "committed", "restored"})
        self._renew(body)
        return {"lease_expires_at": self.lease}

    async def commit(self, body: _Commit, episodes: list[Any] | None) -> dict[str, Any]:
        scope = None if episodes is None else tuple(sorted(e.capture_key for e in episodes))
        arguments = (body.checkpoint_dir, scope)
        recorded = self.results.get((body.checkpoint_id, "commit"))
        if recorded is not None and "second_write" not in self.faults:
            if recorded[0] != arguments:
                raise ControlError("checkpoint_conflict", "already committed with another dir or scope")
            return recorded[1]
        if recorded is None:
            self._admit(body.checkpoint_id, {"prepared"})
        self._renew(body)
        self._within(body)
        if self.kind == "model" and episodes is None and "null_scope_ok" not in self.faults:
            raise ControlError("checkpoint_error", "a model commit requires episode_ids")
        records = self._records(scope)
        manifest = self._write(Path(body.checkpoint_dir), body.checkpoint_id, records)
        result: dict[str, Any] = {
            "phase": "committed",
            "manifest": manifest,
            "episode_ids": sorted({capture_key_of(**r["episode_id"]) for r in records}),
        }
        if self.kind == "model" and "no_staging_keys" not in self.faults:
            by_episode = {
                capture_key_of(**r["episode_id"]): [row["staging_key"] for row in r["rows"]] for r in records
            }
            result["staging_keys"] = sorted({k for keys in by_episode.values() for k in keys})
            result["staging_keys_by_episode"] = by_episode
        self.phase = "committed"
        self.results[(body.checkpoint_id, "commit")] = (arguments, result)
        return result

    def _records(self, scope: tuple[str, ...] | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for episode in self.live:
            key, ident = episode.capture_key, episode.model_dump()
            if self.kind == "environment":
                digest = hashlib.sha256(json.dumps({"task": key}, sort_keys=True).encode()).hexdigest()
                out.append({"episode_id": ident, "task_digest": digest, "boundary": {"turn": 1}})
            elif self.kind == "agent":
                out.append({"episode_id": ident, "session_key": f"s-{key}", "session": {"turn": 1}})
            elif self.kind == "resources":
                out.append({"episode_id": ident, "session_id": f"sess-{key}", "state": {"n": 1}})
            elif scope is not None and key in scope:
                out.append(
                    {"episode_id": ident, "rows": [{"staging_key": f"k-{key}"}], "generation_cuts": []}
                )
        return out

    def _write(
        self, checkpoint_dir: Path, checkpoint_id: str, records: list[dict[str, Any]]
    ) -> dict[str, Any]:
        folder = checkpoint_dir / "gym" / self.kind / self.instance
        folder.mkdir(parents=True, exist_ok=True)
        if "capture_key_records" in self.faults:
            records = [{**r, "episode_id": capture_key_of(**r["episode_id"])} for r in records]
        data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
        digest = hashlib.sha256(data).hexdigest()
        name = f"records-{digest}.jsonl"
        (folder / name).write_bytes(data)
        manifest = {
            "schema_version": 1,
            "kind": self.kind,
            "instance": self.instance,
            "checkpoint_id": checkpoint_id,
            "records_file": name,
            "records_sha256": hashlib.sha256(data + b"x").hexdigest()
            if "wrong_digest" in self.faults
            else digest,
            "record_count": len(records),
        }
        sort = "unsorted_manifest" not in self.faults
        (folder / "manifest.json").write_bytes(json.dumps(manifest, sort_keys=sort, indent=1).encode())
        return manifest

    async def restore(self, body: _Restore, _: Any) -> dict[str, Any]:
        self._admit(body.checkpoint_id, {"idle"})
        self._within(body)
        manifest = Path(body.checkpoint_dir) / "gym" / self.kind / self.instance / "manifest.json"
        raise ControlError("invalid_checkpoint_state", f"missing manifest {manifest}", 422)

    async def resume(self, body: _Body, _: Any) -> dict[str, Any]:
        if body.checkpoint_id in self.resumed:
            return {"phase": "idle", "idempotent": True}
        if self.phase == "idle" and self.checkpoint_id is None:
            self._reopen(body.checkpoint_id)
            return {"phase": "idle", "idempotent": True}
        self._admit(body.checkpoint_id, {"preparing", "prepared", "committed", "restored"})
        self._reopen(body.checkpoint_id)
        return {"phase": "idle", "idempotent": False}

    def _outside_checkpoint(self, body: _Body) -> None:
        if self.phase not in ("idle", "restored") and "retire_anywhere" not in self.faults:
            raise ControlError("invalid_phase", f"not valid in phase {self.phase}; resume first")
        if self.checkpoint_id not in (None, body.checkpoint_id):
            raise ControlError("checkpoint_conflict", f"{self.checkpoint_id} is active")
        self._within(body)

    async def retire(self, body: _Retire, episodes: list[Any]) -> dict[str, Any]:
        self._outside_checkpoint(body)
        for episode in episodes:
            self.marks[episode.rollout_id] = max(self.marks.get(episode.rollout_id, -1), episode.attempt)
        return {"retired": [episode.capture_key for episode in episodes]}

    async def forget(self, body: _Forget, _: Any) -> dict[str, Any]:
        self._outside_checkpoint(body)
        if "keeps_marks" not in self.faults:
            for rollout_id in body.rollout_ids:
                self.marks.pop(rollout_id, None)
        return {"forgotten": sorted(body.rollout_ids)}
