"""Reference model server (policy or auxiliary/judge), spec §3.

Data plane: `POST .../v1/responses` (also `/v1/chat/completions`, `/v1/messages`)
answers, after `latency_s`, an output that is a pure function of (rollout id, turn,
input) — not of the attempt, so a restored rollout produces what an
uninterrupted one would. Each call carrying `x-nemo-gym-rollout-id` is appended to
the in-memory ledger of its capture key with id `call-<n>` (n = 1, 2, … per key).

Admission (policy instances only; an auxiliary instance never gates):
`accepting` → pause → `draining` while anything is in flight → `paused` when nothing
is. A request is in flight from admission until its last body byte is sent.
While not accepting, gated paths answer 409 `checkpoint_parked` + `retry-after: 1`,
and the refused call is not recorded.

Durable when: nothing is durable until commit; commit writes
`model-ledger/<name>/calls.jsonl` then `manifest.json` (each fsynced) and only then
answers. Restore verifies every file digest before installing anything, installs
capture key `k` of attempt n as the key of attempt n+1 (call ids continue), and
leaves admission closed until resume.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Query, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.protocol import (
    ATTEMPT_INDEX_HEADER,
    CHECKPOINT_PARKED,
    GATED_MODEL_PATH_SUFFIXES,
    LEDGER_MISMATCH,
    LEDGER_NOT_QUIESCENT,
    MODEL,
    NOT_A_POLICY_INSTANCE,
    PHASES,
    ROLLOUT_ID_HEADER,
    CheckpointDirBody,
    CommonBody,
    ContinuationRow,
    ModelCommitBody,
    ModelCommitReply,
    ModelPauseReply,
    ModelRestoreReply,
    ModelResumeReply,
    ModelStatusReply,
    Phase,
    StatusQuery,
    capture_key,
    model_ledger_dir,
    route,
    sha256_hex,
)
from tools.gymsim.base import GymServer, route_path
from tools.gymsim.common import (
    RESTORE_FAILED,
    ArtifactWriter,
    ControlRejection,
    Notifier,
    count_records,
    error_response,
    jsonl_bytes,
    parse_call_number,
    read_manifest,
)
from tools.gymsim.fence import Done, OpRule, rule

MODEL_CALL_ID_HEADER = "x-nemo-gym-model-call-id"
_STATUS_PHASES: frozenset[Phase] = frozenset(p for p in PHASES if p != "idle")


def model_output(rollout_id: str | None, turn: Any, text: str) -> str:
    """The deterministic completion: a pure function of (rollout id, turn, input)."""
    return sha256_hex(json.dumps(["gymsim-model", rollout_id, turn, text]).encode("utf-8"))


@dataclass
class Inflight:
    rollout_id: str | None
    attempt_index: int | None
    plane: str
    started: float


class ModelServer(GymServer):
    """A policy or auxiliary model server speaking control plane v1."""

    component = MODEL
    concurrency_contract = "stateless"
    features = ("model_admission_v1", "model_ledger_v1")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.admission: str = "accepting"
        self.inflight: dict[int, Inflight] = {}
        self.ledger: dict[str, list[dict[str, Any]]] = {}
        self.changed = Notifier()
        self._next_request = 0
        super().__init__(*args, **kwargs)

    @property
    def is_policy(self) -> bool:
        return self.spec.instance_role != "auxiliary"

    def instance_role(self) -> str | None:
        return self.spec.instance_role

    def checkpoint_mode(self) -> str:
        return "export_restore" if self.is_policy else "stateless"

    def admission_state(self) -> str:
        return self.admission

    def debug_state(self) -> dict[str, Any]:
        return {
            "inflight_total": len(self.inflight),
            "ledger": {key: [row["call_id"] for row in rows] for key, rows in self.ledger.items()},
        }

    def fence_rules(self) -> dict[str, OpRule]:
        return {
            "pause": rule(("idle",), "preparing", "preparing"),
            "commit": rule(("prepared",), "committing", "committed_paused"),
            "restore": rule(
                ("idle", "restore_failed_paused"), "restoring", "restored_paused", "restore_failed_paused"
            ),
            "resume": rule(
                ("preparing", "prepared", "committed_paused", "restore_failed_paused", "restored_paused"),
                None,
                "idle",
                retires=True,
            ),
        }

    # -- admission ---------------------------------------------------------------------------

    def _close_admission(self) -> None:
        if self.admission == "accepting":
            self.admission = "draining"
        if self.admission == "draining" and not self.inflight:
            self.admission = "paused"
        self.changed.notify()

    def _open_admission(self) -> None:
        self.admission = "accepting"
        self.changed.notify()

    def _leave(self, request_id: int) -> None:
        if self.inflight.pop(request_id, None) is not None:
            if self.admission == "draining" and not self.inflight:
                self.admission = "paused"
            self.changed.notify()

    def wrap_gate(self, app: ASGIApp) -> ASGIApp:
        server = self

        async def gate(scope: Scope, receive: Receive, send: Send) -> None:
            if (
                scope["type"] != "http"
                or scope["method"] != "POST"
                or not route_path(scope).endswith(GATED_MODEL_PATH_SUFFIXES)
            ):
                await app(scope, receive, send)
                return
            if server.is_policy and server.admission != "accepting":
                response = error_response(
                    409,
                    CHECKPOINT_PARKED,
                    f"model admission is {server.admission}",
                    headers={"retry-after": "1"},
                )
                await response(scope, receive, send)
                return
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
            attempt = headers.get(ATTEMPT_INDEX_HEADER)
            server._next_request += 1
            request_id = server._next_request
            server.inflight[request_id] = Inflight(
                headers.get(ROLLOUT_ID_HEADER),
                int(attempt) if attempt is not None and attempt.isdigit() else None,
                route_path(scope).rsplit("/", 1)[-1],
                time.monotonic(),
            )

            async def tracked_send(message: Message) -> None:
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    server._leave(request_id)

            try:
                await app(scope, receive, tracked_send)
            finally:
                server._leave(request_id)

        return gate

    # -- routes ------------------------------------------------------------------------------

    def add_routes(self) -> None:
        app = self.app
        for suffix in GATED_MODEL_PATH_SUFFIXES:
            app.add_api_route(suffix, self._responses, methods=["POST"])

        @self.control_route("POST", route(MODEL, "pause").full_path)
        async def pause(body: CommonBody) -> JSONResponse:
            return await self._policy_only("pause", body, self._pause)

        @self.control_route("GET", route(MODEL, "status").full_path)
        async def status(q: Annotated[StatusQuery, Query()]) -> JSONResponse:
            return await self.query(lambda: self._status(q))

        @self.control_route("POST", route(MODEL, "commit").full_path)
        async def commit(body: ModelCommitBody) -> JSONResponse:
            return await self._policy_only("commit", body, lambda: self._commit(body))

        @self.control_route("POST", route(MODEL, "restore").full_path)
        async def restore(body: CheckpointDirBody) -> JSONResponse:
            return await self._policy_only("restore", body, lambda: self._restore(body))

        @self.control_route("POST", route(MODEL, "resume").full_path)
        async def resume(body: CommonBody) -> JSONResponse:
            return await self._policy_only("resume", body, self._resume)

    async def _policy_only(self, operation: str, body: CommonBody, action: Any) -> JSONResponse:
        if not self.is_policy:
            return error_response(409, NOT_A_POLICY_INSTANCE, f"{self.name} is an auxiliary model instance")
        return await self.control(operation, body, action)

    async def _responses(self, request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "invalid_request", "body must be JSON")
        if not isinstance(body, dict):
            return error_response(400, "invalid_request", "body must be a JSON object")
        rollout_id = request.headers.get(ROLLOUT_ID_HEADER)
        attempt_raw = request.headers.get(ATTEMPT_INDEX_HEADER, "0")
        if not attempt_raw.isdigit():
            return error_response(400, "invalid_request", f"bad {ATTEMPT_INDEX_HEADER}")
        attempt = int(attempt_raw)
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        turn = metadata.get("turn") if isinstance(metadata, dict) else None
        raw_input = body.get("input", body.get("messages", ""))
        text = raw_input if isinstance(raw_input, str) else json.dumps(raw_input, sort_keys=True)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        output = model_output(rollout_id, turn, text)
        call_id: str | None = None
        key: str | None = None
        if rollout_id:
            key = capture_key(rollout_id, attempt)
            calls = self.ledger.setdefault(key, [])
            call_id = f"call-{len(calls) + 1}"
            calls.append(
                {
                    "capture_key": key,
                    "call_id": call_id,
                    "rollout_id": rollout_id,
                    "attempt_index": attempt,
                    "turn": turn,
                    "input_sha256": sha256_hex(text.encode("utf-8")),
                    "output_text": output,
                }
            )
        reply = {
            "id": f"resp_{sha256_hex(f'{key}|{call_id}|{output}'.encode())[:24]}",
            "object": "response",
            "model": body.get("model", self.name),
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": output}],
                }
            ],
            "output_text": output,
            "metadata": {"model_call_id": call_id, "capture_key": key, "attempt_index": attempt},
        }
        headers = {MODEL_CALL_ID_HEADER: call_id} if call_id else None
        return JSONResponse(reply, headers=headers)

    # -- control operations ------------------------------------------------------------------

    def _workers(self) -> dict[str, int]:
        return {"acknowledged": self.spec.workers, "expected": self.spec.workers}

    async def _pause(self) -> Done:
        """Close admission at once; do not wait. `prepared` right away when nothing is in flight."""
        self._close_admission()
        reply = ModelPauseReply.model_validate(
            {
                "state": self.admission,
                "workers": self._workers(),
                "inflight_total": len(self.inflight),
                "waiters_total": 0,
            }
        )
        return Done(reply.model_dump(mode="json"), after="prepared" if self.admission == "paused" else None)

    async def _status(self, q: StatusQuery) -> dict[str, Any]:
        """Long-poll: answer once nothing is in flight, or after min(timeout_s, budget)."""
        if self.is_policy:
            self.fence.check_query(q.checkpoint_id, _STATUS_PHASES)
        limits = [
            v
            for v in (q.timeout_s, None if q.deadline_ts is None else q.deadline_ts - time.time())
            if v is not None
        ]
        until = time.monotonic() + max(0.0, min(limits)) if limits else time.monotonic()
        while self.inflight and self.admission != "accepting":
            left = until - time.monotonic()
            if left <= 0:
                break
            await self.changed.wait(left)
        if self.admission == "paused":
            self.fence.advance("preparing", "prepared")
        now = time.monotonic()
        state = self.admission
        reply = ModelStatusReply.model_validate(
            {
                "checkpoint_id": q.checkpoint_id,
                "state": state,
                "per_worker": {
                    str(i): {"state": state, "inflight": len(self.inflight) if i == 0 else 0}
                    for i in range(self.spec.workers)
                },
                "inflight_total": len(self.inflight),
                "waiters_total": 0,
                "inflight": [
                    {
                        "rollout_id": entry.rollout_id,
                        "attempt_index": entry.attempt_index,
                        "plane": entry.plane,
                        "age_seconds": round(now - entry.started, 6),
                    }
                    for entry in self.inflight.values()
                ],
                "tombstones": [],
            }
        )
        return reply.model_dump(mode="json")

    async def _commit(self, body: ModelCommitBody) -> dict[str, Any]:
        if self.admission != "paused" or self.inflight:
            raise ControlRejection(
                LEDGER_NOT_QUIESCENT, f"admission is {self.admission} with {len(self.inflight)} in flight"
            )
        selected: dict[str, tuple[ContinuationRow, list[dict[str, Any]]]] = {}
        indexes, unreadable = await asyncio.to_thread(_read_indexes, body)
        for ref, data in zip(body.continuation_indexes, indexes, strict=False):
            for line in data.splitlines():
                if not line.strip():
                    continue
                try:
                    row = ContinuationRow.model_validate_json(line)
                except ValueError as exc:
                    raise ControlRejection(LEDGER_MISMATCH, f"bad row in {ref.relative_path}") from exc
                number = parse_call_number(row.last_committed_model_call_id)
                calls = self.ledger.get(row.capture_key, [])
                if number is None or number > len(calls):
                    raise ControlRejection(
                        LEDGER_MISMATCH,
                        f"{row.capture_key}: last_committed_model_call_id "
                        f"{row.last_committed_model_call_id} is not in this ledger ({len(calls)} calls)",
                    )
                selected[row.capture_key] = (row, calls[:number])
        if unreadable is not None:
            raise unreadable
        keys = sorted(selected)
        rows = [call for key in keys for call in selected[key][1]]
        excluded_inactive = sum(1 for key in self.ledger if key not in selected)
        rollouts = [
            {
                "capture_key": key,
                "rollout_id": selected[key][0].rollout_id,
                "attempt_index": selected[key][0].attempt_index,
                "last_committed_model_call_id": selected[key][0].last_committed_model_call_id,
                "rows": len(selected[key][1]),
            }
            for key in keys
        ]
        folder = model_ledger_dir(self.name)

        def write() -> str:
            writer = ArtifactWriter(body.checkpoint_dir, folder)
            data, count = jsonl_bytes(rows)
            writer.write("calls.jsonl", data, count)
            return writer.write_manifest(
                {
                    "schema_version": 1,
                    "component": MODEL,
                    "name": self.name,
                    "checkpoint_id": body.checkpoint_id,
                    "rollouts": rollouts,
                    "rows": len(rows),
                    "continuation_indexes": [r.model_dump(mode="json") for r in body.continuation_indexes],
                }
            )

        digest = await asyncio.to_thread(write)
        reply = ModelCommitReply.model_validate(
            {
                "rollouts": len(keys),
                "rows": len(rows),
                "excluded_tombstoned": 0,
                "excluded_inactive": excluded_inactive,
                "manifest_digest": digest,
            }
        )
        return reply.model_dump(mode="json", exclude_none=True)

    async def _restore(self, body: CheckpointDirBody) -> dict[str, Any]:
        self._close_admission()
        folder = model_ledger_dir(self.name)
        manifest, contents = await asyncio.to_thread(read_manifest, body.checkpoint_dir, folder)
        try:
            calls = [
                json.loads(line) for line in contents.get(f"{folder}/calls.jsonl", b"").splitlines() if line
            ]
            by_key: dict[str, list[dict[str, Any]]] = {}
            for call in calls:
                by_key.setdefault(str(call["capture_key"]), []).append(call)
            installs: dict[str, list[dict[str, Any]]] = {}
            sources = []
            for entry in manifest["rollouts"]:
                old_key = str(entry["capture_key"])
                rollout_id = str(entry["rollout_id"])
                attempt = int(entry["attempt_index"])
                new_key = capture_key(rollout_id, attempt + 1)
                installs[new_key] = [{**call, "capture_key": new_key} for call in by_key.get(old_key, [])]
                sources.append(
                    {
                        "capture_key": new_key,
                        "rollout_id": rollout_id,
                        "attempt_index": attempt + 1,
                        "source_capture_key": old_key,
                        "source_attempt_index": attempt,
                        "rows": len(installs[new_key]),
                    }
                )
            source_id = str(manifest["checkpoint_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlRejection(RESTORE_FAILED, f"bad model ledger in {folder}: {exc!r}") from exc
        self.ledger.update(installs)
        reply = ModelRestoreReply.model_validate(
            {
                "rollouts": len(installs),
                "rows": sum(len(v) for v in installs.values()),
                "checkpoint_id": source_id,
                "tombstones": [],
                "source_attempts": sources,
            }
        )
        return reply.model_dump(mode="json")

    async def _resume(self) -> dict[str, Any]:
        self._open_admission()
        reply = ModelResumeReply.model_validate(
            {"state": "accepting", "workers": self._workers(), "released_waiters": 0}
        )
        return reply.model_dump(mode="json")


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _read_indexes(body: ModelCommitBody) -> tuple[list[bytes], ControlRejection | None]:
    """The continuation indexes' bytes, in order, up to the first one unreadable or not as its ref says.

    That first failure comes back as the rejection to raise once the indexes before it are
    checked, so a commit fails on the same index, with the same reply, as reading them one
    by one would; one thread hop reads them all.
    """
    contents: list[bytes] = []
    for ref in body.continuation_indexes:
        try:
            data = _read_bytes(f"{body.checkpoint_dir}/{ref.relative_path}")
        except OSError as exc:
            return contents, ControlRejection(LEDGER_MISMATCH, f"cannot read {ref.relative_path}: {exc}")
        if len(data) != ref.bytes or sha256_hex(data) != ref.sha256 or count_records(data) != ref.records:
            return contents, ControlRejection(
                LEDGER_MISMATCH, f"{ref.relative_path} does not match its bytes, sha256 or record count"
            )
        contents.append(data)
    return contents, None
