"""Reference model server (policy or auxiliary/judge), spec §3.

Data plane: `POST .../v1/responses` (also `/v1/chat/completions`, `/v1/messages`)
answers, after `latency_s`, an output that is a pure function of (rollout id, turn,
input) — not of the attempt, so a restored rollout produces what an
uninterrupted one would. Each call carrying `x-nemo-gym-rollout-id` is appended to
the in-memory ledger of its capture key with id `call-<n>` (n = 1, 2, … per key).

Admission (policy instances only; an auxiliary instance never gates):
`accepting` → pause → `draining` while anything is in flight → `paused` when nothing
is. A request is in flight from admission until its last body byte is sent; its status
entry names the rollout and attempt of its headers and the `x-nemo-gym-plane` header —
each null when absent, as real Gym reports them. While not accepting, gated paths answer
409 `checkpoint_parked` + `retry-after: 1`, and the refused call is not recorded.

Workers (`worker_mode: coordinator`, `workers: N`): the server answers as Gym's multi-worker
admission coordinator in front of N workers — each admitted call is held by one connected
worker; pause refuses (409 `missing_workers`) unless every worker is connected, and the status
reply has Gym's coordinator shape (`workers {acknowledged, expected, live}`, `missing_workers`,
`per_worker {acked_seq, inflight, connected}`, no `checkpoint_id`), `paused` only once every
worker is connected, has acknowledged the closed state, and nothing is in flight.
`POST /gymsim/admin/workers {"connected": k}` disconnects (or reconnects) workers.

Durable when: nothing is durable until commit; commit writes Gym's layout under
`model-ledger/<instance name>/` — one `<capture_key>.lineage.jsonl` per continuation root (its calls up
to the root's `last_committed_model_call_id`), `storage-references.jsonl` (the staging rows
those calls need), then `manifest.json` (schema 2) — and only then answers, naming the index
as `storage_reference_index`. Restore verifies every digest (lineage files and the index)
before installing anything — and, as Gym, refuses with 409 `ledger_mismatch` a model that already
holds lineage the snapshot does not (a restore needs a freshly started process; the fence then stays
`restore_failed_paused`, admission closed) — installs capture key `k` of attempt n as the key of
attempt n+1 (call ids continue), leaves admission closed until resume, and returns the restored
`storage_reference_index` when asked (`include_storage_reference_index: true`, the anchor) or
always (`restore_index: always`, later Gym, which refuses that field with 422).

Generation cut (`generation_cut: true`, later Gym with a generation-cut backend, single worker):
a pause cuts every call in flight at once — admission is `paused` at once, each reply reports
`generation_pending_total: 0`, `response_inflight_total` and a `generation_cut_proof` naming the
cut calls — and their responses are held until resume, so `inflight_total` stays > 0 while
paused. Without the option those three fields are absent (the anchor's shapes).

A policy model whose `checkpoint_mode` is not `export_restore` (drain-only `stateless`,
`restart_only`) pauses and resumes but refuses commit and restore (409
`ledger_not_checkpointable`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, Query, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quiesce.coordinator.protocol import (
    ATTEMPT_INDEX_HEADER,
    CHECKPOINT_PARKED,
    EXTERNAL_STORAGE_REFERENCE_INDEX,
    GATED_MODEL_PATH_SUFFIXES,
    LEDGER_MISMATCH,
    LEDGER_NOT_QUIESCENT,
    LINEAGE_SUFFIX,
    MISSING_WORKERS,
    MODEL,
    NOT_A_POLICY_INSTANCE,
    PHASES,
    PLANE_HEADER,
    ROLLOUT_ID_HEADER,
    STORAGE_REFERENCES,
    ArtifactRef,
    CheckpointDirBody,
    CommonBody,
    ContinuationRow,
    ModelCommitBody,
    ModelCommitReply,
    ModelPauseReply,
    ModelRestoreBody,
    ModelRestoreReply,
    ModelResumeReply,
    ModelStatusReply,
    Phase,
    StatusQuery,
    StorageReference,
    capture_key,
    model_ledger_dir,
    route,
    sha256_hex,
)
from quiesce.tools.gymsim.base import GymServer, route_path
from quiesce.tools.gymsim.common import (
    RESTORE_FAILED,
    ROLLOUT_ID_RE,
    ArtifactWriter,
    ControlRejection,
    Notifier,
    count_records,
    error_response,
    jsonl_bytes,
    manifest_bytes,
    parse_call_number,
)
from quiesce.tools.gymsim.fence import Done, OpRule, rule

MODEL_CALL_ID_HEADER = "x-nemo-gym-model-call-id"
_STATUS_PHASES: frozenset[Phase] = frozenset(p for p in PHASES if p != "idle")
#: Gym's code for a commit or restore of a model whose state cannot be exported.
LEDGER_NOT_CHECKPOINTABLE = "ledger_not_checkpointable"
#: The manifest schema of Gym's per-capture-key lineage layout.
LEDGER_SCHEMA_VERSION = 2


def model_output(rollout_id: str | None, turn: Any, text: str) -> str:
    """The deterministic completion: a pure function of (rollout id, turn, input)."""
    return sha256_hex(json.dumps(["gymsim-model", rollout_id, turn, text]).encode("utf-8"))


@dataclass
class Inflight:
    rollout_id: str | None
    attempt_index: int | None
    plane: str | None
    started: float
    worker: int = 0


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
        #: generation cut: the calls cut at the pause (their responses held until resume)
        self.cut: set[int] = set()
        super().__init__(*args, **kwargs)
        #: coordinator mode: the connected workers, the state sequence, each worker's acknowledged seq
        self.connected: set[int] = set(range(self.spec.workers))
        self.seq = 0
        self.acked: dict[int, int] = dict.fromkeys(range(self.spec.workers), 0)

    @property
    def is_policy(self) -> bool:
        return self.spec.instance_role != "auxiliary"

    @property
    def coordinated(self) -> bool:
        """Gym's multi-worker admission coordinator in front of `workers` workers."""
        return self.spec.worker_mode == "coordinator"

    @property
    def exports(self) -> bool:
        return self.is_policy and self.spec.checkpoint_mode == "export_restore"

    def instance_role(self) -> str | None:
        return self.spec.instance_role

    def checkpoint_mode(self) -> str:
        return self.spec.checkpoint_mode if self.is_policy else "stateless"

    def feature_list(self) -> list[str]:
        return [*self.features, EXTERNAL_STORAGE_REFERENCE_INDEX] if self.exports else list(self.features)

    def admission_state(self) -> str:
        return self.admission

    def debug_state(self) -> dict[str, Any]:
        return {
            "inflight_total": len(self.inflight),
            "ledger": {key: [row["call_id"] for row in rows] for key, rows in self.ledger.items()},
            "connected_workers": sorted(self.connected),
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

    @property
    def cuts(self) -> bool:
        """Later Gym with a generation-cut backend (see the module docstring)."""
        return self.spec.generation_cut and self.is_policy and not self.coordinated

    def _close_admission(self) -> None:
        if self.admission == "accepting":
            self.admission = "draining"
            self._broadcast()
            if self.cuts:  # every call in flight is cut at once: prepare-safe, response held
                self.cut = set(self.inflight)
                self.admission = "paused"
        if self.admission == "draining" and not self.inflight:
            self.admission = "paused"
        self.changed.notify()

    def _open_admission(self) -> None:
        if self.admission != "accepting":
            self._broadcast()
        self.admission = "accepting"
        self.cut = set()  # held responses go out
        self.changed.notify()

    def _cut_counters(self) -> dict[str, Any]:
        """Later Gym's counters of a cut-capable model (none at the anchor)."""
        if not self.cuts:
            return {}
        held = sorted(self.cut & set(self.inflight))
        proof = {"prefixes": [{"ticket_id": f"call-{i}", "disposition": "durable_prefix"} for i in held]}
        return {
            "response_inflight_total": len(self.inflight),
            "generation_pending_total": 0,
            "generation_cut_proof": proof if held else None,
        }

    def _broadcast(self) -> None:
        """A new admission state: every connected worker acknowledges it at once (as Gym's workers
        do within a pause); a disconnected one keeps its old sequence number."""
        self.seq += 1
        for worker in self.connected:
            self.acked[worker] = self.seq

    def set_connected(self, count: int) -> None:
        """Keep workers `0..count-1` connected. A worker reconnecting while admission is closed is
        refused, as Gym freezes membership until resume: it stays disconnected."""
        wanted = set(range(min(count, self.spec.workers)))
        gone = self.connected - wanted
        for worker in gone:
            self.connected.discard(worker)
        if self.admission == "accepting":
            for worker in wanted - self.connected:
                self.connected.add(worker)
                self.acked[worker] = self.seq
        self.changed.notify()

    def reported_state(self) -> str:
        """The admission state a status reply reports: coordinator mode says `paused` only once
        every expected worker is connected, has acknowledged the closed state, and none holds a call."""
        if not self.coordinated or self.admission == "accepting":
            return self.admission
        drained = (
            len(self.connected) == self.spec.workers
            and all(self.acked[w] >= self.seq for w in self.connected)
            and not self.inflight
        )
        return "paused" if drained else "draining"

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
            rollout = headers.get(ROLLOUT_ID_HEADER)
            server._next_request += 1
            request_id = server._next_request
            workers = sorted(server.connected) or [0]
            server.inflight[request_id] = Inflight(
                rollout if rollout is not None and ROLLOUT_ID_RE.match(rollout) else None,
                int(attempt) if attempt is not None and attempt.isdigit() else None,
                headers.get(PLANE_HEADER),
                time.monotonic(),
                workers[request_id % len(workers)],
            )

            async def tracked_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    while request_id in server.cut:  # a cut call's response waits for resume
                        await server.changed.wait(None)
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

        if self.spec.restore_index == "always":

            @self.control_route("POST", route(MODEL, "restore").full_path)
            async def restore_always(body: CheckpointDirBody) -> JSONResponse:
                return await self._policy_only("restore", body, lambda: self._restore(body, True))

        else:

            @self.control_route("POST", route(MODEL, "restore").full_path)
            async def restore(body: ModelRestoreBody) -> JSONResponse:
                wanted = body.include_storage_reference_index
                return await self._policy_only("restore", body, lambda: self._restore(body, wanted))

        @app.post("/gymsim/admin/workers")
        async def workers(connected: int = Body(embed=True, ge=0)) -> JSONResponse:
            self.set_connected(connected)
            return JSONResponse({"connected": sorted(self.connected), "expected": self.spec.workers})

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
            chain = [*calls[-1]["staging_chain"], calls[-1]["staging_key"]] if calls else []
            calls.append(
                {
                    "capture_key": key,
                    "call_id": call_id,
                    "rollout_id": rollout_id,
                    "attempt_index": attempt,
                    "turn": turn,
                    "input_sha256": sha256_hex(text.encode("utf-8")),
                    "output_text": output,
                    # where a trainer would stage this call's tokens, and the rows before it
                    "staging_key": f"{key}/{call_id}",
                    "staging_chain": chain,
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
        if self.coordinated:
            acknowledged = sum(1 for w in self.connected if self.acked[w] >= self.seq)
            return {"acknowledged": acknowledged, "expected": self.spec.workers}
        return {"acknowledged": self.spec.workers, "expected": self.spec.workers}

    async def _pause(self) -> Done:
        """Close admission at once; do not wait. `prepared` right away when nothing is in flight.

        Coordinator mode first requires every worker connected (else 409 `missing_workers`,
        admission untouched), as Gym freezes worker membership at the pause."""
        if self.coordinated and len(self.connected) != self.spec.workers:
            missing = sorted(set(range(self.spec.workers)) - self.connected)
            raise ControlRejection(
                MISSING_WORKERS,
                f"cannot freeze checkpoint worker membership: expected {self.spec.workers}, found"
                f" {len(self.connected)} connected workers (missing: {', '.join(map(str, missing))})",
            )
        self._close_admission()
        state = self.reported_state()
        reply = ModelPauseReply.model_validate(
            {
                "state": state,
                "workers": self._workers(),
                "inflight_total": len(self.inflight),
                "waiters_total": 0,
                **self._cut_counters(),
            }
        )
        return Done(
            reply.model_dump(mode="json", exclude_unset=True), after="prepared" if state == "paused" else None
        )

    async def _status(self, q: StatusQuery) -> dict[str, Any]:
        """Long-poll: answer once drained, or after min(timeout_s, budget)."""
        if self.is_policy:
            self.fence.check_query(q.checkpoint_id, _STATUS_PHASES)
        limits = [
            v
            for v in (q.timeout_s, None if q.deadline_ts is None else q.deadline_ts - time.time())
            if v is not None
        ]
        until = time.monotonic() + max(0.0, min(limits)) if limits else time.monotonic()
        while self.admission != "accepting" and self.reported_state() != "paused":
            left = until - time.monotonic()
            if left <= 0:
                break
            await self.changed.wait(left)
        state = self.reported_state()
        if state == "paused":
            self.fence.advance("preparing", "prepared")
        document = self._coordinator_status(state) if self.coordinated else self._worker_status(q, state)
        ModelStatusReply.model_validate(document)  # the wire model accepts it; sent as built (exact fields)
        return document

    def _worker_status(self, q: StatusQuery, state: str) -> dict[str, Any]:
        """The single-worker shape: exactly the anchor's fields."""
        now = time.monotonic()
        return {
            "checkpoint_id": q.checkpoint_id,
            "state": state,
            "per_worker": {
                str(i): {"state": state, "inflight": len(self.inflight) if i == 0 else 0}
                for i in range(self.spec.workers)
            },
            "inflight_total": len(self.inflight),
            **self._cut_counters(),
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

    def _coordinator_status(self, state: str) -> dict[str, Any]:
        """Gym's multi-worker coordinator shape: no checkpoint id, no per-worker state."""
        live = sorted(self.connected)
        return {
            "state": state,
            "workers": {
                "acknowledged": sum(1 for w in live if self.acked[w] >= self.seq),
                "expected": self.spec.workers,
                "live": len(live),
            },
            "missing_workers": self.spec.workers - len(live),
            "inflight_total": len(self.inflight),
            "waiters_total": 0,
            "per_worker": {
                str(w): {
                    "acked_seq": self.acked[w],
                    "inflight": sum(1 for e in self.inflight.values() if e.worker == w),
                    "connected": w in self.connected,
                }
                for w in range(self.spec.workers)
            },
        }

    async def _commit(self, body: ModelCommitBody) -> dict[str, Any]:
        if not self.exports:
            raise ControlRejection(
                LEDGER_NOT_CHECKPOINTABLE,
                f"{self.name} is checkpoint_mode {self.spec.checkpoint_mode}: it has no state to export",
            )
        if self.reported_state() != "paused" or self.inflight:
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
        excluded_inactive = sum(1 for key in self.ledger if key not in selected)
        folder = model_ledger_dir(self.instance)
        roots = {key: selected[key][0] for key in keys}
        chosen = {key: selected[key][1] for key in keys}
        sources = sorted({(row.rollout_id, row.attempt_index) for row in roots.values()})

        def write() -> tuple[str, ArtifactRef, int]:
            writer = ArtifactWriter(body.checkpoint_dir, folder)
            rollouts: dict[str, dict[str, Any]] = {}
            references: dict[str, StorageReference] = {}
            for key in keys:
                entry: dict[str, Any] = {"files": {}, "rows": len(chosen[key]), "bytes": 0}
                if chosen[key]:
                    data, count = jsonl_bytes(chosen[key])
                    ref = writer.write(f"{key}{LINEAGE_SUFFIX}", data, count)
                    entry = {
                        "files": {f"{key}{LINEAGE_SUFFIX}": ref.sha256},
                        "rows": count,
                        "bytes": ref.bytes,
                    }
                    boundary = chosen[key][-1]
                    for staging in [*boundary["staging_chain"], boundary["staging_key"]]:
                        references.setdefault(
                            staging,
                            StorageReference(
                                capture_key=key, boundary_model_call_id=boundary["call_id"], key=staging
                            ),
                        )
                rollouts[key] = entry
            data, count = jsonl_bytes(references[k].model_dump(mode="json") for k in sorted(references))
            index = writer.write(STORAGE_REFERENCES, data, count)
            roots_json = [roots[k].model_dump(mode="json") for k in keys]
            digest = writer.write_manifest(
                {
                    "schema_version": LEDGER_SCHEMA_VERSION,
                    "checkpoint_id": body.checkpoint_id,
                    "server_name": self.instance,
                    "rollouts": rollouts,
                    "continuation_roots_sha256": sha256_hex(
                        json.dumps(roots_json, sort_keys=True, separators=(",", ":")).encode("utf-8")
                    ),
                    "continuation_roots": len(keys),
                    "excluded_inactive": excluded_inactive,
                    "storage_reference_index": index.model_dump(mode="json"),
                    "tombstones": [],
                    "source_attempts": [{"rollout_id": r, "attempt_index": a} for r, a in sources],
                },
                list_files=False,
            )
            return digest, index, sum(len(v) for v in chosen.values())

        digest, index, total = await asyncio.to_thread(write)
        reply = ModelCommitReply.model_validate(
            {
                "rollouts": len(keys),
                "rows": total,
                "excluded_tombstoned": 0,
                "excluded_inactive": excluded_inactive,
                "manifest_digest": digest,
                "storage_reference_index": index.model_dump(mode="json"),
            }
        )
        return reply.model_dump(mode="json")

    async def _restore(self, body: CheckpointDirBody, with_index: bool) -> dict[str, Any]:
        if not self.exports:
            raise ControlRejection(
                LEDGER_NOT_CHECKPOINTABLE,
                f"{self.name} is checkpoint_mode {self.spec.checkpoint_mode}: it has no state to restore",
            )
        self._close_admission()
        folder = model_ledger_dir(self.instance)
        manifest, by_key, index = await asyncio.to_thread(_read_lineage, body.checkpoint_dir, folder)
        try:
            identity = {
                capture_key(str(a["rollout_id"]), int(a["attempt_index"])): (
                    str(a["rollout_id"]),
                    int(a["attempt_index"]),
                )
                for a in manifest["source_attempts"]
            }
            installs: dict[str, list[dict[str, Any]]] = {}
            for old_key in manifest["rollouts"]:
                rollout_id, attempt = identity[old_key]
                new_key = capture_key(rollout_id, attempt + 1)
                installs[new_key] = [{**call, "capture_key": new_key} for call in by_key.get(old_key, [])]
            source_id = str(manifest["checkpoint_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlRejection(RESTORE_FAILED, f"bad model ledger in {folder}: {exc!r}") from exc
        foreign = sorted(key for key in self.ledger if key not in installs)
        if foreign:  # as Gym: a restore needs a fresh capture-ledger namespace (a fresh process)
            raise ControlRejection(
                LEDGER_MISMATCH,
                f"restore requires a fresh capture ledger: {self.name} already holds lineage the"
                f" snapshot does not ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''});"
                " restore into a freshly started model server",
            )
        self.ledger.update(installs)
        document: dict[str, Any] = {
            "rollouts": len(installs),
            "rows": sum(len(v) for v in installs.values()),
            "checkpoint_id": source_id,
            "tombstones": [],
            "source_attempts": [{"rollout_id": r, "attempt_index": a} for r, a in sorted(identity.values())],
        }
        if with_index:
            document["storage_reference_index"] = index.model_dump(mode="json")
        ModelRestoreReply.model_validate(document)
        return document

    async def _resume(self) -> dict[str, Any]:
        self._open_admission()
        reply = ModelResumeReply.model_validate(
            {"state": "accepting", "workers": self._workers(), "released_waiters": 0}
        )
        return reply.model_dump(mode="json")


def _read_lineage(
    checkpoint_dir: str, folder: str
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]], ArtifactRef]:
    """The model's manifest, its lineage rows by capture key, and its storage reference index —
    every file checked against the manifest (sha256; the index also bytes and records) before
    anything is returned. Raises `ControlRejection(restore_failed)` naming the first problem."""
    root = Path(checkpoint_dir)
    try:
        manifest = json.loads(manifest_bytes(checkpoint_dir, folder))
    except ValueError as exc:
        raise ControlRejection(RESTORE_FAILED, f"unreadable manifest {folder}/manifest.json: {exc}") from exc
    try:
        if manifest.get("schema_version") != LEDGER_SCHEMA_VERSION:
            raise ValueError(f"manifest schema_version {manifest.get('schema_version')!r}")
        index = ArtifactRef.model_validate(manifest["storage_reference_index"])
        data = (root / index.relative_path).read_bytes()
        if (
            len(data) != index.bytes
            or sha256_hex(data) != index.sha256
            or count_records(data) != index.records
        ):
            raise ValueError(f"{index.relative_path} does not match its bytes, sha256 or record count")
        for line in data.splitlines():
            if line.strip():
                StorageReference.model_validate_json(line)
        by_key: dict[str, list[dict[str, Any]]] = {}
        for key, entry in dict(manifest["rollouts"]).items():
            rows: list[dict[str, Any]] = []
            for name, digest in dict(entry["files"]).items():
                content = (root / folder / name).read_bytes()
                if sha256_hex(content) != digest:
                    raise ValueError(f"digest mismatch for {folder}/{name}")
                rows.extend(json.loads(line) for line in content.splitlines() if line.strip())
            by_key[str(key)] = rows
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ControlRejection(RESTORE_FAILED, f"bad model ledger in {folder}: {exc}") from exc
    return manifest, by_key, index


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
