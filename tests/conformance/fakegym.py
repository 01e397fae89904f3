"""A tiny control-plane v1 server for the checker's own tests, with switchable faults.

Independent of `tools/gymsim` on purpose: the checker must be proven against a
server whose every deviation is known. It implements the fence of spec §1.1
(replay, stale after resume, conflict, invalid_phase per the phase table, retire
on resume) for one component, writes a manifest (and, for an agent, a
continuation index) on commit, and each fault in `faults` breaks exactly one rule:

- `no_auth`        — the bearer token is not checked;
- `accept_extra`   — extra body fields are accepted;
- `wrong_digest`   — commit replies a manifest_digest that is not the file's;
- `no_replay`      — successful results are not recorded (a repeat reruns);
- `never_retire`   — resume does not retire the id (no stale_checkpoint);
- `bad_caps`       — capabilities lack the fence fields;
- `index_bytes`    — the agent's continuation_index gives a wrong byte count;
- `no_conflict`    — a second id is not refused with checkpoint_conflict while one is active;
- `slow_commit`    — a commit in phase prepared waits for `released` (to cancel a checker mid-call);
- `nan_500`        — a non-finite deadline_ts is answered 500 (real Gym on some FastAPI versions);
- `phase_as_state` — the resources status reports the fence phase as its `state`;
- `ack_any`        — acknowledge-completed acknowledges executions it never ran;
- `missing_worker` — a coordinator-mode model reports one worker missing while drained.

Options: `ack` (an agent declaring `completed_result_acknowledgement`, with the route),
`receipts` (that route takes later Gym's completion receipts — five fields, nothing more — and
answers the anchor's pairs with 422), `body_first` (as Gym's FastAPI routes: the body or query is
validated before the token, so a malformed request without a token gets 422, a well-formed one
401), and `coordinator` (a model answering status in Gym's multi-worker coordinator shape, 2
workers).
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quiesce.coordinator.protocol import (
    AGENT,
    CAPABILITIES_PATH,
    CHECKPOINT_CONFLICT,
    COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
    INVALID_PHASE,
    MODEL,
    NOT_A_POLICY_INSTANCE,
    RESOURCES,
    STALE_CHECKPOINT,
    UNAUTHORIZED_DETAIL,
    AcknowledgeBody,
    CheckpointDirBody,
    CommonBody,
    ModelCommitBody,
    StatusQuery,
    agent_instance_dir,
    manifest_path,
    route,
    sha256_hex,
)
from quiesce.tools.gymsim.host import bind_listener

FAULTS = frozenset(
    {
        "no_auth",
        "accept_extra",
        "wrong_digest",
        "no_replay",
        "never_retire",
        "bad_caps",
        "index_bytes",
        "no_conflict",
        "slow_commit",
        "nan_500",
        "phase_as_state",
        "ack_any",
        "missing_worker",
    }
)

# (operation) -> (phases it is allowed from, phase after success), per component (spec §1.1 table).
_ALL_BUT_IDLE = (
    "preparing",
    "prepared",
    "committing",
    "committed_paused",
    "restoring",
    "restore_failed_paused",
    "restored_paused",
)
TABLE: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    MODEL: {
        "pause": (("idle",), "prepared"),
        "commit": (("prepared",), "committed_paused"),
        "resume": (
            ("preparing", "prepared", "committed_paused", "restore_failed_paused", "restored_paused"),
            "idle",
        ),
    },
    AGENT: {
        "prepare": (("idle",), "prepared"),
        "commit": (("prepared",), "committed_paused"),
        "resume": (("idle", "preparing", "prepared", "committed_paused", "restored_paused"), "idle"),
    },
    RESOURCES: {
        "prepare": (("idle",), "prepared"),
        "commit": (("prepared",), "committed_paused"),
        "resume": (("idle", "prepared", "committed_paused", "restored_paused"), "idle"),
    },
}


class _Receipt(BaseModel):
    """Later Gym's completion receipt, in the five fields of its first receipt agents."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt_index: int = Field(ge=0)
    execution_generation: int = Field(ge=1)
    result_identity: str = Field(min_length=1, max_length=512)
    result_digest: str = Field(pattern=r"^[a-f0-9]{64}$")


class _ReceiptBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = Field(default=1, ge=1, le=1)
    executions: list[_Receipt] = Field(min_length=1)

    @field_validator("executions")
    @classmethod
    def _unique(cls, value: list[_Receipt]) -> list[_Receipt]:
        if len({(e.rollout_id, e.attempt_index) for e in value}) != len(value):
            raise ValueError("completed execution acknowledgements must be unique")
        return value


def _loose(model: type[CommonBody]) -> type[CommonBody]:
    return type(f"Loose{model.__name__}", (model,), {"model_config": ConfigDict(extra="ignore", frozen=True)})


def _conflict(code: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "detail": detail}}, status_code=409)


class FakeGym:
    """State of one fake server; `app` serves it."""

    def __init__(
        self,
        component: str,
        name: str,
        token: str,
        *,
        role: str | None = None,
        faults: frozenset[str] = frozenset(),
        ack: bool = False,
        receipts: bool = False,
        body_first: bool = False,
        coordinator: bool = False,
    ) -> None:
        unknown = faults - FAULTS
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self.component = component
        self.name = name
        self.token = token
        self.role = role if component == MODEL else None
        #: What capabilities say; tests may make it differ from how the server behaves (`role`).
        self.declared_role = self.role
        self.faults = faults
        self.ack = ack and component == AGENT
        self.receipts = receipts
        self.body_first = body_first
        self.coordinator = coordinator and component == MODEL
        self.phase = "idle"
        self.active: str | None = None
        self.deadline_ts: float | None = None
        self.recorded: dict[tuple[str, str], Any] = {}
        self.retired: set[str] = set()
        self.lock = threading.Lock()
        self.released = threading.Event()
        self.commit_waiting = threading.Event()
        self.app = self._build()

    def _authorized(self, request: Request) -> bool:
        if "no_auth" in self.faults:
            return True
        header = request.headers.get("authorization", "")
        return hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())

    def capabilities(self) -> dict[str, Any]:
        caps: dict[str, Any] = {
            "component": self.component,
            "name": self.name,
            "schema_version": 1,
            "admission_states": ["accepting", "draining", "paused"],
            "checkpoint_mode": "export_restore",
            "concurrency_contract": "serialized_per_session",
            "multi_process": (
                {"mode": "coordinator", "num_workers": 2}
                if self.coordinator
                else {"mode": "single_worker", "num_workers": 1}
            ),
            "instance_role": self.declared_role,
            "features": (
                ["agent_continuation_index_v1", *(["completed_result_acknowledgement"] if self.ack else [])]
                if self.component == AGENT
                else []
            ),
        }
        if "bad_caps" not in self.faults:
            caps.update(phase=self.phase, active_checkpoint_id=self.active, deadline_ts=self.deadline_ts)
        return caps

    def _build(self) -> FastAPI:
        app = FastAPI()
        unauthorized = JSONResponse({"detail": UNAUTHORIZED_DETAIL}, status_code=401)

        @app.get(CAPABILITIES_PATH)
        async def capabilities() -> dict[str, Any]:
            return self.capabilities()

        @app.get(route(self.component, "status").full_path)
        async def status(request: Request) -> Any:
            authorized = self._authorized(request)
            if not authorized and not self.body_first:
                return unauthorized
            try:
                query = StatusQuery.model_validate(dict(request.query_params))
            except ValidationError as exc:
                return JSONResponse({"detail": exc.errors(include_url=False)}, status_code=422)
            if not authorized:
                return unauthorized
            with self.lock:
                if self.component != AGENT and self.phase == "idle":
                    return _conflict(INVALID_PHASE, "status is not allowed at idle")
                return self._status_body(query.checkpoint_id)

        for op in TABLE[self.component]:
            self._add_post(app, op, unauthorized)
        if self.component == MODEL:
            self._add_post(app, "restore", unauthorized)
        if self.ack:

            @app.post(route(AGENT, "acknowledge").full_path)
            async def acknowledge(request: Request) -> Any:
                authorized = self._authorized(request)
                if not authorized and not self.body_first:
                    return unauthorized
                model: type[BaseModel] = _ReceiptBatch if self.receipts else AcknowledgeBody
                try:
                    body = model.model_validate(json.loads(await request.body()))
                except (ValidationError, ValueError) as exc:
                    return JSONResponse({"detail": str(exc)}, status_code=422)
                if not authorized:
                    return unauthorized
                assert isinstance(body, _ReceiptBatch | AcknowledgeBody)
                if "ack_any" not in self.faults:
                    return _conflict(
                        COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR, "no completed result to acknowledge"
                    )
                return {"acknowledged": [e.model_dump() for e in body.executions]}

        return app

    def _add_post(self, app: FastAPI, op: str, unauthorized: JSONResponse) -> None:
        r = route(self.component, op)
        model = r.request
        assert model is not None
        assert issubclass(model, CommonBody)
        if "accept_extra" in self.faults:
            model = _loose(model)
        body_model = model

        @app.post(r.full_path)
        async def handler(request: Request) -> Any:
            authorized = self._authorized(request)
            if not authorized and not self.body_first:
                return unauthorized
            raw = await request.body()
            if "nan_500" in self.faults and any(word in raw for word in (b"NaN", b"Infinity", b"1e999")):
                return JSONResponse({"detail": "Internal Server Error"}, status_code=500)
            try:
                body = body_model.model_validate(json.loads(raw))
            except ValidationError as exc:
                detail = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
                return JSONResponse({"detail": detail}, status_code=422)
            except ValueError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=422)
            if not authorized:
                return unauthorized
            if op == "commit" and "slow_commit" in self.faults and self.phase == "prepared":
                self.commit_waiting.set()
                await anyio.to_thread.run_sync(self.released.wait)
            if self.role == "auxiliary":
                return _conflict(NOT_A_POLICY_INSTANCE, "this model is not the policy instance")
            with self.lock:
                return self._fence(op, body)

    def _fence(self, op: str, body: CommonBody) -> Any:
        key = (body.checkpoint_id, op)
        if body.checkpoint_id in self.retired:
            if key in self.recorded:
                return self.recorded[key]
            return _conflict(STALE_CHECKPOINT, f"{body.checkpoint_id} is retired")
        if key in self.recorded:
            return self.recorded[key]
        if self.active is not None and self.active != body.checkpoint_id and "no_conflict" not in self.faults:
            return _conflict(CHECKPOINT_CONFLICT, f"{self.active} is active")
        allowed, after = TABLE[self.component][op]
        if self.phase not in allowed:
            return _conflict(INVALID_PHASE, f"{op} is not allowed in phase {self.phase}")
        result = self._act(op, body)
        if op == "resume" and "never_retire" not in self.faults:
            for old in [k for k in self.recorded if k[0] == body.checkpoint_id]:
                del self.recorded[old]
            self.retired.add(body.checkpoint_id)
        if "no_replay" not in self.faults:
            self.recorded[key] = result
        self.phase = after
        self.active = None if after == "idle" else body.checkpoint_id
        self.deadline_ts = None if after == "idle" else body.deadline_ts
        return result

    def _status_body(self, checkpoint_id: str) -> dict[str, Any]:
        if self.component == MODEL and self.coordinator:
            missing = 1 if "missing_worker" in self.faults else 0
            return {
                "state": "paused" if self.phase != "idle" else "accepting",
                "workers": {"acknowledged": 2 - missing, "expected": 2, "live": 2 - missing},
                "missing_workers": missing,
                "inflight_total": 0,
                "waiters_total": 0,
                "per_worker": {
                    str(i): {"acked_seq": 1, "inflight": 0, "connected": i < 2 - missing} for i in range(2)
                },
            }
        if self.component == MODEL:
            return {
                "checkpoint_id": self.active,
                "state": "paused" if self.phase != "idle" else "accepting",
                "per_worker": {"0": {"state": "paused", "inflight": 0}},
                "inflight_total": 0,
                "waiters_total": 0,
                "inflight": [],
                "tombstones": [],
            }
        if self.component == AGENT:
            return self._agent_counters()
        admission = "accepting" if self.phase == "idle" else "paused"
        return {
            "checkpoint_id": self.active,
            "state": self.phase if "phase_as_state" in self.faults else admission,
            "admission_state": admission,
            "sessions": 0,
            "per_session": [],
        }

    def _agent_counters(self) -> dict[str, Any]:
        return {
            "state": "paused" if self.phase != "idle" else "accepting",
            "ready_to_commit": self.phase != "idle",
            "running": 0,
            "parked": 0,
            "parked_with_boundary": 0,
            "parked_without_boundary": 0,
            "completed_unacknowledged": 0,
            "active": 0,
            "blocking_attempts": [],
            "completed_unacknowledged_attempts": [],
            "executions": [],
        }

    def _act(self, op: str, body: CommonBody) -> dict[str, Any]:
        if op == "pause":
            return {"state": "paused", "workers": {"acknowledged": 1, "expected": 1}, "inflight_total": 0}
        if op == "prepare":
            if self.component == AGENT:
                return {**self._agent_counters(), "state": "paused", "ready_to_commit": True}
            return {"sessions": 0, "state": "prepared"}
        if op == "resume":
            if self.component == MODEL:
                return {"state": "accepting", "workers": {"acknowledged": 1, "expected": 1}}
            if self.component == AGENT:
                return {"state": "accepting", "released": 0}
            return {"state": "accepting"}
        if op == "commit":
            assert isinstance(body, CheckpointDirBody)
            return self._commit(body)
        return {"rollouts": 0, "rows": 0, "checkpoint_id": body.checkpoint_id}

    def _commit(self, body: CheckpointDirBody) -> dict[str, Any]:
        folder = Path(body.checkpoint_dir)
        manifest_file = folder / manifest_path(self.component, self.name)
        manifest_file.parent.mkdir(parents=True, exist_ok=True)
        reply: dict[str, Any] = {}
        files: dict[str, str] = {}
        if self.component == AGENT:
            rel = f"{agent_instance_dir(self.name)}/continuations.jsonl"
            row = {
                "schema_version": 1,
                "rollout_id": "r1",
                "attempt_index": 0,
                "capture_key": "r1",
                "last_committed_model_call_id": "call-1",
                "resource_state_revisions": {"tools": 1},
            }
            data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
            (folder / rel).write_bytes(data)
            files[rel] = sha256_hex(data)
            size = len(data) + (1 if "index_bytes" in self.faults else 0)
            reply.update(
                records=1,
                continuation_index={
                    "schema_version": 1,
                    "relative_path": rel,
                    "sha256": sha256_hex(data),
                    "records": 1,
                    "bytes": size,
                },
            )
        elif self.component == MODEL:
            assert isinstance(body, ModelCommitBody)
            reply.update(rollouts=0, rows=0, excluded_tombstoned=0, excluded_inactive=0)
        else:
            reply.update(sessions=0)
        manifest = json.dumps({"checkpoint_id": body.checkpoint_id, "files": files}, sort_keys=True).encode()
        manifest_file.write_bytes(manifest)
        digest = sha256_hex(manifest + b"x" if "wrong_digest" in self.faults else manifest)
        reply["manifest_digest"] = digest
        return reply


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` with uvicorn on a free loopback port in a background thread; yield its base URL."""
    sock = bind_listener("127.0.0.1")  # TCP_NODELAY on accepted connections: no 40 ms Nagle stalls
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("fake server failed to start")
            threading.Event().wait(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
