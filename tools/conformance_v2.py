"""Conformance checker for Gym's unified checkpoint control plane ("v2", `/ng-control/v1/checkpoint/*`).

Point it at one participant's base URL: it drives the eight routes over plain HTTP (httpx, not
the coordinator) and reports one `CheckResult` per row of `CHECKS` (what each row's passing
proves). Wire models come from `quiesce.coordinator.protocol_v2`; the rules from Gym's
`_checkpoint/control.py` and `store.py`, and where running that code showed otherwise, from what it did.

Rules the checker keeps:
- Every probe uses a fresh id of this run (`qc-<hex>-<n>-<label>`); throwaway rollouts are
  `qc-<hex>-...` too, and every one it may have retired is forgotten before it ends.
- Only refusals of restore are probed: a restore that runs needs a freshly started server.
- A probe that should have been refused but was accepted is undone at once (resume, forget).
- It always ends with the server idle: whatever it activated is resumed in a `finally` shielded
  from cancellation; the last row (`cleanup.idle`) says whether the server is idle, holds no lease
  and no mark of this run. A server busy at start is left exactly as found.
- A connection the server closed (real Gym closes one after a 500) is reopened and the request
  sent once more; the token never appears in a row.

`detect_plane` tells the planes apart (v1 answers `GET /capabilities`; a v2 participant answers
it 404 and answers `GET /checkpoint/status` with a valid status) and `check_server` runs the
checker of the plane found or given.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import httpx
from pydantic import BaseModel, ValidationError

from quiesce.coordinator.errors import ConfigError
from quiesce.coordinator.protocol import CAPABILITIES_PATH
from quiesce.coordinator.protocol_v2 import (
    CHECKPOINT_CONFLICT,
    CHECKPOINT_ERROR,
    DEADLINE_EXCEEDED,
    INVALID_PHASE,
    LEGACY_RECORDS,
    MANIFEST,
    RECORD_MODELS,
    RECORDS_PATTERN,
    ROUTES,
    STALE_CHECKPOINT,
    STATUS_PATH,
    UNAUTHORIZED,
    CommitReply,
    EpisodeId,
    ForgetReply,
    ParticipantManifest,
    PrepareReply,
    RenewReply,
    ResumeReply,
    RetireReply,
    StatusReply,
    capture_key_of,
    episode_of_key,
    manifest_bytes,
    participant_dir,
    records_file_name,
)
from quiesce.coordinator.wording import count
from quiesce.tools.conformance import run_conformance
from quiesce.tools.conformance_report import (
    ConformanceReport,
    Plane,
    ServerUnreachable,
    first_error,
    transport_error,
)
from quiesce.tools.conformance_run import CheckRun, Fail, Reply, Skip, Warn, expect, send, validated
from quiesce.tools.conformance_run import work_dir as scratch_dir

__all__ = [
    "CHECKS",
    "DEFAULT_TIMEOUT_S",
    "LEASE_CHECK_MAX_GRACE_S",
    "check_server",
    "detect_plane",
    "run_conformance_v2",
]

#: A token no server should accept (the real one is never printed).
WRONG_TOKEN: Final = "quiesce-conformance-wrong-token"
#: The budget a probe sends (`deadline_ts = now + this`); each reply may take 5 s longer (Gym's own client).
DEFAULT_TIMEOUT_S: Final = 30.0
_REPLY_SLACK_S: Final = 5.0
#: `--lease-check` waits out one lease: it is skipped when the server's grace is longer than this.
LEASE_CHECK_MAX_GRACE_S: Final = 15.0
#: How far ahead the lease check's prepare sets its deadline.
LEASE_CHECK_DEADLINE_S: Final = 1.0
_POLL_S: Final = 0.2
#: Floats that went through JSON and a subtraction: equal within this.
_TOLERANCE_S: Final = 0.01


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


async def detect_plane(
    url: str,
    token: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[Plane, str]:
    """The plane `url` speaks and why: v2 when `GET /capabilities` is 404 and `GET /checkpoint/status`
    (with the token) answers a valid status; v1 otherwise (its checker then reports what is wrong).
    Raises `ServerUnreachable` when the URL answers nothing."""
    base = url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
        try:
            caps = await client.get(base + CAPABILITIES_PATH)
            if caps.status_code != 404:
                return "v1", f"GET {CAPABILITIES_PATH} answered {caps.status_code}"
            status = await client.get(base + STATUS_PATH, headers={"Authorization": f"Bearer {token}"})
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise ServerUnreachable(
                f"cannot reach {base}: {type(exc).__name__}: {exc}. "
                "Is the server running, and is URL its base (without /ng-control/v1)?"
            ) from exc
    try:
        parsed = StatusReply.model_validate(status.json()) if status.status_code == 200 else None
    except (ValueError, ValidationError):
        parsed = None
    if parsed is None:
        return "v1", f"GET {CAPABILITIES_PATH} 404 and GET {STATUS_PATH} answered {status.status_code}"
    return "v2", f"GET {CAPABILITIES_PATH} 404; GET {STATUS_PATH} answered {_a(parsed.kind)} status"


async def check_server(
    url: str,
    token: str,
    *,
    plane: Plane | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    lease_check: bool = False,
    work_dir: Path | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> ConformanceReport:
    """Check `url` against `plane` (None: detect it). `lease_check` applies to v2 only."""
    if not token:
        raise ConfigError("the control-plane token is empty")
    if plane is None:
        plane, why = await detect_plane(url, token, timeout_s=timeout_s, transport=transport)
    else:
        why = f"--plane {plane} given"
    if plane == "v1":
        return await run_conformance(url, token, timeout_s=timeout_s, work_dir=work_dir, transport=transport)
    return await run_conformance_v2(
        url,
        token,
        timeout_s=timeout_s,
        lease_check=lease_check,
        work_dir=work_dir,
        transport=transport,
        plane_reason=why,
    )


async def run_conformance_v2(
    url: str,
    token: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    lease_check: bool = False,
    work_dir: Path | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    plane_reason: str = "the caller named the unified plane",
) -> ConformanceReport:
    """Probe the v2 participant at `url` (its base URL) and report every row of `CHECKS`.

    Commits go into a fresh folder under `work_dir` (default: a temp dir removed afterwards), so
    the server must share this machine's filesystem. `lease_check` also waits out one lease (needs
    a server started with a short `lease_grace_seconds`). Raises `ServerUnreachable` when the URL
    answers nothing; every other problem is a failed row."""
    if not token:
        raise ConfigError("the control-plane token is empty")
    base = url.rstrip("/")
    client = httpx.AsyncClient(timeout=timeout_s + _REPLY_SLACK_S, transport=transport)
    with scratch_dir(work_dir, "conformance-v2") as folder:
        async with client:
            checker = _Checker(client, base, token, timeout_s, folder, lease_check=lease_check)
            await checker.run(plane_reason)
            return checker.report


# ---------------------------------------------------------------------------------------------
# Plumbing
# ---------------------------------------------------------------------------------------------


def _refused_by_validation(reply: Reply) -> bool:
    """FastAPI's 422 (`{"detail": [...]}`, no envelope): the body was refused before anything ran."""
    return reply.status == 422 and reply.code is None


def _episode(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    return {"rollout_id": rollout_id, "attempt": attempt}


_Case = tuple[str, str, Any, bytes | None]  # label, operation, json body, raw body


class _Checker(CheckRun):
    """One run against one v2 participant. Checks append rows to `report.results` in order."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base: str,
        token: str,
        timeout_s: float,
        folder: Path,
        *,
        lease_check: bool,
    ) -> None:
        super().__init__(ConformanceReport(url=base, plane="v2"), token, timeout_s + _REPLY_SLACK_S, CHECKS)
        self.client = client
        self.base = base
        self.timeout_s = timeout_s
        self.folder = folder
        self.lease_check = lease_check
        self.run_id = f"qc-{secrets.token_hex(4)}"
        self._serial = 0
        #: Ids a POST may have made active and not yet resumed (resumed in `_cleanup`).
        self._maybe_active: list[str] = []
        #: Rollouts a retire of this run may have marked (forgotten in `_cleanup`).
        self._maybe_marked: set[str] = set()
        self.start: StatusReply | None = None
        self.grace_s: float | None = None

    # -- ids, bodies, requests ----------------------------------------------------------------

    def new_id(self, label: str) -> str:
        self._serial += 1
        return f"{self.run_id}-{self._serial}-{label}"

    def deadline(self) -> float:
        return time.time() + self.timeout_s

    def body(self, checkpoint_id: str, **extra: Any) -> dict[str, Any]:
        return {"checkpoint_id": checkpoint_id, "deadline_ts": self.deadline(), **extra}

    def dir_for(self, label: str, *, create: bool = True) -> str:
        target = self.folder / label
        if create:
            target.mkdir(parents=True, exist_ok=True)
        return str(target)

    @property
    def kind(self) -> str:
        assert self.start is not None
        return self.start.kind

    async def request(
        self, method: str, path: str, *, token: str | None, json_body: Any = None, raw: bytes | None = None
    ) -> Reply:
        return await send(self.client, method, self.base + path, token=token, json_body=json_body, raw=raw)

    async def post(
        self,
        op: str,
        body: Any = None,
        *,
        token: str | Literal["default"] | None = "default",
        raw: bytes | None = None,
    ) -> Reply:
        """POST one operation; remembers what it may have left active or marked, for `_cleanup`."""
        reply = await self.request(
            "POST",
            ROUTES[op].full_path,
            token=self.token if token == "default" else token,
            json_body=body,
            raw=raw,
        )
        if not isinstance(body, dict):
            return reply
        checkpoint_id = body.get("checkpoint_id")
        if op == "retire" and reply.status != 422:
            for episode in body.get("episode_ids") or ():
                if isinstance(episode, dict) and isinstance(episode.get("rollout_id"), str):
                    self._maybe_marked.add(episode["rollout_id"])
        if isinstance(checkpoint_id, str) and reply.ok:
            if op == "resume":
                if checkpoint_id in self._maybe_active:
                    self._maybe_active.remove(checkpoint_id)
            elif op in ("prepare", "renew", "commit", "restore") and checkpoint_id not in self._maybe_active:
                self._maybe_active.append(checkpoint_id)
        return reply

    async def status(self, *, token: str | Literal["default"] | None = "default") -> Reply:
        return await self.request("GET", STATUS_PATH, token=self.token if token == "default" else token)

    async def fresh_status(self) -> StatusReply:
        return validated(StatusReply, await self.status(), "status")

    async def resume_quietly(self, checkpoint_id: str) -> None:
        with suppress(httpx.HTTPError):
            await self.post("resume", self.body(checkpoint_id))

    async def undo(self, reply: Reply, checkpoint_id: str | None) -> None:
        """A probe that should have been refused was accepted: resume its id so later checks run."""
        if reply.ok and checkpoint_id is not None:
            await self.resume_quietly(checkpoint_id)

    # -- the run ------------------------------------------------------------------------------

    async def run(self, plane_reason: str) -> None:
        self.add("plane.detected", "pass", f"unified plane: {plane_reason}")
        try:
            first = await self.status()
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            what = transport_error(exc) if isinstance(exc, httpx.HTTPError) else str(exc)
            raise ServerUnreachable(f"cannot reach {self.base}{STATUS_PATH}: {what}") from exc
        await self.check("status.shape", lambda: self._check_shape(first))
        start = self.start
        if start is None:
            self.skip(_AFTER_SHAPE, "status did not validate: the participant is unknown")
            return
        self.report.component, self.report.name = start.kind, start.instance
        idle = await self.check("status.idle_at_start", self._check_idle_at_start)
        try:
            await self._check_auth()
            if not idle:
                self.skip(_STATEFUL, "server not idle at start: not touching another checkpoint")
                return
            await self._check_validation()
            await self._check_phases()
            await self._check_cycle()
            await self._check_commit_scope()
            await self._check_deadlines()
            await self._check_retire_round_trip()
            await self._check_lease_expiry()
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()

    # -- status --------------------------------------------------------------------------------

    async def _check_shape(self, reply: Reply) -> str:
        status = validated(StatusReply, reply, "status")
        self.start = status  # usable even with problems: the other checks still run
        problems = _extras_problems(status.kind, reply.body)
        if problems:
            raise Fail("; ".join(problems))
        extras = ", ".join(sorted(_KIND_EXTRAS[status.kind]))
        return f"{status.kind} {status.instance!r}: {extras} as the kind requires"

    async def _check_idle_at_start(self) -> str:
        start = self.start
        assert start is not None
        if start.phase != "idle" or start.checkpoint_id is not None:
            raise Fail(
                f"phase {start.phase}, checkpoint_id {start.checkpoint_id!r}: another checkpoint is open"
            )
        if start.lease_expires_at is not None:
            raise Fail(f"idle with a lease ({start.lease_expires_at!r}): an idle participant holds none")
        return "phase idle, no checkpoint id, no lease"

    # -- auth ------------------------------------------------------------------------------------

    def _auth_cases(self) -> list[tuple[str, dict[str, Any]]]:
        """A valid body for every POST route; each is harmless if a broken server runs it (undone)."""
        nowhere = self.dir_for("auth-nowhere", create=False)
        rollout = f"{self.run_id}-auth"
        return [
            ("prepare", self.body(self.new_id("auth"))),
            ("renew", self.body(self.new_id("auth"))),
            ("commit", self.body(self.new_id("auth"), checkpoint_dir=nowhere, episode_ids=[])),
            ("restore", self.body(self.new_id("auth"), checkpoint_dir=nowhere, episode_ids=[])),
            ("resume", self.body(self.new_id("auth"))),
            ("retire", self.body(self.new_id("auth"), episode_ids=[_episode(rollout)])),
            ("forget", self.body(self.new_id("auth"), rollout_ids=[rollout])),
        ]

    async def _check_auth(self) -> None:
        async def refused_with(token: str | None) -> str:
            bad: list[str] = []
            for op, body in self._auth_cases():
                reply = await self.post(op, body, token=token)
                if reply.status != 401 or reply.code != UNAUTHORIZED:
                    bad.append(f"POST {op}: {reply.describe()}")
                await self.undo(reply, body["checkpoint_id"] if op != "resume" else None)
            reply = await self.status(token=token)
            if reply.status != 401 or reply.code != UNAUTHORIZED:
                bad.append(f"GET status: {reply.describe()}")
            if bad:
                raise Fail(f"expected 401 {UNAUTHORIZED}; " + "; ".join(bad))
            return f"7 POST routes and GET status → 401 {UNAUTHORIZED}"

        async def malformed_first() -> str:
            checkpoint_id = self.new_id("auth")
            reply = await self.post("prepare", self.body(checkpoint_id, unexpected_field=1), token=None)
            await self.undo(reply, checkpoint_id)
            if _refused_by_validation(reply):
                return "a malformed body without a token → 422 (validated before auth, as real Gym does)"
            if reply.status == 401 and reply.code == UNAUTHORIZED:
                return f"a malformed body without a token → 401 {UNAUTHORIZED}"
            raise Fail(f"a malformed body without a token: expected 422 or 401, got {reply.describe()}")

        await self.check("auth.missing_token", lambda: refused_with(None))
        await self.check("auth.wrong_token", lambda: refused_with(WRONG_TOKEN))
        await self.check("auth.malformed_body", malformed_first)

    # -- validation (FastAPI's 422) ------------------------------------------------------------------

    async def _expect_422(self, cases: list[_Case], *, tolerate_500: Iterable[str] = ()) -> str:
        """Each case must be refused by validation (422 without an envelope); a case in `tolerate_500`
        may get a 500 (still refused; a warning). An accepted case is undone."""
        bad: list[str] = []
        warned: list[str] = []
        tolerated = set(tolerate_500)
        for label, op, body, raw in cases:
            try:
                reply = await self.post(op, body, raw=raw)
            except httpx.HTTPError as exc:
                bad.append(f"{label}: {transport_error(exc)}")
                continue
            if reply.status == 500 and label in tolerated:
                warned.append(label)
            elif not _refused_by_validation(reply):
                bad.append(f"{label}: {reply.describe()}")
            if (
                op in ("prepare", "renew")
                and isinstance(body, dict)
                and isinstance(body.get("checkpoint_id"), str)
            ):
                await self.undo(reply, body["checkpoint_id"])
        if bad:
            raise Fail("expected 422 (FastAPI's, before anything ran); " + "; ".join(bad))
        if warned:
            raise Warn(
                f"{count(len(cases), 'case')} refused; {', '.join(warned)} answered 500 instead of 422 — the"
                " validation error could not be rendered as JSON (real Gym does this; still refused)"
            )
        return f"{count(len(cases), 'case')} → 422"

    async def _check_validation(self) -> None:
        nowhere = self.dir_for("validation-nowhere", create=False)
        rollout = f"{self.run_id}-v"

        async def extra_field() -> str:
            return await self._expect_422(
                [("extra field", "prepare", self.body(self.new_id("extra"), unexpected_field=1), None)]
            )

        async def schema_version() -> str:
            body = self.body(self.new_id("schema"), schema_version=1)
            return await self._expect_422([("schema_version 1 (a v1-shaped body)", "prepare", body, None)])

        async def checkpoint_ids() -> str:
            long_id = (self.new_id("long") + "x" * 129)[:129]
            cases: list[_Case] = [
                (repr(bad), "prepare", self.body(bad), None) for bad in ("-x", "", "a b", ".x", "x/y")
            ]
            cases.append(("129 chars", "prepare", self.body(long_id), None))
            cases.append(("missing", "prepare", {"deadline_ts": self.deadline()}, None))
            return await self._expect_422(cases)

        async def deadlines() -> str:
            checkpoint_id = self.new_id("deadline")
            prefix = f'{{"checkpoint_id": "{checkpoint_id}", "deadline_ts": '
            cases: list[_Case] = [
                ("missing", "prepare", {"checkpoint_id": checkpoint_id}, None),
                ("a word", "prepare", self.body(checkpoint_id, deadline_ts="soon"), None),
                ("NaN", "prepare", {"checkpoint_id": checkpoint_id}, (prefix + "NaN}").encode()),
                ("Infinity", "prepare", {"checkpoint_id": checkpoint_id}, (prefix + "Infinity}").encode()),
                ("1e999", "prepare", {"checkpoint_id": checkpoint_id}, (prefix + "1e999}").encode()),
            ]
            return await self._expect_422(cases, tolerate_500=("NaN", "Infinity", "1e999"))

        async def episode_ids() -> str:
            # On commit at idle: a server that wrongly accepts the body refuses the phase (no effect).
            def commit(*episodes: Any) -> dict[str, Any]:
                return self.body(self.new_id("episode"), checkpoint_dir=nowhere, episode_ids=list(episodes))

            cases: list[_Case] = [
                ("rollout id ending in -a1", "commit", commit(_episode(f"{rollout}-a1")), None),
                ("negative attempt", "commit", commit(_episode(rollout, -1)), None),
                ("extra field", "commit", commit({**_episode(rollout), "capture_key": rollout}), None),
                ("a capture key instead of an episode", "commit", commit(rollout), None),
                ("bad rollout id '-x'", "commit", commit(_episode("-x")), None),
                ("no rollout id", "commit", commit({"attempt": 0}), None),
            ]
            return await self._expect_422(cases)

        async def required_lists() -> str:
            cases: list[_Case] = [
                ("retire without episode_ids", "retire", self.body(self.new_id("list")), None),
                (
                    "retire with episode_ids []",
                    "retire",
                    self.body(self.new_id("list"), episode_ids=[]),
                    None,
                ),
                (
                    "forget with rollout_ids []",
                    "forget",
                    self.body(self.new_id("list"), rollout_ids=[]),
                    None,
                ),
            ]
            return await self._expect_422(cases)

        async def checkpoint_dir() -> str:
            cases: list[_Case] = [
                (
                    'commit checkpoint_dir ""',
                    "commit",
                    self.body(self.new_id("dir"), checkpoint_dir=""),
                    None,
                ),
                ("commit without checkpoint_dir", "commit", self.body(self.new_id("dir")), None),
                (
                    'restore checkpoint_dir ""',
                    "restore",
                    self.body(self.new_id("dir"), checkpoint_dir="", episode_ids=[]),
                    None,
                ),
            ]
            return await self._expect_422(cases)

        async def restore_scope() -> str:
            body = self.body(self.new_id("scope"), checkpoint_dir=nowhere)
            detail = await self._expect_422([("restore without episode_ids", "restore", body, None)])
            return detail + " (restore runs only on a fresh server: its refusals alone are checked)"

        await self.check("validation.extra_field", extra_field)
        await self.check("validation.schema_version", schema_version)
        await self.check("validation.checkpoint_id", checkpoint_ids)
        await self.check("validation.deadline_ts", deadlines)
        await self.check("validation.episode_ids", episode_ids)
        await self.check("validation.required_lists", required_lists)
        await self.check("validation.checkpoint_dir", checkpoint_dir)
        await self.check("restore.scope_required", restore_scope)

    # -- phases at idle ------------------------------------------------------------------------------

    async def _check_phases(self) -> None:
        async def refused_at_idle(op: str) -> str:
            checkpoint_id = self.new_id("early")
            extra = {"checkpoint_dir": self.dir_for("early"), "episode_ids": []} if op == "commit" else {}
            reply = await self.post(op, self.body(checkpoint_id, **extra))
            await self.undo(reply, checkpoint_id)
            expect(reply, 409, INVALID_PHASE, f"{op} at idle")
            return f"{op} at idle → 409 {INVALID_PHASE}"

        async def resume_at_idle() -> str:
            checkpoint_id = self.new_id("idle")
            reply = await self.post("resume", self.body(checkpoint_id))
            resumed = validated(ResumeReply, reply, "resume at idle")
            if not resumed.idempotent:
                raise Fail("resume of an id never prepared, at idle: expected idempotent true")
            late = await self.post("prepare", self.body(checkpoint_id))
            await self.undo(late, checkpoint_id)
            expect(late, 409, STALE_CHECKPOINT, "a prepare after that resume")
            return f"resume at idle → idempotent true, and fences the id: prepare → 409 {STALE_CHECKPOINT}"

        await self.check("phase.commit_at_idle", lambda: refused_at_idle("commit"))
        await self.check("phase.renew_at_idle", lambda: refused_at_idle("renew"))
        await self.check("fence.resume_at_idle", resume_at_idle)

    # -- one cycle --------------------------------------------------------------------------------------

    async def prepare_until_ready(self, body: dict[str, Any]) -> tuple[Reply, PrepareReply]:
        """Prepare, and again while `preparing` (the same body), until `prepared` or the deadline."""
        while True:
            reply = await self.post("prepare", body)
            parsed = validated(PrepareReply, reply, "prepare")
            if parsed.phase == "prepared":
                if not parsed.report.ready:
                    raise Fail("prepare answered phase prepared with report.ready false")
                return reply, parsed
            if parsed.phase != "preparing":
                raise Fail(f"prepare answered phase {parsed.phase!r} (nothing resumed it)")
            if time.time() >= body["deadline_ts"]:
                blockers = ", ".join(parsed.report.blockers[:5]) or "none listed"
                raise Fail(
                    f"still preparing at the deadline: {parsed.report.blocker_count} blockers ({blockers})"
                )
            await anyio.sleep(_POLL_S)

    def commit_scope(self) -> list[dict[str, Any]]:
        """The cycle's scope: the restored attempts the status lists as pending, so the commit deletes
        none (an idle fresh server: an empty scope)."""
        body = self.start.model_extra if self.start is not None else None
        keys: set[str] = set()
        for field_name in ("restored_pending", "restored_generation_cuts"):
            value = (body or {}).get(field_name)
            if isinstance(value, list):
                keys.update(k for k in value if isinstance(k, str))
        scope: list[dict[str, Any]] = []
        for key in sorted(keys):
            try:
                episode = episode_of_key(key)
            except ValueError:
                continue
            scope.append(episode.model_dump())
        return scope

    async def _check_cycle(self) -> None:
        checkpoint_id = self.new_id("cycle")
        prepare_body = self.body(checkpoint_id)
        commit_body = self.body(
            checkpoint_id, checkpoint_dir=self.dir_for("commit"), episode_ids=self.commit_scope()
        )
        state: dict[str, Any] = {}

        async def prepare() -> str:
            reply, parsed = await self.prepare_until_ready(prepare_body)
            state["prepare"] = reply.body
            return f"prepare → prepared, ready ({parsed.report.counts or 'no counts'})"

        if not await self.check("cycle.prepare", prepare):
            self.skip(_CYCLE[1:], "needs cycle.prepare")
            await self.resume_quietly(checkpoint_id)
            return

        async def status_prepared() -> str:
            status = await self.fresh_status()
            problems = _phase_problems(status, "prepared", checkpoint_id)
            lease = status.lease_expires_at
            if lease is None or lease < prepare_body["deadline_ts"]:
                problems.append(f"lease_expires_at {lease!r}, expected at least the deadline sent")
            else:
                self.grace_s = lease - prepare_body["deadline_ts"]
            if not status.report.ready:
                problems.append("report.ready false")
            if problems:
                raise Fail("status after prepare: " + "; ".join(problems))
            return f"status: prepared, the id, ready, lease = deadline + {self.grace_s:g}s grace"

        async def replay_prepare() -> str:
            return _same(await self.post("prepare", prepare_body), state["prepare"], "prepare")

        async def conflict() -> str:
            other = self.new_id("other")
            reply = await self.post("prepare", self.body(other))
            await self.undo(reply, other)
            expect(reply, 409, CHECKPOINT_CONFLICT, "prepare of a second id")
            return f"prepare of a second id → 409 {CHECKPOINT_CONFLICT}"

        async def restore_conflict() -> str:
            other = self.new_id("restore")
            body = self.body(
                other, checkpoint_dir=self.dir_for("restore-nowhere", create=False), episode_ids=[]
            )
            reply = await self.post("restore", body)
            await self.undo(reply, other)
            expect(reply, 409, CHECKPOINT_CONFLICT, "restore of another id while one is active")
            return f"restore of another id while one is active → 409 {CHECKPOINT_CONFLICT}"

        async def retire_or_forget_prepared(op: str) -> str:
            rollout = f"{self.run_id}-phase"
            extra = {"episode_ids": [_episode(rollout)]} if op == "retire" else {"rollout_ids": [rollout]}
            reply = await self.post(op, self.body(checkpoint_id, **extra))
            expect(reply, 409, INVALID_PHASE, f"{op} while prepared")
            return f"{op} while prepared → 409 {INVALID_PHASE} (resume first)"

        async def renew() -> str:
            return await self._check_renew(checkpoint_id, prepare_body["deadline_ts"])

        async def commit() -> str:
            reply = await self.post("commit", commit_body)
            parsed = validated(CommitReply, reply, "commit")
            problems = self._commit_problems(parsed, reply.body, checkpoint_id)
            state["commit"], state["commit_parsed"] = reply.body, parsed
            if problems:
                raise Fail("; ".join(problems))
            scope = commit_body["episode_ids"]
            return (
                f"commit (scope of {count(len(scope), 'episode')}) → committed, "
                f"{count(parsed.manifest.record_count, 'record')}"
            )

        async def replay_commit() -> str:
            return _same(await self.post("commit", commit_body), state["commit"], "commit")

        async def commit_other_dir() -> str:
            other_dir = self.dir_for("commit-other")
            reply = await self.post("commit", {**commit_body, "checkpoint_dir": other_dir})
            if _manifests_under(Path(other_dir)):
                raise Fail(
                    f"a commit retry into another dir wrote a second manifest there ({reply.describe()})"
                )
            if reply.status == 409 and reply.code == CHECKPOINT_CONFLICT:
                return f"commit retry into another dir → 409 {CHECKPOINT_CONFLICT}, nothing written there"
            if reply.ok and reply.body == state["commit"]:
                return (
                    "commit retry into another dir → the recorded reply (real Gym after success), nothing"
                    " written"
                )
            raise Fail(
                f"commit retry into another dir: expected 409 {CHECKPOINT_CONFLICT} or the recorded reply, "
                f"got {reply.describe()}"
            )

        async def status_committed() -> str:
            problems = _phase_problems(await self.fresh_status(), "committed", checkpoint_id)
            if problems:
                raise Fail("status after commit: " + "; ".join(problems))
            return "status: committed, the id"

        committed = False
        try:
            await self.check("cycle.status_prepared", status_prepared)
            await self.check("fence.replay_prepare", replay_prepare)
            await self.check("fence.conflict", conflict)
            await self.check("restore.conflict_while_active", restore_conflict)
            await self.check("phase.retire_while_prepared", lambda: retire_or_forget_prepared("retire"))
            await self.check("phase.forget_while_prepared", lambda: retire_or_forget_prepared("forget"))
            await self.check("lease.renew", renew)
            committed = await self.check("cycle.commit", commit)
            if "commit_parsed" in state:
                await self._check_storage(
                    state["commit_parsed"], state["commit"]["manifest"], Path(commit_body["checkpoint_dir"])
                )
            else:
                self.skip(("storage.manifest", "storage.records"), "needs cycle.commit")
            if committed:
                await self.check("fence.replay_commit", replay_commit)
                await self.check("fence.commit_other_dir", commit_other_dir)
                await self.check("cycle.status_committed", status_committed)
            else:
                self.skip(
                    ("fence.replay_commit", "fence.commit_other_dir", "cycle.status_committed"),
                    "needs cycle.commit",
                )
        finally:
            with anyio.CancelScope(shield=True):
                resumed = await self.check("cycle.resume", lambda: self._resume_to_idle(checkpoint_id))

        if not resumed:
            self.skip(("fence.resume_again", "fence.stale_after_resume"), "needs cycle.resume")
            return

        async def resume_again() -> str:
            parsed = validated(
                ResumeReply, await self.post("resume", self.body(checkpoint_id)), "resume again"
            )
            if not parsed.idempotent:
                raise Fail("a second resume of the same id: expected idempotent true")
            return "resume again → idle, idempotent true"

        async def stale() -> str:
            bad: list[str] = []
            for op in ("prepare", "renew"):
                reply = await self.post(op, self.body(checkpoint_id))
                await self.undo(reply, checkpoint_id)
                if reply.status != 409 or reply.code != STALE_CHECKPOINT:
                    bad.append(f"{op}: {reply.describe()}")
            if bad:
                raise Fail(f"the resumed id: expected 409 {STALE_CHECKPOINT}; " + "; ".join(bad))
            return f"prepare and renew of the resumed id → 409 {STALE_CHECKPOINT}"

        await self.check("fence.resume_again", resume_again)
        await self.check("fence.stale_after_resume", stale)

    async def _resume_to_idle(self, checkpoint_id: str) -> str:
        parsed = validated(ResumeReply, await self.post("resume", self.body(checkpoint_id)), "resume")
        if parsed.idempotent:
            raise Fail("the first resume of an active id answered idempotent true")
        status = await self.fresh_status()
        problems = _phase_problems(status, "idle", None)
        if status.lease_expires_at is not None:
            problems.append(f"lease_expires_at {status.lease_expires_at!r}, expected null")
        if problems:
            raise Fail("status after resume: " + "; ".join(problems))
        return "resume → idle, idempotent false; status idle, no id, no lease"

    async def _check_renew(self, checkpoint_id: str, prepared_deadline: float) -> str:
        grace = self.grace_s
        if grace is None:
            raise Skip("needs the grace measured by cycle.status_prepared")
        if grace <= 0:
            raise Fail(f"lease grace {grace:g}s: the lease must outlast the deadline (grace > 0)")
        later = prepared_deadline + 5.0
        renewed = validated(
            RenewReply,
            await self.post("renew", {"checkpoint_id": checkpoint_id, "deadline_ts": later}),
            "renew",
        )
        if not math.isclose(renewed.lease_expires_at, later + grace, abs_tol=_TOLERANCE_S):
            raise Fail(
                f"renew to deadline+5s: lease_expires_at {renewed.lease_expires_at!r}, expected deadline"
                f" + grace = {later + grace!r}"
            )
        earlier = prepared_deadline - 5.0
        kept = validated(
            RenewReply,
            await self.post("renew", {"checkpoint_id": checkpoint_id, "deadline_ts": earlier}),
            "renew",
        )
        if not math.isclose(kept.lease_expires_at, renewed.lease_expires_at, abs_tol=_TOLERANCE_S):
            raise Fail(f"renew to an earlier deadline shrank the lease to {kept.lease_expires_at!r}")
        status = await self.fresh_status()
        if status.lease_expires_at is None or not math.isclose(
            status.lease_expires_at, renewed.lease_expires_at, abs_tol=_TOLERANCE_S
        ):
            raise Fail(f"status lease_expires_at {status.lease_expires_at!r} differs from renew's")
        return "renew → lease = deadline + grace; an earlier deadline never shrinks it; status agrees"

    def _commit_problems(self, reply: CommitReply, body: Any, checkpoint_id: str) -> list[str]:
        start = self.start
        assert start is not None
        manifest = reply.manifest
        problems: list[str] = []
        wanted = (start.kind, start.instance, checkpoint_id)
        found = (manifest.kind, manifest.instance, manifest.checkpoint_id)
        if found != wanted:
            problems.append(f"manifest (kind, instance, checkpoint_id) {found}, expected {wanted}")
        if reply.episode_ids != sorted(set(reply.episode_ids)):
            problems.append("episode_ids are not sorted and unique")
        has_keys = {k for k in ("staging_keys", "staging_keys_by_episode") if k in body}
        if start.kind == "model":
            if has_keys != {"staging_keys", "staging_keys_by_episode"}:
                problems.append("a model's commit reply must carry staging_keys and staging_keys_by_episode")
            elif reply.staging_keys != sorted(set(reply.staging_keys or [])):
                problems.append("staging_keys are not sorted and unique")
        elif has_keys:
            problems.append(
                f"{_a(start.kind)} commit reply carries {', '.join(sorted(has_keys))} (a model's fields)"
            )
        return problems

    async def _check_storage(self, reply: CommitReply, replied: Any, checkpoint_dir: Path) -> None:
        """The files of a commit: `replied` is the reply's manifest as sent."""
        start = self.start
        assert start is not None
        folder = checkpoint_dir / participant_dir(start.kind, start.instance)

        async def manifest() -> str:
            path = folder / MANIFEST
            if not path.is_file():
                raise Fail(
                    f"{path.relative_to(checkpoint_dir)} not found (the server must share this filesystem)"
                )
            data = path.read_bytes()
            try:
                parsed = ParticipantManifest.model_validate_json(data)
                document = json.loads(data)
            except (ValidationError, ValueError) as exc:
                detail = first_error(exc) if isinstance(exc, ValidationError) else str(exc)
                raise Fail(f"manifest.json does not validate: {detail}") from exc
            problems: list[str] = []
            if data != manifest_bytes(document):
                problems.append("not written with sorted keys and indent 1")
            if document != replied:
                problems.append("differs from the commit reply's manifest")
            if (parsed.kind, parsed.instance) != (start.kind, start.instance):
                problems.append(
                    f"kind/instance {parsed.kind}/{parsed.instance}, expected {start.kind}/{start.instance}"
                )
            if problems:
                raise Fail("manifest.json: " + "; ".join(problems))
            return (
                f"gym/{start.kind}/{start.instance}/manifest.json: schema 1, sorted keys, as the reply says"
            )

        async def records() -> str:
            name = reply.manifest.records_file
            if name == LEGACY_RECORDS:
                raise Fail(f"records file {name!r}: a writer names it records-<sha256>.jsonl")
            if not RECORDS_PATTERN.match(name):
                raise Fail(f"records file {name!r} is not records-<sha256>.jsonl")
            path = folder / name
            if not path.is_file():
                raise Fail(f"{name} not found beside the manifest")
            data = path.read_bytes()
            problems: list[str] = []
            if hashlib.sha256(data).hexdigest() != reply.manifest.records_sha256:
                problems.append("sha256 differs from records_sha256")
            if name != records_file_name(reply.manifest.records_sha256):
                problems.append("the name is not records-<records_sha256>.jsonl")
            lines = data.split(b"\n")
            if lines[-1] != b"":
                problems.append("the last record does not end in a newline")
            lines = lines[:-1]
            if len(lines) != reply.manifest.record_count:
                problems.append(f"{len(lines)} lines, record_count {reply.manifest.record_count}")
            keys: list[str] = []
            model = RECORD_MODELS[start.kind]
            for number, line in enumerate(lines, start=1):
                problem, key = _record_problem(model, line)
                if problem:
                    problems.append(f"line {number}: {problem}")
                    break
                keys.append(key)
            if not problems and sorted(set(keys)) != reply.episode_ids:
                problems.append(
                    f"the records' capture keys {sorted(set(keys))} differ from the reply's episode_ids"
                )
            leftovers = sorted(p.name for p in folder.iterdir() if p.name.startswith(".records.jsonl."))
            if leftovers:
                problems.append(f"temporary files left: {', '.join(leftovers)}")
            if problems:
                raise Fail(f"{name}: " + "; ".join(problems))
            return (
                f"{count(len(lines), 'record')}, digest and count as the manifest says, episode ids objects"
            )

        await self.check("storage.manifest", manifest)
        await self.check("storage.records", records)

    # -- a model's scope ---------------------------------------------------------------------------------

    async def _check_commit_scope(self) -> None:
        async def null_scope() -> str:
            if self.kind != "model":
                raise Skip(f"only a model requires a commit scope ({_a(self.kind)} exports all it holds)")
            checkpoint_id = self.new_id("noscope")
            try:
                await self.prepare_until_ready(self.body(checkpoint_id))
                target = self.dir_for("noscope")
                reply = await self.post(
                    "commit", self.body(checkpoint_id, checkpoint_dir=target, episode_ids=None)
                )
                expect(reply, 409, CHECKPOINT_ERROR, "a model commit with episode_ids null")
                return f"a model commit with episode_ids null → 409 {CHECKPOINT_ERROR}"
            finally:
                with anyio.CancelScope(shield=True):
                    await self.resume_quietly(checkpoint_id)

        await self.check("commit.scope_required", null_scope)

    # -- passed deadlines -------------------------------------------------------------------------------

    def _late(self, checkpoint_id: str, **extra: Any) -> dict[str, Any]:
        return {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() - 1.0, **extra}

    async def _check_deadlines(self) -> None:
        nowhere = self.dir_for("late-nowhere", create=False)
        rollout = f"{self.run_id}-late"

        async def commit() -> str:
            checkpoint_id = self.new_id("late")
            target = Path(self.dir_for("late-commit"))
            try:
                await self.prepare_until_ready(self.body(checkpoint_id))
                body = self._late(checkpoint_id, checkpoint_dir=str(target), episode_ids=self.commit_scope())
                reply = await self.post("commit", body)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.resume_quietly(checkpoint_id)
            expect(reply, 409, DEADLINE_EXCEEDED, "commit with a passed deadline")
            if _manifests_under(target):
                raise Fail("commit with a passed deadline published a manifest")
            return f"commit (prepared) with a passed deadline → 409 {DEADLINE_EXCEEDED}, nothing published"

        async def late(op: str, extra: dict[str, Any]) -> str:
            checkpoint_id = self.new_id("late")
            reply = await self.post(op, self._late(checkpoint_id, **extra))
            await self.undo(reply, checkpoint_id if op == "restore" else None)
            expect(reply, 409, DEADLINE_EXCEEDED, f"{op} with a passed deadline")
            return f"{op} (idle) with a passed deadline → 409 {DEADLINE_EXCEEDED}"

        await self.check("deadline.commit", commit)
        await self.check(
            "deadline.restore", lambda: late("restore", {"checkpoint_dir": nowhere, "episode_ids": []})
        )
        await self.check("deadline.retire", lambda: late("retire", {"episode_ids": [_episode(rollout)]}))
        await self.check("deadline.forget", lambda: late("forget", {"rollout_ids": [rollout]}))

    # -- retire and forget -------------------------------------------------------------------------------

    async def _check_retire_round_trip(self) -> None:
        async def round_trip() -> str:
            before = (await self.fresh_status()).retired_rollouts
            first, second = f"{self.run_id}-ra", f"{self.run_id}-rb"
            episodes = [_episode(second, 2), _episode(first)]
            retired = validated(
                RetireReply,
                await self.post("retire", self.body(self.new_id("retire"), episode_ids=episodes)),
                "retire",
            )
            wanted = [capture_key_of(second, 2), first]
            if retired.retired != wanted:
                raise Fail(
                    f"retire answered {retired.retired}, expected the capture keys in request order {wanted}"
                )
            marked = (await self.fresh_status()).retired_rollouts
            if marked != before + 2:
                raise Fail(f"retired_rollouts {marked} after retiring 2 rollouts, expected {before + 2}")
            forgotten = validated(
                ForgetReply,
                await self.post("forget", self.body(self.new_id("forget"), rollout_ids=[second, first])),
                "forget",
            )
            if forgotten.forgotten != sorted([first, second]):
                raise Fail(f"forget answered {forgotten.forgotten}, expected the rollout ids sorted")
            self._maybe_marked -= {first, second}
            after = (await self.fresh_status()).retired_rollouts
            if after != before:
                raise Fail(
                    f"retired_rollouts {after} after forget, expected {before}: a mark was left behind"
                )
            return f"retire → capture keys in request order, 2 marks; forget → sorted, marks back to {before}"

        await self.check("retire.round_trip", round_trip)

    # -- lease expiry ------------------------------------------------------------------------------------

    async def _check_lease_expiry(self) -> None:
        async def expiry() -> str:
            if not self.lease_check:
                raise Skip("pass --lease-check to wait out a lease (needs a server with a short lease grace)")
            grace = self.grace_s
            if grace is None:
                raise Skip("needs the grace measured by cycle.status_prepared")
            if grace > LEASE_CHECK_MAX_GRACE_S:
                raise Skip(
                    f"the server's lease grace is {grace:g}s; start it with one of at most"
                    f" {LEASE_CHECK_MAX_GRACE_S:g}s to check that a lease expires"
                )
            checkpoint_id = self.new_id("lease")
            deadline = time.time() + LEASE_CHECK_DEADLINE_S
            reply = await self.post("prepare", {"checkpoint_id": checkpoint_id, "deadline_ts": deadline})
            parsed = validated(PrepareReply, reply, "prepare with a near deadline")
            if parsed.phase not in ("prepared", "preparing"):
                raise Fail(f"prepare with a near deadline answered phase {parsed.phase!r}")
            give_up = deadline + grace + 5.0
            while True:
                status = await self.fresh_status()
                if status.phase == "idle" or time.time() > give_up:
                    break
                await anyio.sleep(_POLL_S)
            problems = _phase_problems(status, "idle", None)
            if status.lease_expires_at is not None:
                problems.append(f"lease_expires_at {status.lease_expires_at!r}")
            if problems:
                raise Fail(
                    f"{grace + 5:g}s after the deadline the lease had not resumed it: " + "; ".join(problems)
                )
            if checkpoint_id in self._maybe_active:
                self._maybe_active.remove(checkpoint_id)
            late = await self.post("prepare", self.body(checkpoint_id))
            await self.undo(late, checkpoint_id)
            expect(late, 409, STALE_CHECKPOINT, "prepare of the expired id")
            resumed = validated(ResumeReply, await self.post("resume", self.body(checkpoint_id)), "resume")
            if not resumed.idempotent:
                raise Fail("resume of the expired id: expected idempotent true")
            return f"the lease expired ({grace:g}s grace): idle, no lease, the id stale, resume idempotent"

        await self.check("lease.expiry", expiry)

    # -- cleanup -------------------------------------------------------------------------------------------

    async def _cleanup(self) -> None:
        """Resume what this run may have left active and forget what it may have marked, then say
        whether the server is idle with no lease and no mark of this run (or as found, if busy)."""
        for checkpoint_id in list(self._maybe_active):
            await self.resume_quietly(checkpoint_id)
        try:
            status = await self.fresh_status()
            if status.checkpoint_id is not None and status.checkpoint_id.startswith(self.run_id):
                await self.resume_quietly(status.checkpoint_id)
            if self._maybe_marked and status.phase in ("idle", "restored"):
                forget = self.body(self.new_id("cleanup"), rollout_ids=sorted(self._maybe_marked))
                if status.phase == "restored" and status.checkpoint_id is not None:
                    forget["checkpoint_id"] = status.checkpoint_id
                if (await self.post("forget", forget)).ok:
                    self._maybe_marked.clear()
        except (Fail, httpx.HTTPError):
            pass

        async def idle() -> str:
            status = await self.fresh_status()
            found = self.start
            if found is not None and found.phase != "idle":
                now, then = (status.phase, status.checkpoint_id), (found.phase, found.checkpoint_id)
                if now != then:
                    raise Fail(f"server found at {then}, left at {now}")
                return f"server left as found: phase {status.phase}, checkpoint id {status.checkpoint_id!r}"
            problems = _phase_problems(status, "idle", None)
            if status.lease_expires_at is not None:
                problems.append(f"lease_expires_at {status.lease_expires_at!r}")
            if found is not None and status.retired_rollouts > found.retired_rollouts:
                problems.append(
                    f"retired_rollouts {status.retired_rollouts}, {found.retired_rollouts} at start:"
                    " a mark was left"
                )
            if problems:
                raise Fail("server left " + "; ".join(problems))
            return "server back at idle: no checkpoint id, no lease, no mark of this run"

        await self.check("cleanup.idle", idle)


# ---------------------------------------------------------------------------------------------
# Pure checks
# ---------------------------------------------------------------------------------------------

#: The fields each kind adds to its status (multi-worker servers add `restored_pending` and more).
_KIND_EXTRAS: Final[Mapping[str, Mapping[str, tuple[type, ...]]]] = {
    "environment": {"restored_pending": (list,)},
    "agent": {"accepting": (bool,)},
    "resources": {"mode": (str,), "verify": (str,), "retired_sessions": (int,)},
    "model": {"restored_generation_cuts": (list,)},
}


def _extras_problems(kind: str, body: Any) -> list[str]:
    """What the status of a `kind` lacks of its per-kind fields, or has of the wrong type."""
    problems: list[str] = []
    fields = body if isinstance(body, dict) else {}
    for name, types in _KIND_EXTRAS[kind].items():
        value = fields.get(name)
        if name not in fields:
            problems.append(f"{_a(kind)} status must carry {name}")
        elif not isinstance(value, types) or (types == (int,) and isinstance(value, bool)):
            problems.append(f"{name} is {type(value).__name__}, expected {types[0].__name__}")
    return problems


def _a(kind: str) -> str:
    """`an environment`, `a model`."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def _manifests_under(folder: Path) -> list[Path]:
    """Every participant manifest a commit published under `folder`."""
    return sorted(folder.rglob(MANIFEST)) if folder.is_dir() else []


def _phase_problems(status: StatusReply, phase: str, checkpoint_id: str | None) -> list[str]:
    problems: list[str] = []
    if status.phase != phase:
        problems.append(f"phase {status.phase}, expected {phase}")
    if status.checkpoint_id != checkpoint_id:
        problems.append(f"checkpoint_id {status.checkpoint_id!r}, expected {checkpoint_id!r}")
    return problems


def _same(reply: Reply, first: Any, what: str) -> str:
    expect(reply, 200, what=f"repeated {what}")
    if reply.body != first:
        changed = sorted(
            k for k in set(first) | set(reply.body or {}) if first.get(k) != (reply.body or {}).get(k)
        )
        raise Fail(f"repeated {what} answered a different body (fields {', '.join(changed) or '?'})")
    return f"repeated {what} → the recorded reply, unchanged"


def _record_problem(model: type[BaseModel], line: bytes) -> tuple[str | None, str]:
    """Why one records-file line is wrong (None: it is right), and its capture key."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        return f"not JSON: {exc}", ""
    if not isinstance(record, dict):
        return "not a JSON object", ""
    if line != json.dumps(record).encode():
        return "not in json.dumps default form", ""
    if not isinstance(record.get("episode_id"), dict):
        return f"episode_id {record.get('episode_id')!r} is not an object {{rollout_id, attempt}}", ""
    try:
        model.model_validate(record)
        episode = EpisodeId.model_validate(record["episode_id"])
    except ValidationError as exc:
        return f"does not validate as {model.__name__}: {first_error(exc)}", ""
    return None, episode.capture_key


#: Every row the checker can emit, and what its passing proves ([§n]: sections of the team's v2 notes).
CHECKS: Final[Mapping[str, str]] = {
    "plane.detected": "the server speaks the unified plane: GET /capabilities 404 and GET "
    "/checkpoint/status answered a valid status (or --plane v2 was given) [§11]",
    "status.shape": "GET /checkpoint/status validates (kind, instance, phase, checkpoint_id, "
    "lease_expires_at, retired_rollouts, report) and carries its kind's fields: environment "
    "restored_pending, agent accepting, resources mode/verify/retired_sessions, model "
    "restored_generation_cuts [§3, §13]",
    "status.idle_at_start": "idle, no checkpoint id, no lease: probing disturbs no checkpoint [§5]",
    "auth.missing_token": "every POST route and GET status without a token → 401 with the envelope "
    "code unauthorized [§2]",
    "auth.wrong_token": "every POST route and GET status with a wrong token → 401 unauthorized [§2]",
    "auth.malformed_body": "a malformed body without a token → 422 (real Gym validates first) or 401 [§13]",
    "validation.extra_field": "an unknown body field → FastAPI's 422 [§2]",
    "validation.schema_version": "a v1-shaped body (schema_version) → 422 [§11]",
    "validation.checkpoint_id": "ids outside 1-128 chars of ^[A-Za-z0-9][A-Za-z0-9._-]*$, or missing "
    "→ 422 [§2]",
    "validation.deadline_ts": "a missing, non-numeric or non-finite deadline → 422; a non-finite one "
    "answered 500 is refused too (real Gym), a warning [§13]",
    "validation.episode_ids": "an episode whose rollout id ends in -a<N> or is malformed, a negative "
    "attempt, an extra field, a capture-key string where an episode belongs → 422 [§2, §13]",
    "validation.required_lists": "retire without episodes or with [] and forget with [] → 422 [§2]",
    "validation.checkpoint_dir": 'checkpoint_dir "" or missing on commit, "" on restore → 422 [§13]',
    "restore.scope_required": "a restore without episode_ids → 422 (restore needs a fresh server: only "
    "its refusals are checked) [§2]",
    "phase.commit_at_idle": "commit before prepare → 409 invalid_phase [§1]",
    "phase.renew_at_idle": "renew before prepare → 409 invalid_phase [§3]",
    "fence.resume_at_idle": "resume of an unknown id at idle → idle, idempotent true, and the id is "
    "fenced: a later prepare → 409 stale_checkpoint [§3]",
    "cycle.prepare": "prepare (again while preparing) → prepared with report.ready [§3]",
    "cycle.status_prepared": "status: prepared, the id, ready, lease_expires_at = deadline + grace [§5]",
    "fence.replay_prepare": "the same prepare again → the recorded reply, unchanged [§3]",
    "fence.conflict": "prepare of a second id while one is active → 409 checkpoint_conflict [§2]",
    "restore.conflict_while_active": "restore of another id while one is active → 409 "
    "checkpoint_conflict [§13]",
    "phase.retire_while_prepared": "retire while prepared → 409 invalid_phase [§3]",
    "phase.forget_while_prepared": "forget while prepared → 409 invalid_phase [§3]",
    "lease.renew": "renew → lease = max(lease, deadline + grace): extended to a later deadline, never "
    "shrunk by an earlier one; status agrees [§5]",
    "cycle.commit": "commit into a temp dir with a scope → committed; manifest names the kind, "
    "instance and id; episode_ids sorted; a model adds staging_keys (sorted, unique) and "
    "staging_keys_by_episode, no other kind does [§3]",
    "storage.manifest": "gym/<kind>/<instance>/manifest.json exists, schema 1, sorted keys and indent "
    "1, equal to the reply's manifest [§7]",
    "storage.records": "records-<sha256>.jsonl: its sha256 and line count match the manifest, each line "
    "json.dumps form ending in a newline, each record valid for the kind with an episode_id object; "
    "the capture keys are the reply's episode_ids; no temporary file left [§7, §13]",
    "fence.replay_commit": "the same commit again → the recorded reply, unchanged [§3]",
    "fence.commit_other_dir": "the same id into another dir → 409 checkpoint_conflict or the recorded "
    "reply (real Gym after success); nothing is written there [§3, §13]",
    "cycle.status_committed": "status: committed, the id [§1]",
    "cycle.resume": "resume → idle, idempotent false; status idle, no id, no lease [§3]",
    "fence.resume_again": "resume of the same id again → idle, idempotent true [§3]",
    "fence.stale_after_resume": "prepare and renew of a resumed id → 409 stale_checkpoint [§3, §13]",
    "commit.scope_required": "a model commit with episode_ids null → 409 checkpoint_error [§13]",
    "deadline.commit": "commit (prepared) with a passed deadline → 409 deadline_exceeded, no manifest [§13]",
    "deadline.restore": "restore with a passed deadline → 409 deadline_exceeded [§13]",
    "deadline.retire": "retire with a passed deadline → 409 deadline_exceeded [§13]",
    "deadline.forget": "forget with a passed deadline → 409 deadline_exceeded [§13]",
    "retire.round_trip": "retire (idle) of throwaway rollouts → their capture keys in request order, "
    "retired_rollouts up by their count; forget → the ids sorted, retired_rollouts back [§6]",
    "lease.expiry": "with --lease-check and a short grace: a prepared participant left alone resumes "
    "itself at lease expiry (idle, no lease, the id stale, resume idempotent) [§5, §13]",
    "cleanup.idle": "after the run, whatever failed: idle, no id, no lease, no mark of this run "
    "(or exactly as found when busy at start)",
}

_CYCLE: Final = (
    "cycle.prepare",
    "cycle.status_prepared",
    "fence.replay_prepare",
    "fence.conflict",
    "restore.conflict_while_active",
    "phase.retire_while_prepared",
    "phase.forget_while_prepared",
    "lease.renew",
    "cycle.commit",
    "storage.manifest",
    "storage.records",
    "fence.replay_commit",
    "fence.commit_other_dir",
    "cycle.status_committed",
    "cycle.resume",
    "fence.resume_again",
    "fence.stale_after_resume",
)
_AFTER_SHAPE: Final = tuple(n for n in CHECKS if n not in ("plane.detected", "status.shape"))
_STATEFUL: Final = tuple(
    n for n in _AFTER_SHAPE if n not in ("status.idle_at_start", "cleanup.idle") and not n.startswith("auth.")
)
