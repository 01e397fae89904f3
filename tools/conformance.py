"""Conformance checker: probes one Gym server for compliance with control plane v1.

For authors of real Gym servers (and for our own reference servers): point it at a
server's base URL and it runs a fixed list of probes over plain HTTP (httpx, not the
coordinator), each giving one `CheckResult` (pass, fail with a short reason, or skip
with why). The wire format, routes and codes come from `quiesce.coordinator.protocol`.

`CHECKS` (at the end of this module) names every row and states what its passing
proves. What it drives, in order (each probe uses a fresh checkpoint id of this run,
`qc-<hex>-<label>`, so a retired id of an earlier run never collides):

1. capabilities (no token) — shape, schema version, fence snapshot, idle at start;
2. auth — 401 without a token and with a wrong one, on a POST and on the status GET;
3. validation — 422 on an extra body field, bad checkpoint ids, bad deadlines, schema_version 2;
   and that `schema_version` may be omitted;
4. phases — `invalid_phase` where the table says so (commit before prepare, ...);
5. one full cycle for the component — prepare/pause → status → commit into a temp dir →
   resume — with the fence rules checked on the way (idempotent replay, conflict,
   stale after resume, a repeated resume replaying its result) and the files written
   checked against the reply (manifest digest, continuation index, storage reference index);
   the model's status shape: single worker, or Gym's multi-worker coordinator
   (`multi_process.mode: coordinator`: `workers`, `missing_workers`, per-worker `acked_seq`);
6. an agent declaring `completed_result_acknowledgement`: `acknowledge-completed` needs the
   token, refuses a malformed batch (422) and an execution it never finished (409
   `completed_execution_acknowledgement_error`) — each probe in the agent's own form: the
   anchor's `{rollout_id, attempt_index}` pair, or, for a later agent that answers the pair with
   422, a completion receipt. Nothing real is acknowledged: the checker never releases a result
   a trainer may still need.

Real Gym's own leniencies are accepted (what running NeMo Gym's own control-plane code showed): a
resources status `state` is the admission state (`paused` after prepare); a non-finite
`deadline_ts` answered with 500 instead of 422 (FastAPI cannot render the input) counts as refused
and is reported as a warning (`warn`), not a failure; the server then closes that connection
without saying so, and a request that meets such a closed connection is sent once more on a new
one; a later agent validates an acknowledgement's body before its token (FastAPI reads the body
first), so a malformed batch without a token may be answered 422 — a well-formed one must still
get 401.

An auxiliary model gets the `not_a_policy_instance` probes instead of 3-5; a
`stateless` agent or resources server, and any `restart_only` server, is not driven at all (the
coordinator never drives it) and its control rows are skipped with the reason.

The checker leaves the server where it found it: everything it paused is resumed
in a `finally`, shielded from cancellation, even when a check fails; the last row
says whether the server is back at idle. The token never appears in any result.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import httpx
from pydantic import ValidationError

from quiesce.coordinator.errors import ConfigError
from quiesce.coordinator.protocol import (
    AGENT,
    AGENT_PREPARE_INCOMPLETE,
    CAPABILITIES_PATH,
    CHECKPOINT_CONFLICT,
    COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR,
    COMPLETED_RESULT_ACKNOWLEDGEMENT,
    EXTERNAL_STORAGE_REFERENCE_INDEX,
    INVALID_PHASE,
    MODEL,
    NOT_A_POLICY_INSTANCE,
    RESOURCES,
    SCHEMA_VERSION,
    STALE_CHECKPOINT,
    UNAUTHORIZED_DETAIL,
    AgentCommitReply,
    ArtifactRef,
    Capabilities,
    ContinuationRow,
    ModelCommitReply,
    ModelStatusReply,
    Route,
    StorageReference,
    agent_instance_dir,
    manifest_path,
    route,
)
from quiesce.coordinator.wording import count
from quiesce.tools.conformance_report import (
    CheckResult,
    CheckStatus,
    ConformanceReport,
    ServerUnreachable,
    first_error,
    transport_error,
)
from quiesce.tools.conformance_run import CheckRun, Fail, Reply, Skip, Warn, expect, send, validated
from quiesce.tools.conformance_run import work_dir as scratch_dir

__all__ = [
    "CHECKS",
    "CheckResult",
    "CheckStatus",
    "ConformanceReport",
    "ServerUnreachable",
    "run_conformance",
]

#: A token no server should accept (the real one is never printed).
WRONG_TOKEN: Final = "quiesce-conformance-wrong-token"
#: How long a probe waits for one reply, and the budget (`deadline_ts - now`) it sends.
DEFAULT_TIMEOUT_S: Final = 30.0
#: The spec's retry period for `agent_prepare_incomplete`.
AGENT_PREPARE_RETRY_S: Final = 0.1
#: One model status long-poll asks for at most this long (repeated until paused).
STATUS_POLL_S: Final = 2.0


async def run_conformance(
    url: str,
    token: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    work_dir: Path | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ConformanceReport:
    """Probe the Gym server at `url` (its base URL, without `/ng-control/v1`) and report every check.

    `token` is the control-plane bearer token. Commits are written into a fresh
    folder under `work_dir` (default: a temp dir removed afterwards), so the server
    must share this machine's filesystem for the artifact checks. Raises
    `ServerUnreachable` when the URL cannot be reached at all; every other problem
    is a failed row, never an exception.
    """
    if not token:
        raise ConfigError("the control-plane token is empty")
    base = url.rstrip("/")
    client = httpx.AsyncClient(timeout=timeout_s, transport=transport)
    with scratch_dir(work_dir, "conformance") as folder:
        async with client:
            checker = _Checker(client, base, token, timeout_s, folder)
            await checker.run()
            return checker.report


# ---------------------------------------------------------------------------------------------
# Plumbing
# ---------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_artifact(folder: Path, ref: ArtifactRef, what: str) -> bytes:
    """The file `ref` names exists under `folder` and matches its sha256, bytes and line count."""
    path = folder / ref.relative_path
    if not path.is_file():
        raise Fail(f"{what} {ref.relative_path!r} not found under the checkpoint dir")
    data = path.read_bytes()
    problems: list[str] = []
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        problems.append("sha256 differs from the file's")
    if len(data) != ref.bytes:
        problems.append(f"bytes {ref.bytes} but the file has {len(data)}")
    lines = [line for line in data.splitlines() if line.strip()]
    if len(lines) != ref.records:
        problems.append(f"records {ref.records} but the file has {len(lines)} lines")
    if problems:
        raise Fail(f"{what}: " + "; ".join(problems))
    return data


#: The model's POST routes; an auxiliary instance refuses each with `not_a_policy_instance`.
_MODEL_POSTS: Final = ("pause", "commit", "restore", "resume")


class _Checker(CheckRun):
    """One run against one server. Checks append to `report.results` in order."""

    def __init__(
        self, client: httpx.AsyncClient, base: str, token: str, timeout_s: float, folder: Path
    ) -> None:
        super().__init__(ConformanceReport(url=base), token, timeout_s, CHECKS)
        self.client = client
        self.base = base
        self.timeout_s = timeout_s
        self.folder = folder
        self.run_id = f"qc-{secrets.token_hex(4)}"
        self._serial = 0
        # Ids a POST may have activated on the server, not yet resumed: resumed in `_cleanup`.
        self._maybe_active: list[str] = []
        self.caps: Capabilities | None = None
        self._last_status: ModelStatusReply | None = None

    # -- ids, bodies, requests ----------------------------------------------------------------

    def new_id(self, label: str) -> str:
        self._serial += 1
        return f"{self.run_id}-{self._serial}-{label}"

    def deadline(self) -> float:
        return time.time() + self.timeout_s

    def body(self, checkpoint_id: str, **extra: Any) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "checkpoint_id": checkpoint_id,
            "deadline_ts": self.deadline(),
            **extra,
        }

    async def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None,
        json_body: Any = None,
        raw_body: bytes | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        return await send(
            self.client,
            method,
            self.base + path,
            token=token,
            json_body=json_body,
            raw=raw_body,
            params=params,
            timeout_s=timeout_s if timeout_s is not None else self.timeout_s,
        )

    async def post(
        self,
        op: str,
        body: Any = None,
        *,
        token: str | Literal["default"] | None = "default",
        raw_body: bytes | None = None,
    ) -> Reply:
        """POST to `op` of this server's component; a 2xx for a non-resume op marks its id for cleanup."""
        r = self._route(op)
        reply = await self.request(
            "POST",
            r.full_path,
            token=self.token if token == "default" else token,
            json_body=body,
            raw_body=raw_body,
        )
        checkpoint_id = body.get("checkpoint_id") if isinstance(body, dict) else None
        if isinstance(checkpoint_id, str):
            if op == "resume":
                if reply.ok and checkpoint_id in self._maybe_active:
                    self._maybe_active.remove(checkpoint_id)
            elif reply.ok and checkpoint_id not in self._maybe_active:
                self._maybe_active.append(checkpoint_id)
        return reply

    async def status(
        self,
        checkpoint_id: str,
        *,
        token: str | Literal["default"] | None = "default",
        poll_s: float | None = None,
    ) -> Reply:
        params = {"checkpoint_id": checkpoint_id}
        component = self.component
        if component in (MODEL, RESOURCES):
            params["deadline_ts"] = repr(self.deadline())
        if component == MODEL and poll_s is not None:
            params["wait_state"] = "paused"
            params["timeout_s"] = repr(poll_s)
        return await self.request(
            "GET",
            self._route("status").full_path,
            token=self.token if token == "default" else token,
            params=params,
            timeout_s=(poll_s or 0.0) + self.timeout_s,
        )

    async def capabilities(self) -> Reply:
        return await self.request("GET", CAPABILITIES_PATH, token=None)

    def _route(self, op: str) -> Route:
        return route(self.component, op)

    @property
    def component(self) -> str:
        assert self.caps is not None
        return self.caps.component

    @property
    def first_op(self) -> str:
        """The operation that opens a checkpoint: model pause, agent/resources prepare."""
        return "pause" if self.component == MODEL else "prepare"

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            reply = await self.capabilities()
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise ServerUnreachable(
                f"cannot reach {self.base}{CAPABILITIES_PATH}: {type(exc).__name__}: {exc}. "
                "Is the server running, and is URL its base (without /ng-control/v1)?"
            ) from exc
        await self.check("capabilities.shape", lambda: self._check_capabilities(reply))
        caps = self.caps
        if caps is None:
            self.skip(_ALL_AFTER_CAPABILITIES, "capabilities did not validate: component unknown")
            return
        self.report.component = caps.component
        self.report.name = caps.name
        self.report.instance_role = caps.instance_role
        self.report.checkpoint_mode = caps.checkpoint_mode

        if caps.checkpoint_mode == "restart_only" or (
            caps.checkpoint_mode == "stateless" and caps.component in (AGENT, RESOURCES)
        ):
            why = f"checkpoint_mode {caps.checkpoint_mode}: the coordinator never drives its control routes"
            self.skip(_ALL_AFTER_CAPABILITIES, why)
            return

        idle = await self.check("capabilities.idle_at_start", self._check_idle_at_start)
        try:
            await self._check_auth()
            if caps.component == MODEL and caps.instance_role == "auxiliary":
                await self._check_auxiliary()
            elif not idle:
                self.skip(
                    _VALIDATION + _PHASES + _CYCLE,
                    "server not idle at start: not touching another checkpoint",
                )
            else:
                await self._check_validation()
                await self._check_phases()
                await self._check_cycle()
            await self._check_acknowledge()
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()

    # -- capabilities -------------------------------------------------------------------------

    async def _check_capabilities(self, reply: Reply) -> str:
        caps = validated(Capabilities, reply, "capabilities")
        assert isinstance(caps, Capabilities)
        problems: list[str] = []
        if caps.schema_version != SCHEMA_VERSION:
            problems.append(f"schema_version {caps.schema_version}, expected {SCHEMA_VERSION}")
        missing = [k for k in ("phase", "active_checkpoint_id", "deadline_ts") if k not in reply.body]
        if missing:
            problems.append(f"fence fields missing: {', '.join(missing)}")
        if caps.component == MODEL and caps.instance_role is None:
            problems.append("a model server must set instance_role (policy or auxiliary)")
        self.caps = caps  # usable even with problems: the other checks still run
        if problems:
            raise Fail("; ".join(problems))
        role = f", role {caps.instance_role}" if caps.instance_role else ""
        return f"{caps.component} {caps.name!r}, {caps.checkpoint_mode}{role}"

    async def _check_idle_at_start(self) -> str:
        caps = self.caps
        assert caps is not None
        if caps.phase != "idle" or caps.active_checkpoint_id is not None:
            raise Fail(
                f"phase {caps.phase}, active id {caps.active_checkpoint_id!r}: another checkpoint "
                "is in progress; the cycle checks are skipped"
            )
        return "phase idle, no active checkpoint"

    async def _fresh_caps(self) -> Capabilities:
        reply = await self.capabilities()
        caps = validated(Capabilities, reply, "capabilities")
        assert isinstance(caps, Capabilities)
        return caps

    # -- auth -----------------------------------------------------------------------------------

    async def _check_auth(self) -> None:
        op = self.first_op

        async def post_with(token: str | None) -> str:
            checkpoint_id = self.new_id("auth")
            reply = await self.post(op, self.body(checkpoint_id), token=token)
            await self._repair(reply, checkpoint_id)
            return self._expect_401(reply, f"POST {op}")

        async def status_with(token: str | None) -> str:
            reply = await self.status(self.new_id("auth"), token=token)
            return self._expect_401(reply, "GET status")

        await self.check("auth.post_missing_token", lambda: post_with(None))
        await self.check("auth.post_wrong_token", lambda: post_with(WRONG_TOKEN))
        await self.check("auth.status_missing_token", lambda: status_with(None))
        await self.check("auth.status_wrong_token", lambda: status_with(WRONG_TOKEN))

    def _expect_401(self, reply: Reply, what: str) -> str:
        if reply.status != 401:
            raise Fail(f"{what}: expected 401, got {reply.describe()}")
        detail = reply.body.get("detail") if isinstance(reply.body, dict) else None
        if detail != UNAUTHORIZED_DETAIL:
            raise Fail(
                f"{what}: 401 body should be {{'detail': {UNAUTHORIZED_DETAIL!r}}}, got {reply.describe()}"
            )
        return f"{what} → 401"

    async def _repair(self, reply: Reply, checkpoint_id: str | None) -> None:
        """A probe that should have been refused was accepted: resume it at once so later checks run."""
        if reply.ok and checkpoint_id is not None:
            await self._resume_quietly(checkpoint_id)

    async def _resume_quietly(self, checkpoint_id: str) -> Reply | None:
        try:
            return await self.post("resume", self.body(checkpoint_id))
        except httpx.HTTPError:
            return None

    # -- auxiliary model --------------------------------------------------------------------------

    async def _check_auxiliary(self) -> None:
        self.skip(_VALIDATION + _PHASES + _CYCLE, "auxiliary model: never paused by the coordinator")

        async def refused() -> str:
            bad: list[str] = []
            for op in _MODEL_POSTS:
                checkpoint_id = self.new_id("aux")
                extra: dict[str, Any] = {}
                if op in ("commit", "restore"):
                    target = self.folder / f"aux-{op}"
                    target.mkdir(parents=True, exist_ok=True)
                    extra["checkpoint_dir"] = str(target)
                if op == "commit":
                    extra["continuation_indexes"] = []
                reply = await self.post(op, self.body(checkpoint_id, **extra))
                if reply.status != 409 or reply.code != NOT_A_POLICY_INSTANCE:
                    bad.append(f"{op}: {reply.describe()}")
                await self._repair(reply, checkpoint_id if op != "resume" else None)
            if bad:
                raise Fail(f"expected 409 {NOT_A_POLICY_INSTANCE} on every control POST; " + "; ".join(bad))
            return "pause, commit, restore, resume → 409 " + NOT_A_POLICY_INSTANCE

        async def status_allowed() -> str:
            reply = await self.status(self.new_id("aux"))
            if reply.code == NOT_A_POLICY_INSTANCE:
                raise Fail(f"status must not answer {NOT_A_POLICY_INSTANCE} on an auxiliary instance")
            if reply.status in (401, 404, 405) or reply.status >= 500:
                raise Fail(f"status route: {reply.describe()}")
            return f"status answers {reply.describe()}"

        await self.check("auxiliary.not_a_policy_instance", refused)
        await self.check("auxiliary.status_allowed", status_allowed)

    # -- validation (422) -------------------------------------------------------------------------

    async def _expect_422_cases(
        self, cases: list[tuple[str, Any, bytes | None, str | None]], *, tolerate_500: Iterable[str] = ()
    ) -> str:
        """Each case (label, json body, raw body, id to resume if accepted) must answer 422; a case
        in `tolerate_500` may answer 500 instead (still refused; reported as a warning)."""
        bad: list[str] = []
        warned: list[str] = []
        tolerated = set(tolerate_500)
        for label, body, raw, repair_id in cases:
            try:
                reply = await self.post(self.first_op, body, raw_body=raw)
            except httpx.HTTPError as exc:
                bad.append(f"{label}: {transport_error(exc)}")
                continue
            if reply.status == 500 and label in tolerated:
                warned.append(label)
            elif reply.status != 422:
                bad.append(f"{label}: {reply.describe()}")
            await self._repair(reply, repair_id)
        if bad:
            raise Fail("expected 422; " + "; ".join(bad))
        if warned:
            raise Warn(
                f"{count(len(cases), 'case')} refused; {', '.join(warned)} answered 500 instead of 422 — the"
                " server's validation error body could not be rendered as JSON (a server-side bug"
                " worth fixing; still refused)"
            )
        return f"{count(len(cases), 'case')} → 422"

    async def _check_validation(self) -> None:
        async def extra_field() -> str:
            checkpoint_id = self.new_id("extra")
            return await self._expect_422_cases(
                [("extra field", self.body(checkpoint_id, unexpected_field=1), None, checkpoint_id)]
            )

        async def bad_ids() -> str:
            long_id = (self.new_id("long") + "x" * 129)[:129]
            cases: list[tuple[str, Any, bytes | None, str | None]] = [
                (repr(bad), self.body(bad), None, bad) for bad in ("-x", "", "a b", ".x", "x/y")
            ]
            cases.append(("129 chars", self.body(long_id), None, long_id))
            cases.append(("missing", {"schema_version": 1, "deadline_ts": self.deadline()}, None, None))
            return await self._expect_422_cases(cases)

        async def bad_deadlines() -> str:
            checkpoint_id = self.new_id("deadline")
            prefix = f'{{"schema_version": 1, "checkpoint_id": "{checkpoint_id}", "deadline_ts": '
            cases: list[tuple[str, Any, bytes | None, str | None]] = [
                ("missing", {"schema_version": 1, "checkpoint_id": checkpoint_id}, None, checkpoint_id),
                ("NaN", None, (prefix + "NaN}").encode(), checkpoint_id),
                ("Infinity", None, (prefix + "Infinity}").encode(), checkpoint_id),
                ("1e999", None, (prefix + "1e999}").encode(), checkpoint_id),
                ("a string", self.body(checkpoint_id, deadline_ts="soon"), None, checkpoint_id),
            ]
            return await self._expect_422_cases(cases, tolerate_500=("NaN", "Infinity", "1e999"))

        async def schema_two() -> str:
            checkpoint_id = self.new_id("schema")
            return await self._expect_422_cases(
                [
                    ("schema_version 2", self.body(checkpoint_id, schema_version=2), None, checkpoint_id),
                    ("schema_version 0", self.body(checkpoint_id, schema_version=0), None, checkpoint_id),
                ]
            )

        async def schema_omitted() -> str:
            checkpoint_id = self.new_id("noschema")
            body = {"checkpoint_id": checkpoint_id, "deadline_ts": self.deadline()}
            reply = await self._open(body)
            if not reply.ok:
                raise Fail(f"{self.first_op} without schema_version: expected 200, got {reply.describe()}")
            resumed = await self.post("resume", dict(body))
            if not resumed.ok:
                raise Fail(f"resume without schema_version: expected 200, got {resumed.describe()}")
            return f"{self.first_op} and resume accepted without schema_version"

        await self.check("validation.extra_field", extra_field)
        await self.check("validation.checkpoint_id", bad_ids)
        await self.check("validation.deadline_ts", bad_deadlines)
        await self.check("validation.schema_version", schema_two)
        await self.check("validation.schema_version_optional", schema_omitted)

    async def _open(self, body: dict[str, Any]) -> Reply:
        """Model pause, agent prepare (retrying `agent_prepare_incomplete`), or resources prepare."""
        op = self.first_op
        give_up = time.monotonic() + self.timeout_s
        while True:
            reply = await self.post(op, body)
            if not (
                self.component == AGENT and reply.status == 409 and reply.code == AGENT_PREPARE_INCOMPLETE
            ):
                return reply
            if time.monotonic() >= give_up:
                return reply
            await anyio.sleep(AGENT_PREPARE_RETRY_S)

    # -- phases (invalid_phase where the table says so) -------------------------------------------

    async def _check_phases(self) -> None:
        async def commit_at_idle() -> str:
            checkpoint_id = self.new_id("early")
            reply = await self.post("commit", self._commit_body(checkpoint_id, "early-commit"))
            await self._repair(reply, checkpoint_id)
            expect(reply, 409, INVALID_PHASE)
            return f"commit at idle → 409 {INVALID_PHASE}"

        async def status_at_idle() -> str:
            if self.component == AGENT:
                reply = await self.status(self.new_id("idle"))
                expect(reply, 200)
                return "agent status at idle → 200 (allowed from any phase)"
            reply = await self.status(self.new_id("idle"))
            expect(reply, 409, INVALID_PHASE)
            return f"status at idle → 409 {INVALID_PHASE}"

        async def resume_at_idle() -> str:
            checkpoint_id = self.new_id("idle")
            reply = await self.post("resume", self.body(checkpoint_id))
            if self.component == MODEL:
                expect(reply, 409, INVALID_PHASE)
                return f"model resume at idle → 409 {INVALID_PHASE}"
            expect(reply, 200)
            caps = await self._fresh_caps()
            if caps.phase != "idle" or caps.active_checkpoint_id is not None:
                raise Fail(f"after resume at idle: phase {caps.phase}, active {caps.active_checkpoint_id!r}")
            return "resume at idle → 200 (allowed from idle), server still idle"

        await self.check("phase.commit_before_prepare", commit_at_idle)
        await self.check("phase.status_at_idle", status_at_idle)
        await self.check("phase.resume_at_idle", resume_at_idle)

    def _commit_body(self, checkpoint_id: str, folder: str) -> dict[str, Any]:
        target = self.folder / folder
        target.mkdir(parents=True, exist_ok=True)
        extra: dict[str, Any] = {"checkpoint_dir": str(target)}
        if self.component == MODEL:
            extra["continuation_indexes"] = []
        return self.body(checkpoint_id, **extra)

    # -- the cycle ---------------------------------------------------------------------------------

    async def _check_cycle(self) -> None:
        checkpoint_id = self.new_id("cycle")
        open_body = self.body(checkpoint_id)
        commit_body = self._commit_body(checkpoint_id, "commit")
        resume_body = self.body(checkpoint_id)
        state: dict[str, Any] = {}

        async def open_() -> str:
            reply = await self._open(open_body)
            model = self._route(self.first_op).reply
            parsed: Any = validated(model, reply, self.first_op)
            if self.component == AGENT and not parsed.ready_to_commit:
                raise Fail("prepare answered 200 without ready_to_commit")
            state["open"] = reply.body
            return f"{self.first_op} → 200 " + _summary(reply.body, ("state", "ready_to_commit", "sessions"))

        if not await self.check("cycle.prepare", open_):
            self.skip(_CYCLE[1:], "needs cycle.prepare")
            return

        async def fence_after_open() -> str:
            caps = await self._fresh_caps()
            allowed = ("preparing", "prepared") if self.component == MODEL else ("prepared",)
            return _fence_snapshot(caps, allowed, checkpoint_id, open_body["deadline_ts"])

        async def replay_open() -> str:
            reply = await self.post(self.first_op, open_body)
            return _same_reply(reply, state["open"], self.first_op)

        async def conflict() -> str:
            other = self.new_id("other")
            reply = await self.post(self.first_op, self.body(other))
            expect(reply, 409, CHECKPOINT_CONFLICT)
            return f"{self.first_op} of a second id → 409 {CHECKPOINT_CONFLICT}"

        async def status() -> str:
            return await self._cycle_status(checkpoint_id)

        async def commit() -> str:
            reply = await self.post("commit", commit_body)
            parsed = validated(self._route("commit").reply, reply, "commit")
            state["commit"] = reply.body
            state["commit_parsed"] = parsed
            return "commit → 200 " + _summary(reply.body, ("records", "rows", "rollouts", "sessions"))

        try:
            await self.check("capabilities.fence_state_prepared", fence_after_open)
            await self.check("fence.replay_prepare", replay_open)
            await self.check("fence.conflict", conflict)
            await self.check("cycle.status", status)
            await self.check("status.workers", lambda: self._check_status_workers(checkpoint_id))
            caps = self.caps
            assert caps is not None
            if caps.checkpoint_mode != "export_restore":  # a drain-only policy model
                self.skip(
                    (
                        "cycle.commit",
                        "artifacts.manifest_digest",
                        "artifacts.index",
                        "capabilities.fence_state_committed",
                        "fence.replay_commit",
                    ),
                    f"checkpoint_mode {caps.checkpoint_mode}: a drain-only model is paused and resumed,"
                    " never committed",
                )
                committed = None
            else:
                committed = await self.check("cycle.commit", commit)
            if committed:
                await self._check_artifacts(state["commit_parsed"], Path(commit_body["checkpoint_dir"]))

                async def fence_after_commit() -> str:
                    caps = await self._fresh_caps()
                    return _fence_snapshot(
                        caps, ("committed_paused",), checkpoint_id, open_body["deadline_ts"]
                    )

                async def replay_commit() -> str:
                    reply = await self.post("commit", commit_body)
                    return _same_reply(reply, state["commit"], "commit")

                await self.check("capabilities.fence_state_committed", fence_after_commit)
                await self.check("fence.replay_commit", replay_commit)
            elif committed is not None:
                self.skip(
                    (
                        "artifacts.manifest_digest",
                        "artifacts.index",
                        "capabilities.fence_state_committed",
                        "fence.replay_commit",
                    ),
                    "needs cycle.commit",
                )
        finally:

            async def resume() -> str:
                reply = await self.post("resume", resume_body)
                validated(self._route("resume").reply, reply, "resume")
                state["resume"] = reply.body
                return "resume → 200 " + _summary(reply.body, ("state", "released", "released_waiters"))

            with anyio.CancelScope(shield=True):
                resumed = await self.check("cycle.resume", resume)

        if not resumed:
            self.skip(("fence.replay_resume", "fence.stale_after_resume"), "needs cycle.resume")
            return

        async def replay_resume() -> str:
            reply = await self.post("resume", resume_body)
            return _same_reply(reply, state["resume"], "resume of the retired id")

        async def stale() -> str:
            reply = await self.post(self.first_op, self.body(checkpoint_id))
            await self._repair(reply, checkpoint_id)
            expect(reply, 409, STALE_CHECKPOINT)
            return f"{self.first_op} with the retired id → 409 {STALE_CHECKPOINT}"

        await self.check("fence.replay_resume", replay_resume)
        await self.check("fence.stale_after_resume", stale)

    async def _cycle_status(self, checkpoint_id: str) -> str:
        if self.component != MODEL:
            reply = await self.status(checkpoint_id)
            parsed: Any = validated(self._route("status").reply, reply, "status")
            if self.component == RESOURCES:
                if parsed.checkpoint_id != checkpoint_id:
                    raise Fail(f"status checkpoint_id {parsed.checkpoint_id!r}, expected {checkpoint_id!r}")
                if parsed.state != "paused":
                    raise Fail(
                        f"status state {parsed.state!r} after prepare, expected 'paused' (the admission"
                        " state, not the fence phase)"
                    )
            elif not parsed.ready_to_commit:
                raise Fail("agent status after prepare: ready_to_commit is false")
            return "status → 200 " + _summary(reply.body, ("state", "admission_state", "ready_to_commit"))
        # Model: long-poll until paused with nothing in flight (the spec: never an error for "not yet").
        give_up = time.monotonic() + self.timeout_s
        polls = 0
        while True:
            polls += 1
            reply = await self.status(checkpoint_id, poll_s=STATUS_POLL_S)
            parsed = validated(ModelStatusReply, reply, "status")
            assert isinstance(parsed, ModelStatusReply)
            self._last_status = parsed
            if parsed.checkpoint_id is not None and parsed.checkpoint_id != checkpoint_id:
                raise Fail(f"status checkpoint_id {parsed.checkpoint_id!r}, expected {checkpoint_id!r}")
            if parsed.not_drained() is None:
                return f"status long-poll → paused, 0 in flight ({count(polls, 'poll')})"
            if time.monotonic() >= give_up:
                raise Fail(
                    f"not paused within {self.timeout_s:g}s: state {parsed.state}, "
                    f"{parsed.inflight_total} in flight"
                )

    async def _check_status_workers(self, checkpoint_id: str) -> str:
        """The drained model status has the shape its `multi_process.mode` promises."""
        caps = self.caps
        assert caps is not None
        if self.component != MODEL:
            raise Skip("only a model reports workers")
        status = self._last_status
        if status is None:
            raise Skip("needs cycle.status")
        expected = caps.multi_process.num_workers
        if caps.multi_process.mode == "coordinator":
            workers = status.workers
            if workers is None or status.missing_workers is None:
                raise Fail("a coordinator-mode status must report workers and missing_workers")
            problems: list[str] = []
            if (workers.expected, workers.live, workers.acknowledged) != (expected, expected, expected):
                problems.append(
                    f"workers {workers.model_dump()} when drained, expected {expected} expected, live and"
                    " acknowledged"
                )
            if status.missing_workers:
                problems.append(f"missing_workers {status.missing_workers} when drained")
            shapes = [w for w in status.per_worker.values() if w.acked_seq is not None and w.connected]
            if len(shapes) != expected:
                problems.append(
                    f"per_worker has {len(shapes)} connected workers with acked_seq, expected {expected}"
                )
            if problems:
                raise Fail("; ".join(problems))
            return f"coordinator shape: {expected} workers acknowledged, live, none missing"
        if status.checkpoint_id != checkpoint_id:
            raise Fail(f"a single-worker status must name its checkpoint_id, got {status.checkpoint_id!r}")
        unpaused = [k for k, w in status.per_worker.items() if w.state != "paused"]
        if not status.per_worker or unpaused:
            raise Fail(f"per_worker must show every worker paused when drained: {status.per_worker}")
        return f"single-worker shape: checkpoint_id, {count(len(status.per_worker), 'worker')} paused"

    async def _check_acknowledge(self) -> None:
        """`acknowledge-completed` where the agent declares it: token, validation, unknown executions,
        each sent in the agent's own form — the pair (the anchor), or the completion receipt a
        later agent takes instead (it refuses the pair with 422; the five receipt fields every
        receipt agent has). A later Gym agent validates the body before the token: a malformed
        batch without a token may get 422, a well-formed one must get 401."""
        caps = self.caps
        assert caps is not None
        if caps.component != AGENT:
            self.skip(_ACK, "only an agent acknowledges completed results")
            return
        if COMPLETED_RESULT_ACKNOWLEDGEMENT not in caps.features:
            self.skip(_ACK, f"the agent does not declare {COMPLETED_RESULT_ACKNOWLEDGEMENT}")
            return
        path = route(AGENT, "acknowledge").full_path
        rollout_id = f"{self.run_id}-never-ran"
        pair: dict[str, Any] = {"rollout_id": rollout_id, "attempt_index": 0}
        receipt: dict[str, Any] = {
            **pair,
            "execution_generation": 1,
            "result_identity": f"{rollout_id}-result",
            "result_digest": "0" * 64,
        }
        known: list[dict[str, Any]] = []

        async def ack(body: Any, token: str | None = "default", raw: bytes | None = None) -> Reply:
            return await self.request(
                "POST", path, token=self.token if token == "default" else token, json_body=body, raw_body=raw
            )

        async def own() -> dict[str, Any]:
            """The agent's form of an execution it never ran (asked once, with the token)."""
            if not known:
                first = await ack({"schema_version": SCHEMA_VERSION, "executions": [pair]})
                if first.status == 422:
                    second = await ack({"schema_version": SCHEMA_VERSION, "executions": [receipt]})
                    known.append(receipt if second.status != 422 else pair)
                else:
                    known.append(pair)
            return dict(known[0])

        def form(execution: dict[str, Any]) -> str:
            return (
                "a completion receipt"
                if "result_digest" in execution
                else "a {rollout_id, attempt_index} pair"
            )

        async def auth() -> str:
            execution = await own()
            for token, label in ((None, "without a token"), (WRONG_TOKEN, "with a wrong token")):
                reply = await ack({"executions": [execution]}, token=token)
                self._expect_401(reply, f"POST acknowledge-completed ({form(execution)}) {label}")
            malformed = await ack({"executions": []}, token=None)
            if malformed.status == 422:
                return (
                    f"{form(execution)} without a token or with a wrong one → 401; a malformed batch"
                    " without a token → 422 (the body is validated before the token, as Gym's routes do)"
                )
            self._expect_401(malformed, "POST acknowledge-completed (a malformed batch) without a token")
            return f"{form(execution)} or a malformed batch, without a token or with a wrong one → 401"

        async def validation() -> str:
            execution = await own()
            bad: list[str] = []
            cases: list[tuple[str, Any]] = [
                ("no execution", {"executions": []}),
                ("an extra field", {"executions": [execution], "unexpected_field": 1}),
                ("a negative attempt", {"executions": [{**execution, "attempt_index": -1}]}),
                ("a bad rollout id", {"executions": [{**execution, "rollout_id": "-x"}]}),
            ]
            for label, body in cases:
                reply = await ack(body)
                if reply.status != 422:
                    bad.append(f"{label}: {reply.describe()}")
            duplicate = await ack({"executions": [execution, execution]})
            if duplicate.status != 422 and duplicate.code != COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR:
                bad.append(f"a duplicate: {duplicate.describe()}")
            if bad:
                raise Fail("expected 422 (a duplicate: 422 or 409); " + "; ".join(bad))
            return f"{len(cases) + 1} malformed batch(es) of {form(execution)}s refused"

        async def unknown_refused() -> str:
            execution = await own()
            reply = await ack({"schema_version": SCHEMA_VERSION, "executions": [execution]})
            expect(reply, 409, COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR)
            return (
                f"{form(execution)} of an execution it never finished → 409"
                f" {COMPLETED_EXECUTION_ACKNOWLEDGEMENT_ERROR}"
            )

        await self.check("acknowledge.auth", auth)
        await self.check("acknowledge.validation", validation)
        await self.check("acknowledge.unknown_execution", unknown_refused)

    async def _check_artifacts(self, reply: Any, folder: Path) -> None:
        caps = self.caps
        assert caps is not None

        async def manifest() -> str:
            rel = manifest_path(caps.component, caps.name)
            path = folder / rel
            if not path.is_file():
                raise Fail(
                    f"{rel} not found under the checkpoint dir (the server must share this filesystem)"
                )
            digest = _sha256_file(path)
            if digest != reply.manifest_digest:
                raise Fail(f"sha256 of {rel} is {digest[:12]}…, reply says {reply.manifest_digest[:12]}…")
            try:
                json.loads(path.read_bytes())
            except ValueError as exc:
                raise Fail(f"{rel} is not JSON: {exc}") from exc
            return f"sha256({rel}) = manifest_digest"

        async def index() -> str:
            if isinstance(reply, AgentCommitReply):
                ref = reply.continuation_index
                expected = f"{agent_instance_dir(caps.name)}/continuations.jsonl"
                if ref.relative_path != expected:
                    raise Fail(f"continuation_index path {ref.relative_path!r}, expected {expected!r}")
                if ref.records > reply.records:  # one row per record with a model call id (Gym)
                    raise Fail(
                        f"continuation_index records {ref.records}, more than the reply's {reply.records}"
                    )
                data = _check_artifact(folder, ref, "continuation_index")
                _check_continuation_rows(data)
                return f"continuation_index matches the file ({ref.records} records, {ref.bytes} bytes)"
            if isinstance(reply, ModelCommitReply):
                declared = EXTERNAL_STORAGE_REFERENCE_INDEX in caps.features
                if reply.storage_reference_index is None:
                    if declared:
                        raise Fail(
                            f"the model declares {EXTERNAL_STORAGE_REFERENCE_INDEX} but its commit reply has"
                            " no storage_reference_index"
                        )
                    raise Skip(f"the model does not declare {EXTERNAL_STORAGE_REFERENCE_INDEX}")
                ref = reply.storage_reference_index
                data = _check_artifact(folder, ref, "storage_reference_index")
                _check_storage_rows(data)
                return f"storage_reference_index matches the file ({ref.records} records)"
            raise Skip("a resources commit names no index file")

        await self.check("artifacts.manifest_digest", manifest)
        await self.check("artifacts.index", index)

    # -- cleanup ------------------------------------------------------------------------------------

    async def _cleanup(self) -> None:
        """Resume whatever this run may have left active, then say whether the server is idle."""
        for checkpoint_id in list(self._maybe_active):
            await self._resume_quietly(checkpoint_id)
        try:
            caps = await self._fresh_caps()
            active = caps.active_checkpoint_id
            if active is not None and active.startswith(self.run_id):
                await self._resume_quietly(active)
        except (Fail, httpx.HTTPError):
            pass

        async def idle() -> str:
            caps = await self._fresh_caps()
            found = self.caps
            if found is not None and found.phase != "idle" and found.active_checkpoint_id is not None:
                # Busy at start (someone else's checkpoint): it must be exactly as found.
                now, then = (caps.phase, caps.active_checkpoint_id), (found.phase, found.active_checkpoint_id)
                if now != then:
                    raise Fail(f"server found at {then}, left at {now}")
                return f"server left as found: phase {caps.phase}, active id {caps.active_checkpoint_id!r}"
            if caps.phase != "idle" or caps.active_checkpoint_id is not None:
                raise Fail(
                    f"server left at phase {caps.phase}, active id {caps.active_checkpoint_id!r}"
                    + (f"; could not resume {', '.join(self._maybe_active)}" if self._maybe_active else "")
                )
            return "server back at idle, no active checkpoint"

        await self.check("cleanup.idle", idle)


def _summary(body: Any, keys: tuple[str, ...]) -> str:
    if not isinstance(body, dict):
        return ""
    parts = [f"{k}={body[k]}" for k in keys if k in body]
    return f"({', '.join(parts)})" if parts else ""


def _same_reply(reply: Reply, first: Any, what: str) -> str:
    expect(reply, 200)
    if reply.body != first:
        changed = sorted(
            k
            for k in set(first or {}) | set(reply.body or {})
            if (first or {}).get(k) != (reply.body or {}).get(k)
        )
        raise Fail(f"repeated {what} replied a different body (fields {', '.join(changed) or '?'})")
    return f"repeated {what} → the recorded reply, unchanged"


def _fence_snapshot(
    caps: Capabilities, phases: tuple[str, ...], checkpoint_id: str, deadline_ts: float
) -> str:
    problems: list[str] = []
    if caps.phase not in phases:
        problems.append(f"phase {caps.phase}, expected {' or '.join(phases)}")
    if caps.active_checkpoint_id != checkpoint_id:
        problems.append(f"active_checkpoint_id {caps.active_checkpoint_id!r}, expected {checkpoint_id!r}")
    if caps.deadline_ts is None or not math.isclose(caps.deadline_ts, deadline_ts, abs_tol=1e-3):
        problems.append(f"deadline_ts {caps.deadline_ts!r}, expected {deadline_ts!r}")
    if problems:
        raise Fail("capabilities fence snapshot: " + "; ".join(problems))
    return f"capabilities: phase {caps.phase}, active id and deadline as sent"


def _check_continuation_rows(data: bytes) -> None:
    keys: list[str] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = ContinuationRow.model_validate_json(line)
        except ValidationError as exc:
            raise Fail(f"continuations.jsonl line {number}: {first_error(exc)}") from exc
        if line != json.dumps(json.loads(line), separators=(",", ":")).encode():
            raise Fail(f"continuations.jsonl line {number} is not compact JSON")
        keys.append(row.capture_key)
    if keys != sorted(keys):
        raise Fail("continuations.jsonl rows are not sorted by capture key")


def _check_storage_rows(data: bytes) -> None:
    keys: list[str] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = StorageReference.model_validate_json(line)
        except ValidationError as exc:
            raise Fail(f"storage-references.jsonl line {number}: {first_error(exc)}") from exc
        keys.append(row.key)
    if len(keys) != len(set(keys)):
        raise Fail("storage-references.jsonl repeats a key")


#: Every row the checker can emit, and what its passing proves (spec sections in brackets).
CHECKS: Final[Mapping[str, str]] = {
    "capabilities.shape": "GET /capabilities answers without a token and validates as Capabilities: "
    "schema_version 1, the fence fields (phase, active_checkpoint_id, deadline_ts) present, "
    "a model states its instance_role [§2]",
    "capabilities.idle_at_start": "the server is idle with no active id: probing disturbs no checkpoint",
    "auth.post_missing_token": "a control POST without a token is refused with 401 and the spec's body [§1]",
    "auth.post_wrong_token": "a control POST with a wrong token is refused with 401 [§1]",
    "auth.status_missing_token": "the status GET without a token is refused with 401 [§1]",
    "auth.status_wrong_token": "the status GET with a wrong token is refused with 401 [§1]",
    "auxiliary.not_a_policy_instance": "an auxiliary model refuses pause, commit, restore and resume "
    "with 409 not_a_policy_instance [§3]",
    "auxiliary.status_allowed": "an auxiliary model's status GET is not refused as not_a_policy_instance "
    "[§3]",
    "validation.extra_field": "an unknown body field is refused with 422 [§1]",
    "validation.checkpoint_id": "ids outside 1-128 chars of ^[A-Za-z0-9][A-Za-z0-9._-]*$ "
    "(e.g. '-x', 129 chars, missing) are refused with 422 [§1]",
    "validation.deadline_ts": "a missing, non-finite (NaN, Infinity, 1e999) or non-numeric deadline_ts "
    "is refused with 422 — a non-finite one answered 500 is refused too, with a warning [§1]",
    "validation.schema_version": "schema_version other than 1 (2, 0) is refused with 422 [§1]",
    "validation.schema_version_optional": "a body without schema_version is accepted (pause/prepare, "
    "then resume) [§1]",
    "phase.commit_before_prepare": "commit at idle is refused with 409 invalid_phase [§1.1 table]",
    "phase.status_at_idle": "status at idle: 409 invalid_phase for a model or resources server, "
    "200 for an agent (allowed from any phase) [§1.1 table]",
    "phase.resume_at_idle": "resume at idle: 409 invalid_phase for a model, 200 for an agent or "
    "resources server, which stays idle [§1.1 table]",
    "cycle.prepare": "model pause / agent prepare (retrying agent_prepare_incomplete every 0.1 s) / "
    "resources prepare answers 200 with its reply model [§3-5]",
    "capabilities.fence_state_prepared": "after prepare, capabilities show the phase, the active id and "
    "the deadline that was sent (what recovery relies on) [§2]",
    "fence.replay_prepare": "repeating the same prepare replays the recorded reply unchanged [§1.1 rule 2]",
    "fence.conflict": "a second id while one is active is refused with 409 checkpoint_conflict [§1.1 rule 4]",
    "cycle.status": "status answers 200 for the active id: a model's long-poll reaches paused with 0 in "
    "flight and every worker acknowledged, an agent is ready_to_commit, resources report paused [§3-5]",
    "status.workers": "the drained model status has the shape of its multi_process mode: one worker "
    "naming the checkpoint_id, or Gym's coordinator (workers acknowledged = expected = live, no missing "
    "worker, per_worker acked_seq and connected) [§3]",
    "cycle.commit": "commit into a fresh dir answers 200 with its reply model (a model gets "
    "continuation_indexes: []) [§3-5]",
    "artifacts.manifest_digest": "the manifest at manifest_path(component, name) exists, is JSON, and "
    "its sha256 equals the reply's manifest_digest [§6]",
    "artifacts.index": "an agent's continuation_index names its continuations.jsonl whose sha256, bytes "
    "and records match, with valid rows sorted by capture key; a model's storage_reference_index "
    "(required when it declares external_storage_reference_index_v1) matches its file, rows valid and "
    "keys unique [§3-4]",
    "capabilities.fence_state_committed": "after commit, capabilities show committed_paused and the "
    "active id [§2]",
    "fence.replay_commit": "repeating the same commit replays the recorded reply unchanged [§1.1 rule 2]",
    "cycle.resume": "resume answers 200 with state accepting [§3-5]",
    "fence.replay_resume": "repeating the resume of the retired id replays its result [§1.1 rule 1]",
    "fence.stale_after_resume": "prepare/pause with the retired id is refused with 409 "
    "stale_checkpoint [§1.1 rule 1]",
    "acknowledge.auth": "acknowledge-completed with a well-formed batch in the agent's own form (pairs, "
    "or completion receipts for a later agent) but no token or a wrong one is refused with 401; a "
    "malformed batch without a token with 401 or, validated before the token as Gym does, 422 [§4]",
    "acknowledge.validation": "acknowledge-completed refuses an empty batch, an extra field, a negative "
    "attempt and a bad rollout id with 422, and a duplicate (422 or 409), each in the agent's own "
    "form [§4]",
    "acknowledge.unknown_execution": "acknowledging an execution the agent never finished, in its own "
    "form, is refused with 409 completed_execution_acknowledgement_error (nothing real is "
    "acknowledged) [§4]",
    "cleanup.idle": "after the run (whatever failed) the server is back at idle with no active id, "
    "or exactly as found if it was busy at start: everything the checker paused was resumed",
}

_AUTH: Final = tuple(n for n in CHECKS if n.startswith("auth."))
_VALIDATION: Final = tuple(n for n in CHECKS if n.startswith("validation."))
_PHASES: Final = tuple(n for n in CHECKS if n.startswith("phase."))
_CYCLE: Final = (
    "cycle.prepare",
    "capabilities.fence_state_prepared",
    "fence.replay_prepare",
    "fence.conflict",
    "cycle.status",
    "status.workers",
    "cycle.commit",
    "artifacts.manifest_digest",
    "artifacts.index",
    "capabilities.fence_state_committed",
    "fence.replay_commit",
    "cycle.resume",
    "fence.replay_resume",
    "fence.stale_after_resume",
)
_ACK: Final = tuple(n for n in CHECKS if n.startswith("acknowledge."))
_ALL_AFTER_CAPABILITIES: Final = (
    "capabilities.idle_at_start",
    *_AUTH,
    *_VALIDATION,
    *_PHASES,
    *_CYCLE,
    *_ACK,
    "cleanup.idle",
)
