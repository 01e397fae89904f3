"""The v2 control plane of one participant: phases, fencing, replay, lease, retire marks, routes.

```
idle --prepare--> preparing --(ready)--> prepared --commit--> committed
idle --restore--> restored
preparing | prepared | committed | restored --resume (or lease expiry)--> idle
```

Rules (Gym's `_checkpoint/control.py`: phases, models, routes, leases, retire marks):
- Every transition runs under one asyncio lock; prepare's readiness wait runs outside it, re-checking on
  each change notice and at least every second, and ends early when the active id changes.
- Recorded results are replayed: prepare (once prepared), commit, restore. A resume drops its id's.
- The last `RESUMED_IDS_KEPT` resumed ids are fenced (`stale_checkpoint`); resume is idempotent and,
  when idle, remembers the id anyway.
- A commit exports once per id: a retry with the same dir and scope awaits (or re-stores) the same
  records, another dir or scope is `checkpoint_conflict`. A resume stops the writer before its manifest.
- Lease: `max(prev, deadline_ts + grace)`, renewed by prepare, commit, renew, restore, and retire/forget
  while restored; a watcher resumes the participant when it expires.
- Retire raises the rollout's mark first (kept even if the retire fails), then stops the attempts;
  retire/forget only in idle/restored ("resume first").
- Routes: FastAPI validates the body (422) before the bearer is checked (401 `unauthorized`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from fastapi import FastAPI, Header
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from quiesce.coordinator.protocol_v2 import (
    CHECKPOINT_CONFLICT,
    CHECKPOINT_ERROR,
    DEADLINE_EXCEEDED,
    INVALID_CHECKPOINT_STATE,
    INVALID_PHASE,
    MAX_BLOCKERS,
    PREFIX,
    RESTART_IN_SCOPE,
    RESUMED_IDS_KEPT,
    STALE_ATTEMPT,
    STALE_CHECKPOINT,
    UNAUTHORIZED,
    CheckpointRequest,
    CommitRequest,
    EpisodeId,
    ForgetRequest,
    Kind,
    PrepareReport,
    RestoreRequest,
    RetireRequest,
    V2Phase,
)
from quiesce.tools.gymsim.common import ControlRejection, Notifier
from quiesce.tools.gymsim.faults import OPERATION_DELAY
from quiesce.tools.gymsim.v2.errors import refuse
from quiesce.tools.gymsim.v2.store import WriteStop, WriteStopped, read_state, write_state

LOGGER = logging.getLogger("quiesce.gymsim.v2")
T = TypeVar("T")


class RetireMarks:
    """Each retired rollout's highest retired attempt: a request of an attempt ≤ its mark is
    `stale_attempt` until `forget`. Marks only rise."""

    def __init__(self) -> None:
        self.marks: dict[str, int] = {}

    def check(self, episode: EpisodeId) -> None:
        mark = self.marks.get(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            raise refuse(STALE_ATTEMPT, f"rollout {episode.rollout_id} attempt {episode.attempt} was retired")

    def mark(self, episodes: Iterable[EpisodeId]) -> None:
        for episode in episodes:
            self.marks[episode.rollout_id] = max(self.marks.get(episode.rollout_id, -1), episode.attempt)

    def forget(self, rollout_ids: Iterable[str]) -> None:
        for rollout_id in rollout_ids:
            self.marks.pop(rollout_id, None)

    def __len__(self) -> int:
        return len(self.marks)


def report(blockers: Iterable[str], counts: dict[str, int], restarts: Iterable[str] = ()) -> PrepareReport:
    """A `PrepareReport`: ready iff no blockers; the first `MAX_BLOCKERS` sorted blockers listed."""
    every = sorted(set(blockers))
    return PrepareReport(
        ready=not every,
        blockers=every[:MAX_BLOCKERS],
        blocker_count=len(every),
        counts=counts,
        restarts=sorted(set(restarts)),
    )


def covers(retired: EpisodeId, key_episode: EpisodeId) -> bool:
    """Whether retiring `retired` stops `key_episode` (same rollout, same or earlier attempt)."""
    return key_episode.rollout_id == retired.rollout_id and key_episode.attempt <= retired.attempt


class Participant(ABC):
    """The state owner of one server: admission, readiness, export and install of its records.

    The plane owns phases and storage; a participant checks `marks` on its data plane and calls
    `notify()` whenever readiness may have changed."""

    kind: ClassVar[Kind]
    record_model: ClassVar[type[BaseModel]]

    def __init__(self) -> None:
        self.marks = RetireMarks()
        self.changes = Notifier()
        self.stopped_for_shutdown = False

    def notify(self) -> None:
        self.changes.notify()

    @abstractmethod
    async def close_admission(self) -> None:
        """Admit no new work; running work parks at its next boundary."""

    @abstractmethod
    async def open_admission(self) -> None:
        """Admit work again; parked work and held responses go on."""

    @abstractmethod
    def readiness(self) -> PrepareReport: ...

    @abstractmethod
    async def retire(self, episode: EpisodeId) -> None:
        """Stop and free `episode` and its earlier attempts (live or restored); return once stopped."""

    @abstractmethod
    def export(self, scope: list[EpisodeId] | None) -> list[dict[str, Any]]:
        """The records (JSON objects of `record_model`) a commit with this scope writes."""

    @abstractmethod
    async def install(self, records: list[Any], scope: list[EpisodeId]) -> None:
        """Install validated records under their next attempt; `checkpoint_error` unless fresh."""

    def restored_pending(self) -> list[EpisodeId]:
        """Restored episodes not started here yet, as the attempts that continue them."""
        return []

    async def delete_restored(self, episode: EpisodeId) -> None:
        """Free restored state the controller no longer continues (leaves no mark)."""
        return None

    async def park_exported(self, records: list[dict[str, Any]]) -> None:
        """A commit with `stop` is durable: free what the exported state holds outside the process."""
        self.stopped_for_shutdown = True

    async def forget(self, rollout_ids: list[str]) -> None:
        """Stop refusing these rollouts' retired attempts."""
        self.marks.forget(rollout_ids)

    def commit_extra(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {}

    def manifest_extra(self) -> dict[str, Any]:
        return {}

    def restore_manifest(self, manifest: dict[str, Any]) -> None:
        """Read what `manifest_extra` kept, before install."""
        return None

    def status_extra(self) -> dict[str, Any]:
        return {}


async def within(request: CheckpointRequest, work: Awaitable[T]) -> T:
    """`work` bounded by the request's deadline: `deadline_exceeded` if it passed before or during it."""
    remaining = request.deadline_ts - time.time()
    if remaining <= 0:
        if asyncio.iscoroutine(work):
            work.close()
        raise refuse(DEADLINE_EXCEEDED, f"checkpoint {request.checkpoint_id} deadline passed")
    try:
        async with asyncio.timeout(remaining):
            return await work
    except TimeoutError:
        raise refuse(
            DEADLINE_EXCEEDED, f"checkpoint {request.checkpoint_id} deadline passed during I/O"
        ) from None


@dataclass
class _Write:
    """One checkpoint's export and the task storing it (a retry never exports again)."""

    checkpoint_id: str
    checkpoint_dir: str
    scope: list[EpisodeId] | None
    records: list[dict[str, Any]]
    task: asyncio.Task[dict[str, Any]] | None = None
    stop: WriteStop = field(default_factory=WriteStop)


class ControlPlane:
    """Fencing, phases, lease and storage driving one `Participant` (module docstring)."""

    def __init__(self, participant: Participant, *, instance: str, lease_grace_s: float) -> None:
        self.participant = participant
        self.instance = instance
        self.lease_grace_s = lease_grace_s
        self.phase: V2Phase = "idle"
        self.checkpoint_id: str | None = None
        self.lease_expires_at: float | None = None
        self.lease_expirations = 0
        self._lease_task: asyncio.Task[None] | None = None
        self._resumed: OrderedDict[str, None] = OrderedDict()
        self._results: dict[tuple[str, str], dict[str, Any]] = {}
        self._write: _Write | None = None
        self._lock = asyncio.Lock()

    # -- status and fencing ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.participant.kind,
            "instance": self.instance,
            "phase": self.phase,
            "checkpoint_id": self.checkpoint_id,
            "lease_expires_at": self.lease_expires_at,
            "retired_rollouts": len(self.participant.marks),
            "report": self.participant.readiness().model_dump(mode="json"),
            **self.participant.status_extra(),
        }

    def _admit(self, checkpoint_id: str, allowed: Iterable[V2Phase]) -> None:
        if checkpoint_id in self._resumed:
            raise refuse(STALE_CHECKPOINT, f"checkpoint {checkpoint_id} was already resumed")
        if self.checkpoint_id is not None and self.checkpoint_id != checkpoint_id:
            raise refuse(
                CHECKPOINT_CONFLICT, f"checkpoint {self.checkpoint_id} is active in phase {self.phase}"
            )
        if self.phase not in allowed:
            raise refuse(INVALID_PHASE, f"not valid in phase {self.phase}")

    def _admit_outside_checkpoint(self, request: CheckpointRequest) -> None:
        if self.phase not in ("idle", "restored"):
            raise refuse(INVALID_PHASE, f"not valid in phase {self.phase}; resume first")
        if self.checkpoint_id is not None and self.checkpoint_id != request.checkpoint_id:
            raise refuse(CHECKPOINT_CONFLICT, f"checkpoint {self.checkpoint_id} is active")
        if self.phase == "restored":
            self._renew(request)

    @staticmethod
    async def _injected_delay() -> None:
        """A `delay` fault with `when: during`: the operation runs slow, inside its phase."""
        seconds = OPERATION_DELAY.get()
        if seconds > 0:
            await asyncio.sleep(seconds)

    # -- lease -------------------------------------------------------------------------------

    def _renew(self, request: CheckpointRequest) -> None:
        self.lease_expires_at = max(self.lease_expires_at or 0.0, request.deadline_ts + self.lease_grace_s)
        if self._lease_task is None or self._lease_task.done():
            self._lease_task = asyncio.create_task(self._watch_lease(request.checkpoint_id))

    async def _watch_lease(self, checkpoint_id: str) -> None:
        """Sleep until the lease expires; then, if `checkpoint_id` still holds it, resume."""
        while self.lease_expires_at is not None and self.checkpoint_id in (None, checkpoint_id):
            remaining = self.lease_expires_at - time.time()
            if remaining > 0:
                await asyncio.sleep(remaining)
                continue
            async with self._lock:
                if self.checkpoint_id != checkpoint_id or time.time() < (self.lease_expires_at or 0.0):
                    continue
                LOGGER.warning(
                    "%s: lease of %s expired in phase %s; resuming", self.instance, checkpoint_id, self.phase
                )
                self.lease_expirations += 1
                await self._reopen(resume_id=checkpoint_id)
            return

    async def renew(self, request: CheckpointRequest) -> dict[str, Any]:
        async with self._lock:
            self._admit(request.checkpoint_id, ("preparing", "prepared", "committed", "restored"))
            self._renew(request)
            return {"lease_expires_at": self.lease_expires_at}

    # -- prepare -----------------------------------------------------------------------------

    async def prepare(self, request: CheckpointRequest) -> dict[str, Any]:
        async with self._lock:
            recorded = self._results.get((request.checkpoint_id, "prepare"))
            if recorded is not None:
                return recorded
            self._admit(request.checkpoint_id, ("idle", "preparing"))
            await self._injected_delay()
            self._renew(request)
            if self.phase == "idle":
                self.checkpoint_id = request.checkpoint_id
                self.phase = "preparing"
                try:
                    await self.participant.close_admission()
                except BaseException:
                    await self._reopen()
                    raise
        try:
            await self._wait_ready(request)
        except BaseException:
            async with self._lock:
                if self.checkpoint_id == request.checkpoint_id and self.phase == "preparing":
                    await self._reopen()
            raise
        async with self._lock:
            current = self.participant.readiness()
            if self.checkpoint_id != request.checkpoint_id or self.phase != "preparing":
                return {"phase": self.phase, "report": current.model_dump(mode="json")}
            if current.ready:
                self.phase = "prepared"
            result = {"phase": self.phase, "report": current.model_dump(mode="json")}
            if current.ready:
                self._results[(request.checkpoint_id, "prepare")] = result
            return result

    async def _wait_ready(self, request: CheckpointRequest) -> None:
        while True:
            remaining = request.deadline_ts - time.time()
            if remaining <= 0 or self.checkpoint_id != request.checkpoint_id:
                return
            if self.participant.readiness().ready:
                return
            await self.participant.changes.wait(min(remaining, 1.0))

    # -- commit ------------------------------------------------------------------------------

    async def commit(self, request: CommitRequest) -> dict[str, Any]:
        async with self._lock:
            recorded = self._results.get((request.checkpoint_id, "commit"))
            if recorded is not None:
                return recorded
            self._admit(request.checkpoint_id, ("prepared",))
            self._renew(request)
            current = self.participant.readiness()
            if not current.ready:
                raise refuse(INVALID_PHASE, f"no longer ready to commit: blockers={current.blockers}")
            if request.episode_ids is not None:
                named = sorted(set(current.restarts) & {e.capture_key for e in request.episode_ids})
                if named:
                    raise refuse(RESTART_IN_SCOPE, f"the commit scope names episodes that restart: {named}")
            write = await self._start_write(request)
            assert write.task is not None
            manifest = await within(request, asyncio.shield(write.task))
            await within(request, self._delete_unscoped(request.episode_ids))
            if request.stop:
                try:
                    await within(request, self.participant.park_exported(write.records))
                except Exception:
                    LOGGER.warning("%s: parking the exported state failed", self.instance, exc_info=True)
            self.phase = "committed"
            result = {
                "phase": "committed",
                "manifest": manifest,
                "episode_ids": sorted(
                    {EpisodeId.model_validate(r["episode_id"]).capture_key for r in write.records}
                ),
                **self.participant.commit_extra(write.records),
            }
            self._results[(request.checkpoint_id, "commit")] = result
            return result

    async def _start_write(self, request: CommitRequest) -> _Write:
        write = self._write
        if write is None or write.checkpoint_id != request.checkpoint_id:
            if request.deadline_ts <= time.time():
                raise refuse(DEADLINE_EXCEEDED, f"checkpoint {request.checkpoint_id} deadline passed")
            records = self.participant.export(request.episode_ids)
            write = self._write = _Write(
                request.checkpoint_id, request.checkpoint_dir, request.episode_ids, records
            )
        elif (write.checkpoint_dir, write.scope) != (request.checkpoint_dir, request.episode_ids):
            raise refuse(
                CHECKPOINT_CONFLICT,
                f"checkpoint {request.checkpoint_id} is already written to another directory or scope",
            )
        if write.task is None or (write.task.done() and write.task.exception() is not None):
            write.task = asyncio.create_task(self._store(request, write))
            write.task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return write

    async def _store(self, request: CommitRequest, write: _Write) -> dict[str, Any]:
        """The write itself (a slow-commit fault sleeps here, so the write outlives its caller)."""
        await self._injected_delay()
        return await asyncio.to_thread(
            write_state,
            request.checkpoint_dir,
            kind=self.participant.kind,
            instance=self.instance,
            checkpoint_id=request.checkpoint_id,
            records=write.records,
            extra=self.participant.manifest_extra(),
            stop=write.stop,
        )

    async def _delete_unscoped(self, scope: list[EpisodeId] | None) -> None:
        if scope is None:
            return
        keep = set(scope)
        for episode in self.participant.restored_pending():
            if episode not in keep:
                await self.participant.delete_restored(episode)

    # -- restore -----------------------------------------------------------------------------

    async def restore(self, request: RestoreRequest) -> dict[str, Any]:
        async with self._lock:
            recorded = self._results.get((request.checkpoint_id, "restore"))
            if recorded is not None:
                return recorded
            self._admit(request.checkpoint_id, ("idle",))
            await self._injected_delay()
            scope = {e.capture_key for e in request.episode_ids}
            manifest, raw = await within(
                request,
                asyncio.to_thread(
                    read_state,
                    request.checkpoint_dir,
                    kind=self.participant.kind,
                    instance=self.instance,
                    select=scope.__contains__,
                ),
            )
            records = [self._validate(record) for record in raw]
            try:
                await self.participant.close_admission()
                self.participant.restore_manifest(manifest)
                await within(request, self.participant.install(records, list(request.episode_ids)))
            except BaseException:
                await self.participant.open_admission()
                raise
            self.checkpoint_id = request.checkpoint_id
            self.phase = "restored"
            self._renew(request)
            result = {
                "phase": "restored",
                "source_checkpoint_id": manifest["checkpoint_id"],
                "restored": sorted(
                    EpisodeId.model_validate(r["episode_id"]).next_attempt().capture_key for r in raw
                ),
            }
            self._results[(request.checkpoint_id, "restore")] = result
            return result

    def _validate(self, record: dict[str, Any]) -> Any:
        try:
            return self.participant.record_model.model_validate(record)
        except ValidationError as exc:
            raise refuse(INVALID_CHECKPOINT_STATE, f"invalid {self.participant.kind} record: {exc}") from exc

    # -- resume, retire, forget ---------------------------------------------------------------

    async def resume(self, request: CheckpointRequest) -> dict[str, Any]:
        async with self._lock:
            if request.checkpoint_id in self._resumed:
                return {"phase": "idle", "idempotent": True}
            if self.phase == "idle" and self.checkpoint_id is None:
                self._remember(request.checkpoint_id)
                return {"phase": "idle", "idempotent": True}
            self._admit(request.checkpoint_id, ("preparing", "prepared", "committed", "restored"))
            await self._reopen(resume_id=request.checkpoint_id)
            return {"phase": "idle", "idempotent": False}

    async def retire(self, request: RetireRequest) -> dict[str, Any]:
        async with self._lock:
            self._admit_outside_checkpoint(request)
            if request.deadline_ts <= time.time():
                raise refuse(DEADLINE_EXCEEDED, f"checkpoint {request.checkpoint_id} deadline passed")
            self.participant.marks.mark(request.episode_ids)
            for episode in request.episode_ids:
                await within(request, self.participant.retire(episode))
        self.participant.notify()
        return {"retired": [e.capture_key for e in request.episode_ids]}

    async def forget(self, request: ForgetRequest) -> dict[str, Any]:
        async with self._lock:
            self._admit_outside_checkpoint(request)
            if request.deadline_ts <= time.time():
                raise refuse(DEADLINE_EXCEEDED, f"checkpoint {request.checkpoint_id} deadline passed")
            await self.participant.forget(list(request.rollout_ids))
            return {"forgotten": sorted(request.rollout_ids)}

    def _remember(self, checkpoint_id: str) -> None:
        self._resumed[checkpoint_id] = None
        while len(self._resumed) > RESUMED_IDS_KEPT:
            self._resumed.popitem(last=False)

    async def _reopen(self, *, resume_id: str | None = None) -> None:
        """Back to idle: stop the writer (no manifest after this), open admission, drop the lease."""
        if self._write is not None:
            await asyncio.to_thread(self._write.stop.stop)
            self._write = None
        await self.participant.open_admission()
        if resume_id is not None:
            self._remember(resume_id)
            self._results = {k: v for k, v in self._results.items() if k[0] != resume_id}
        self.phase = "idle"
        self.checkpoint_id = None
        self.lease_expires_at = None
        if self._lease_task is not None and self._lease_task is not asyncio.current_task():
            self._lease_task.cancel()
        self._lease_task = None
        self.participant.notify()

    async def aclose(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------


def _authorized(authorization: str | None, token: str | None) -> bool:
    if not token or authorization is None:
        return False
    return hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {token}".encode())


async def _answer(
    authorization: str | None, token: str | None, run: Callable[[], Awaitable[dict[str, Any]]]
) -> JSONResponse:
    if not _authorized(authorization, token):
        return refuse(UNAUTHORIZED, "missing or invalid checkpoint control bearer token").response()
    try:
        return JSONResponse(await run())
    except ControlRejection as rejection:
        return rejection.response()
    except WriteStopped as stopped:
        return refuse(CHECKPOINT_ERROR, str(stopped)).response()


def install_routes(app: FastAPI, plane: Callable[[], ControlPlane], token: str | None) -> None:
    """The eight bearer-protected routes under `PREFIX`, served by `plane()`; the body is validated
    by FastAPI first (422), the bearer second (401)."""

    @app.get(PREFIX + "/status")
    async def status(authorization: str | None = Header(default=None)) -> JSONResponse:
        async def run() -> dict[str, Any]:
            return plane().status()

        return await _answer(authorization, token, run)

    @app.post(PREFIX + "/prepare")
    async def prepare(
        body: CheckpointRequest, authorization: str | None = Header(default=None)
    ) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().prepare(body))

    @app.post(PREFIX + "/renew")
    async def renew(
        body: CheckpointRequest, authorization: str | None = Header(default=None)
    ) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().renew(body))

    @app.post(PREFIX + "/commit")
    async def commit(body: CommitRequest, authorization: str | None = Header(default=None)) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().commit(body))

    @app.post(PREFIX + "/restore")
    async def restore(body: RestoreRequest, authorization: str | None = Header(default=None)) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().restore(body))

    @app.post(PREFIX + "/resume")
    async def resume(
        body: CheckpointRequest, authorization: str | None = Header(default=None)
    ) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().resume(body))

    @app.post(PREFIX + "/retire")
    async def retire(body: RetireRequest, authorization: str | None = Header(default=None)) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().retire(body))

    @app.post(PREFIX + "/forget")
    async def forget(body: ForgetRequest, authorization: str | None = Header(default=None)) -> JSONResponse:
        return await _answer(authorization, token, lambda: plane().forget(body))
