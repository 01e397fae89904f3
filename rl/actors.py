"""NeMo RL's per-actor checkpoint methods over quiesce: for runs that keep RL's own cross-actor
coordinator (`GymCheckpointCoordinator`), which calls six methods on one Ray actor per Gym
deployment and knows nothing of quiesce.

Shapes follow NeMo RL `nemo_rl/environments/gym_checkpoint_coordinator.py` @448b0253 (the calls)
and `gym_checkpoint_adapter.py` @ec883a24 (the values): `checkpoint_prepare(checkpoint_id, *,
deadline_ts) -> PrepareSummary`, `checkpoint_renew(checkpoint_id, *, deadline_ts)`,
`checkpoint_commit(checkpoint_id, checkpoint_root, episodes, *, deadline_ts) -> CommitSummary`,
`checkpoint_retire(checkpoint_id, episodes, *, deadline_ts)`, `checkpoint_restore(restore_id,
checkpoint_root, episodes, *, source_checkpoint_id, deadline_ts)`, `checkpoint_resume(
checkpoint_id, *, deadline_ts)`; `deadline_ts` is absolute (`time.time()`), episodes are RL's
`GymCheckpointEpisode`s (read by shape).

`ActorCheckpointHost` answers them for every deployment of the run, each call naming its RL
instance (`<shard>/replica-<i>`); `instance_handles(host)` gives RL's coordinator one handle per
instance whose methods have RL's exact signatures (`handle.checkpoint_prepare.remote(...)`
returns the host's Ray object ref), so RL's coordinator is built over them unchanged
(`QuiesceShardSet(...).checkpoint_handles`).

Rules the host keeps:

- **One attempt per RL checkpoint id, over every deployment, in one ledger.** The first
  `checkpoint_prepare` of an id prepares every server of the run (quiesce's save, Gym's unified
  plane, published in place); the other instances' prepares of that id share its outcome, each
  told its own servers' blockers. Not ready anywhere by the deadline rolls the whole attempt back,
  so every instance answers `prepared=False` (those with nothing blocking name no blocker) — a
  deployment is never left paused while RL's coordinator gives up on the checkpoint.
- **Joined calls.** `commit`, `retire` and `restore` are joined: the host waits until every
  instance has called (until the call's `deadline_ts`), then runs one quiesce operation for
  all — the commit into `checkpoint_root` with the union of the instances' episodes as its scope
  (each deployment writes into its folder, `gym-instances/<shard>/replica-<i>`), under RL's
  deadline — and answers each instance with its own part. An instance that never calls fails the
  others at the deadline, naming it, and the attempt is rolled back.
- **Resume decides**: the first `checkpoint_resume` of an id publishes a committed save in place
  (`quiesce-manifest.json` beside RL's files, the commit point) and resumes every server — only
  when RL recorded the commit: its `gym_checkpoint.json` in the root names the id (RL writes it
  once every instance's commit returned). An id whose commit failed, never ran, or that RL did
  not record is rolled back instead: RL calls resume after errors too. A restore is resumed.
  The other instances' resumes share the outcome; a resume of an
  id the host does not hold (finished, or settled by a restarted host's recovery) does nothing.
- **Renewals** are shared: concurrent renews of one id are one round of renewals.
- **Checked before RL sees them**: each instance's commit exports only its own candidates; a
  restore continues exactly the next attempts of each instance's episodes, and `source_checkpoint_id`
  must be the id `gym_checkpoint.json` in `checkpoint_root` names.
- **Restart**: a host restarted by Ray (`max_restarts`) recovers from the ledger before it
  answers (an attempt its dead process left open is rolled back or finished); calls for an id it
  no longer holds then fail (`invariant`), and resume does nothing — RL's retry under a new id
  succeeds.
- **RL's classes**: the handles answer quiesce's values, which have RL's fields; given RL's
  adapter module (`types=`), they answer RL's own classes, for a coordinator that checks them with
  `isinstance` (RL's does for the commit summary at @448b0253), and raise a transient failure as
  its `GymCheckpointUnavailable`, which RL's retry rule recognises. RL is never imported here.
- Errors leave as `EnvironmentCheckpointError` (picklable; RL's coordinator gathers them per
  instance). Ray is imported by nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Generic, Literal, TypeVar

import anyio.to_thread

from quiesce.coordinator import Attempt, ClusterConfig, Coordinator, QuiesceError
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.errors import PhaseError
from quiesce.coordinator.protocol_v2 import episode_of_key
from quiesce.rl.backend import QuiesceEnvironmentCheckpoint, absolute_folder, instance_of
from quiesce.rl.deployments import parse_quiesce_name
from quiesce.rl.episodes import (
    CommitSummary,
    Episode,
    ParticipantCommitSummary,
    ParticipantManifest,
    PrepareSummary,
    sorted_episodes,
)
from quiesce.rl.errors import EnvironmentCheckpointError, from_quiesce, is_transient
from quiesce.rl.gym_manifest import MANIFEST_FILENAME, GymCheckpointManifest

__all__ = [
    "METHODS",
    "ActorCheckpointHost",
    "InstanceHandle",
    "QuiesceShardSet",
    "as_rl",
    "instance_handles",
]

#: RL's six per-actor methods, in the order of a snapshot.
METHODS: Final = (
    "checkpoint_prepare",
    "checkpoint_renew",
    "checkpoint_commit",
    "checkpoint_retire",
    "checkpoint_restore",
    "checkpoint_resume",
)
#: Ids of finished operations kept, so a late call of one is answered, not refused.
KEPT: Final = 64

P = TypeVar("P")
R = TypeVar("R")


def server_name(member: Member) -> str:
    """The server's name inside its deployment (Gym's config name), as RL's summaries name it."""
    named = parse_quiesce_name(member.name)
    return named[2] if named is not None else member.name


def _fail(
    operation: str, message: str, code: str = "invariant", *, transient: bool = False
) -> EnvironmentCheckpointError:
    return EnvironmentCheckpointError(message, operation=operation, code=code, transient=transient)


def _left(operation: str, deadline_ts: float) -> float:
    """Seconds left until RL's absolute `deadline_ts`; one already passed is a `timeout`."""
    if isinstance(deadline_ts, bool) or not isinstance(deadline_ts, int | float):
        raise _fail(operation, f"deadline_ts must be a time.time() timestamp, not {deadline_ts!r}")
    left = float(deadline_ts) - time.time()
    if not left > 0:
        raise _fail(
            operation,
            f"the call's deadline passed {-left:.3f}s before it ran; call again with a later deadline",
            "timeout",
            transient=True,
        )
    return left


class _Join(Generic[P, R]):
    """The calls of one operation for one id, one per instance: run once, together, when every
    expected instance has called; failed for all at the deadline if one never does."""

    def __init__(
        self,
        operation: str,
        expected: frozenset[str],
        deadline_ts: float,
        run: Callable[[dict[str, P]], Awaitable[dict[str, R]]],
        on_missing: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._operation = operation
        self._expected = expected
        self._deadline_ts = deadline_ts
        self._run = run
        self._on_missing = on_missing
        self._parts: dict[str, P] = {}
        self._all_in = asyncio.Event()
        self._done: asyncio.Future[dict[str, R]] = loop.create_future()
        self._task = loop.create_task(self._go())

    async def _go(self) -> None:
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_in.wait(), max(0.0, self._deadline_ts - time.time()))
            if not self._all_in.is_set():
                missing = sorted(self._expected - set(self._parts))
                if self._on_missing is not None:
                    await self._on_missing()
                raise _fail(
                    self._operation,
                    f"{self._operation}: instance(s) {', '.join(missing)} did not call by the deadline"
                    f" (called: {', '.join(sorted(self._parts)) or 'none'}); every deployment of the run"
                    " takes part in one quiesce attempt — call every instance, as RL's coordinator does",
                    "timeout",
                    transient=True,
                )
            self._done.set_result(await self._run(dict(self._parts)))
        except BaseException as error:
            if not self._done.done():
                self._done.set_exception(error)
            if not isinstance(error, Exception):
                raise

    def close(self, reason: str) -> None:
        """Fail the calls still waiting for their siblings (nothing once the operation runs)."""
        if not self._all_in.is_set() and not self._done.done():
            self._done.set_exception(_fail(self._operation, f"{self._operation}: {reason}"))
            self._task.cancel()

    @property
    def done(self) -> bool:
        return self._done.done()

    async def join(self, instance: str, part: P) -> R:
        if instance in self._parts:
            raise _fail(self._operation, f"{self._operation}: instance {instance} called twice for one id")
        if self._done.done():
            raise _fail(
                self._operation, f"{self._operation}: instance {instance} called after the others' call ended"
            )
        self._parts[instance] = part
        if set(self._parts) >= self._expected:
            self._all_in.set()
        results = await asyncio.shield(self._done)
        return results[instance]


@dataclass
class _Op:
    """What the host holds of one RL id."""

    kind: Literal["save", "restore"]
    attempt: Attempt | None = None
    prepared: asyncio.Task[dict[str, tuple[str, ...]]] | None = None
    joins: dict[str, _Join[Any, Any]] = field(default_factory=dict)
    committed: bool = False
    root: Path | None = None
    failed: str | None = None
    renewing: asyncio.Task[None] | None = None
    resumed: asyncio.Task[None] | None = None


class ActorCheckpointHost:
    """RL's per-actor checkpoint methods for every deployment of the run, over one coordinator and
    one ledger (module docstring). Make it an async Ray actor (`ray.remote(max_restarts=N)
    (ActorCheckpointHost)`) or use it on the driver's loop; every method runs on one asyncio loop.

    `config`: a `ClusterConfig`, a cluster config path, or an async function returning one (e.g.
    the builder's, which finds RL's deployments); its servers speak Gym's unified plane and each
    deployment has its folder (`gym-instances/<shard>/replica-<i>`)."""

    def __init__(
        self,
        config: ClusterConfig | str | os.PathLike[str] | Callable[[], Awaitable[ClusterConfig]],
        *,
        token: str | None = None,
    ) -> None:
        self._backend = QuiesceEnvironmentCheckpoint(config, token=token)
        self._ops: dict[str, _Op] = {}
        self._lock = asyncio.Lock()  # one coordinator step at a time

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Open the coordinator (recovery first) and discover; what recovery did and the instances."""
        report = await self._backend.start()
        attempts = (
            []
            if report is None
            else [{"checkpoint_id": a.checkpoint_id, "action": a.action} for a in report.attempts]
        )
        return {"attempts": attempts, "instances": list(await self.instances())}

    @property
    def coordinator(self) -> Coordinator:
        """The host's coordinator, once started."""
        return self._backend.coordinator

    async def instances(self) -> tuple[str, ...]:
        """The RL instance ids of the run's deployments, sorted."""
        return tuple(sorted({instance_of(m) for m in await self._members()}))

    async def close(self) -> None:
        await self._backend.aclose()

    async def _coord(self) -> Coordinator:
        await self._backend.start()
        coord = self._backend.coordinator
        discovery = coord.discovery
        if discovery is None or discovery.plane != "v2":
            raise _fail(
                "start",
                "RL's per-actor methods over quiesce need Gym's unified plane (the servers of one"
                " deployment commit into their own folder of RL's snapshot); this run speaks v1 —"
                " use quiesce's EnvironmentCheckpoint backend (quiesce.rl.backend) instead",
                "config",
            )
        return coord

    async def _members(self) -> tuple[Member, ...]:
        coord = await self._coord()
        assert coord.discovery is not None
        return coord.discovery.participants

    async def _instance(self, operation: str, instance_id: str) -> frozenset[str]:
        """Every instance of the run; `instance_id` must be one of them."""
        every = frozenset(await self.instances())
        if instance_id not in every:
            raise _fail(
                operation,
                f"instance {instance_id!r} is not a deployment of this run (its deployments:"
                f" {', '.join(sorted(every))})",
                "discovery",
            )
        return every

    def _op(self, operation: str, checkpoint_id: str) -> _Op:
        op = self._ops.get(checkpoint_id)
        if op is None:
            raise _fail(
                operation,
                f"{operation}: checkpoint {checkpoint_id} is not held by this host (never prepared"
                " here, or settled by recovery after the host restarted); start again under a new id",
            )
        return op

    def _keep(self, checkpoint_id: str, op: _Op) -> None:
        self._ops[checkpoint_id] = op
        while len(self._ops) > KEPT:
            oldest = next(iter(self._ops))
            if self._ops[oldest].resumed is None and oldest != checkpoint_id:
                break
            self._ops.pop(oldest)

    # -- prepare, renew ------------------------------------------------------------------------

    async def checkpoint_prepare(
        self, instance_id: str, checkpoint_id: str, *, deadline_ts: float
    ) -> PrepareSummary:
        """Prepare every server for RL's `checkpoint_id` (once); this instance's readiness."""
        await self._instance("prepare", instance_id)
        op = self._ops.get(checkpoint_id)
        if op is None:
            left = _left("prepare", deadline_ts)
            op = _Op("save")
            op.prepared = asyncio.get_running_loop().create_task(self._prepare(op, left))
            self._keep(checkpoint_id, op)
        elif op.kind != "save" or op.prepared is None:
            raise _fail("prepare", f"prepare: {checkpoint_id} names a restore, not a checkpoint")
        elif op.resumed is not None:
            raise _fail(
                "prepare",
                f"prepare: checkpoint {checkpoint_id} has ended (resumed); Gym never takes an id twice —"
                " prepare under a new id",
            )
        blocked = await asyncio.shield(op.prepared)
        mine = {
            server_name(m): blocked[m.name]
            for m in await self._members()
            if instance_of(m) == instance_id and m.name in blocked
        }
        return PrepareSummary(not blocked, mine)

    async def _prepare(self, op: _Op, budget_s: float) -> dict[str, tuple[str, ...]]:
        """The servers not ready by the deadline → their blockers ({} when prepared)."""
        async with self._lock:
            coord = await self._coord()
            try:
                op.attempt = await coord.prepare(
                    deadline_s=min(budget_s, coord.config.max_deadline_s), in_place=True
                )
            except PhaseError as error:
                current = coord.current
                op.failed = str(error)
                if current is not None and current.blocked:
                    op.attempt = current
                    return dict(current.blocked)
                raise from_quiesce("prepare", error) from error
            except QuiesceError as error:
                op.failed = str(error)
                raise from_quiesce("prepare", error) from error
            return {}

    async def checkpoint_renew(self, instance_id: str, checkpoint_id: str, *, deadline_ts: float) -> None:
        """Renew every server's lease until `deadline_ts` (concurrent renews of one id are one)."""
        await self._instance("renew", instance_id)
        op = self._op("renew", checkpoint_id)
        if op.renewing is None or op.renewing.done():
            left = _left("renew", deadline_ts)
            op.renewing = asyncio.get_running_loop().create_task(self._renew(op, left))
        await asyncio.shield(op.renewing)

    async def _renew(self, op: _Op, horizon_s: float) -> None:
        if op.attempt is None or op.failed is not None or op.resumed is not None:
            raise _fail("renew", f"renew: the checkpoint is not held ({op.failed or 'it was let go'})")
        try:
            await (await self._coord()).renew(op.attempt, horizon_s=horizon_s)
        except QuiesceError as error:
            raise from_quiesce("renew", error) from error

    # -- commit ----------------------------------------------------------------------------------

    async def checkpoint_commit(
        self,
        instance_id: str,
        checkpoint_id: str,
        checkpoint_root: str,
        episodes: Iterable[Any],
        *,
        deadline_ts: float,
    ) -> CommitSummary:
        """This instance's part of the one commit of `checkpoint_id` into `checkpoint_root`."""
        every = await self._instance("commit", instance_id)
        op = self._op("commit", checkpoint_id)
        candidates = sorted_episodes(episodes, f"the episodes of instance {instance_id}")
        join = op.joins.get("commit")
        if join is None:
            if op.attempt is None or op.failed is not None or op.kind != "save":
                raise _fail(
                    "commit",
                    f"commit: checkpoint {checkpoint_id} is not prepared ({op.failed or 'no attempt'})",
                )
            join = op.joins["commit"] = _Join(
                "commit",
                every,
                float(deadline_ts),
                lambda parts: self._commit(op, parts, deadline_ts),
                on_missing=lambda: self._roll_back(op, "an instance did not call commit by the deadline"),
            )
        summary: CommitSummary = await join.join(instance_id, (os.fspath(checkpoint_root), candidates))
        return summary

    async def _commit(
        self, op: _Op, parts: dict[str, tuple[str, tuple[Episode, ...]]], deadline_ts: float
    ) -> dict[str, CommitSummary]:
        roots = {root for root, _ in parts.values()}
        if len(roots) != 1:
            await self._roll_back(op, "the instances named different checkpoint roots")
            raise _fail("commit", f"commit: the instances named different checkpoint roots: {sorted(roots)}")
        root = absolute_folder(roots.pop())
        scope = sorted({e for _, eps in parts.values() for e in eps})
        assert op.attempt is not None
        async with self._lock:
            coord = await self._coord()
            try:
                left = _left("commit", deadline_ts)
                await coord.commit(
                    op.attempt,
                    episodes=[e.to_episode_id() for e in scope],
                    into=root,
                    deadline_s=min(left, coord.config.max_deadline_s),
                )
            except (QuiesceError, EnvironmentCheckpointError) as error:
                op.failed = str(error)
                raise from_quiesce("commit", error) from error
            except ValueError as error:  # an RL rollout id Gym cannot carry
                await self._abort(op, f"the scope cannot be sent: {error}")
                raise _fail("commit", f"commit: {error}") from error
        op.root = root
        summaries = {i: self._summary(op.attempt, i) for i in parts}
        for instance, (_, candidates) in parts.items():
            outside = sorted(set(summaries[instance].exported_episodes) - set(candidates))
            if outside:
                op.failed = f"instance {instance} exported episodes outside its candidates"
                shown = ", ".join(e.capture_key for e in outside[:5])
                raise _fail(
                    "commit",
                    f"commit: instance {instance} exported {len(outside)} episode(s) RL did not list for it"
                    f" ({shown}); the checkpoint is rolled back when RL resumes it",
                )
        op.committed = True
        return summaries

    @staticmethod
    def _summary(attempt: Attempt, instance: str) -> CommitSummary:
        """One instance's commit as RL's adapter reports it, from the verified replies."""
        members = [m for m in attempt.participants if instance_of(m) == instance]
        environments = [m for m in members if m.component == "environment"]
        exported = {
            Episode.from_episode_id(episode_of_key(k))
            for m in environments or members
            for k in attempt.exported.get(m.name, ())
        }
        participants: list[ParticipantCommitSummary] = []
        staging: set[str] = set()
        by_episode: dict[Episode, set[str]] = {}
        for m in members:
            reply = attempt.commits.get(m.name, {}).get("reply", {})
            keys = tuple(reply.get("staging_keys") or ())
            participants.append(
                ParticipantCommitSummary(
                    server_name=server_name(m),
                    kind=m.component,
                    phase="committed",
                    capture_keys=tuple(reply.get("episode_ids") or ()),
                    manifest=ParticipantManifest.from_gym(reply["manifest"]),
                    staging_keys=keys,
                )
            )
            staging.update(keys)
            for key, rows in (reply.get("staging_keys_by_episode") or {}).items():
                by_episode.setdefault(Episode.from_episode_id(episode_of_key(key)), set()).update(rows)
        return CommitSummary(
            exported_episodes=tuple(sorted(exported)),
            staging_keys=tuple(sorted(staging)),
            participants=tuple(participants),
            staging_keys_by_episode={e: tuple(sorted(k)) for e, k in by_episode.items()},
        )

    async def _roll_back(self, op: _Op, reason: str) -> None:
        """Let go of an attempt that will not be published (its servers resumed, what they wrote
        removed); the caller does not hold the lock."""
        async with self._lock:
            await self._abort(op, reason)

    async def _abort(self, op: _Op, reason: str) -> None:
        """`_roll_back` for a caller holding the lock."""
        op.failed = op.failed or reason
        if op.attempt is None or op.attempt.state in ("completed", "aborted"):
            return
        try:
            await (await self._coord()).abort(op.attempt, reason=reason[:500])
        except QuiesceError as error:
            raise from_quiesce("resume", error) from error

    # -- resume ----------------------------------------------------------------------------------

    async def checkpoint_resume(self, instance_id: str, checkpoint_id: str, *, deadline_ts: float) -> None:
        """Publish and resume a committed checkpoint, roll back one that is not, resume a restore
        (once per id); nothing for an id the host does not hold."""
        await self._instance("resume", instance_id)
        op = self._ops.get(checkpoint_id)
        if op is None:
            return
        if op.resumed is None:
            op.resumed = asyncio.get_running_loop().create_task(self._resume(op, checkpoint_id))
        await asyncio.shield(op.resumed)

    async def _resume(self, op: _Op, checkpoint_id: str) -> None:
        for join in op.joins.values():  # a call still waiting for its siblings fails now
            join.close(f"RL resumed checkpoint {checkpoint_id} before every instance called")
        if op.prepared is not None:
            with contextlib.suppress(Exception):
                await op.prepared
        async with self._lock:
            attempt = op.attempt
            if attempt is None or attempt.state in ("completed", "aborted"):
                return
            if op.kind == "restore":
                try:
                    await (await self._coord()).resume(attempt)
                except QuiesceError as error:
                    raise from_quiesce("resume", error) from error
                return
            recorded = await anyio.to_thread.run_sync(_recorded_by_rl, op.root, checkpoint_id)
            if op.committed and op.failed is None and attempt.state == "committed" and recorded is None:
                try:
                    await (await self._coord()).publish_and_resume(attempt)
                except QuiesceError as error:
                    raise from_quiesce("resume", error) from error
                return
            why = op.failed or recorded or "it was never committed"
            await self._abort(op, f"RL resumed checkpoint {checkpoint_id} unpublished: {why}")

    # -- retire ----------------------------------------------------------------------------------

    async def checkpoint_retire(
        self, instance_id: str, checkpoint_id: str, episodes: Iterable[Any], *, deadline_ts: float
    ) -> None:
        """Retire every instance's episodes at once (joined under `checkpoint_id`: RL's discard or
        restore cleanup, under the restore's id)."""
        every = await self._instance("retire", instance_id)
        mine = sorted_episodes(episodes, f"the episodes of instance {instance_id}")
        op = self._ops.get(checkpoint_id)
        if op is None:
            op = _Op("save")
            op.failed = "retire only"
            self._keep(checkpoint_id, op)
        join = op.joins.get("retire")
        if join is None or join.done:
            join = op.joins["retire"] = _Join(
                "retire", every, float(deadline_ts), lambda parts: self._retire(parts, deadline_ts)
            )
        await join.join(instance_id, mine)

    async def _retire(self, parts: dict[str, tuple[Episode, ...]], deadline_ts: float) -> dict[str, None]:
        episodes = sorted({e for eps in parts.values() for e in eps})
        if episodes:
            async with self._lock:
                coord = await self._coord()
                try:
                    left = _left("retire", deadline_ts)
                    await coord.retire(
                        [e.to_episode_id() for e in episodes],
                        deadline_s=min(left, coord.config.max_deadline_s),
                    )
                except QuiesceError as error:
                    raise from_quiesce("retire", error) from error
        return dict.fromkeys(parts)

    # -- restore ---------------------------------------------------------------------------------

    async def checkpoint_restore(
        self,
        instance_id: str,
        restore_id: str,
        checkpoint_root: str,
        episodes: Iterable[Any],
        *,
        source_checkpoint_id: str,
        deadline_ts: float,
    ) -> None:
        """This instance's part of one restore of the snapshot in `checkpoint_root` into every server."""
        every = await self._instance("restore", instance_id)
        saved = sorted_episodes(episodes, f"the episodes of instance {instance_id}")
        op = self._ops.get(restore_id)
        if op is None:
            op = _Op("restore")
            self._keep(restore_id, op)
            op.joins["restore"] = _Join(
                "restore",
                every,
                float(deadline_ts),
                lambda parts: self._restore(op, parts, deadline_ts),
            )
        elif op.kind != "restore" or "restore" not in op.joins:
            raise _fail(
                "restore",
                f"restore: {restore_id} is already the id of a checkpoint; give each restore a new id",
            )
        await op.joins["restore"].join(instance_id, (os.fspath(checkpoint_root), saved, source_checkpoint_id))

    async def _restore(
        self,
        op: _Op,
        parts: dict[str, tuple[str, tuple[Episode, ...], str]],
        deadline_ts: float,
    ) -> dict[str, None]:
        roots = {root for root, _, _ in parts.values()}
        sources = {source for _, _, source in parts.values()}
        if len(roots) != 1 or len(sources) != 1:
            raise _fail(
                "restore",
                "restore: the instances named different checkpoint roots or sources:"
                f" {sorted(roots)}, {sorted(sources)}",
            )
        root = absolute_folder(roots.pop())
        source_checkpoint_id = sources.pop()
        try:
            named = await anyio.to_thread.run_sync(_manifest_in, root)
        except (OSError, ValueError) as error:
            raise _fail(
                "restore", f"restore: {root}/{MANIFEST_FILENAME} cannot be read: {error}", "snapshot_invalid"
            ) from error
        if named is not None and named.checkpoint_id != source_checkpoint_id:
            raise _fail(
                "restore",
                f"restore: source_checkpoint_id {source_checkpoint_id!r} is not the checkpoint"
                f" {root}/{MANIFEST_FILENAME} names ({named.checkpoint_id!r})",
                "snapshot_invalid",
            )
        async with self._lock:
            coord = await self._coord()
            try:
                left = _left("restore", deadline_ts)
                op.attempt = await coord.restore(
                    root, deadline_s=min(left, coord.config.max_deadline_s), resume=False
                )
            except QuiesceError as error:
                op.failed = str(error)
                raise from_quiesce("restore", error) from error
        attempt = op.attempt
        got: dict[str, set[Episode]] = {}
        for m in attempt.participants:
            if m.component == "environment":
                got.setdefault(instance_of(m), set()).update(
                    Episode.from_episode_id(episode_of_key(k)) for k in attempt.restored.get(m.name, ())
                )
        wrong = [
            i
            for i, saved in sorted(parts.items())
            if {e.next_attempt() for e in saved[1]} != got.get(i, set())
        ]
        if wrong:
            op.failed = f"instances {wrong} continued other episodes than RL named"
            raise _fail(
                "restore",
                f"restore {attempt.checkpoint_id}: instance(s) {', '.join(wrong)} continued other episodes"
                " than the ones RL named for them; RL's cleanup retires the next attempts and resumes",
            )
        return dict.fromkeys(parts)


def _manifest_in(root: Path) -> GymCheckpointManifest | None:
    """RL's `gym_checkpoint.json` in `root`; None when there is none."""
    return GymCheckpointManifest.load(root) if (root / MANIFEST_FILENAME).is_file() else None


def _recorded_by_rl(root: Path | None, checkpoint_id: str) -> str | None:
    """Why RL did not record the commit (None: it did — `gym_checkpoint.json` in `root` names
    `checkpoint_id`). RL's coordinator writes that file only once every instance's commit
    returned, so a resume without it is the resume RL sends after a failure."""
    if root is None:
        return "it was never committed"
    try:
        named = GymCheckpointManifest.load(root)
    except FileNotFoundError:
        return f"RL wrote no {MANIFEST_FILENAME} into {root} (its commit failed on RL's side)"
    except (OSError, ValueError) as error:
        return f"{root}/{MANIFEST_FILENAME} cannot be read: {error}"
    if named.checkpoint_id != checkpoint_id:
        return f"{root}/{MANIFEST_FILENAME} names checkpoint {named.checkpoint_id!r}, not {checkpoint_id!r}"
    return None


# -- the handles RL's coordinator holds --------------------------------------------------------


def _built(cls: Any, values: dict[str, Any]) -> Any:
    """`cls(**values)`, keeping only the fields a dataclass `cls` declares (RL's classes differ
    between versions: a field one of them lacks is left out, not passed)."""
    if dataclasses.is_dataclass(cls):
        declared = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k in declared}
    return cls(**values)


def as_rl(value: Any, types: Any) -> Any:
    """`value` (a `PrepareSummary` or `CommitSummary`; anything else as it is) rebuilt as RL's own
    class of that name from `types` — RL's `nemo_rl.environments.gym_checkpoint_adapter` module —
    for a coordinator that checks `isinstance` against them. Both shapes RL has shipped are met:
    @ec883a24 (participants as `GymCheckpointParticipantCommitSummary`, each with its
    `GymCheckpointParticipantManifest`) and the nightly one (participants as server names, when
    the module has no participant class); fields RL's class does not declare are left out."""
    if isinstance(value, PrepareSummary):
        return _built(
            types.GymCheckpointPrepareSummary, {"prepared": value.prepared, "blockers": dict(value.blockers)}
        )
    if not isinstance(value, CommitSummary):
        return value

    def episode(e: Episode) -> Any:
        return _built(types.GymCheckpointEpisode, {"rollout_id": e.rollout_id, "attempt": e.attempt})

    participant_class = getattr(types, "GymCheckpointParticipantCommitSummary", None)
    manifest_class = getattr(types, "GymCheckpointParticipantManifest", None)
    participants: tuple[Any, ...]
    if participant_class is None or manifest_class is None:
        participants = tuple(p.server_name for p in value.participants)
    else:
        participants = tuple(
            _built(
                participant_class,
                {
                    "server_name": p.server_name,
                    "kind": p.kind,
                    "phase": p.phase,
                    "capture_keys": p.capture_keys,
                    "manifest": _built(manifest_class, dataclasses.asdict(p.manifest)),
                    "staging_keys": p.staging_keys,
                },
            )
            for p in value.participants
        )
    return _built(
        types.GymCheckpointCommitSummary,
        {
            "exported_episodes": tuple(episode(e) for e in value.exported_episodes),
            "staging_keys": value.staging_keys,
            "participants": participants,
            "staging_keys_by_episode": {
                episode(e): keys for e, keys in value.staging_keys_by_episode.items()
            },
            "unowned_live_episodes": tuple(episode(e) for e in value.unowned_live_episodes),
        },
    )


async def _converted(pending: Awaitable[Any], types: Any, method: str) -> Any:
    """The value awaited, as RL's class (`as_rl`). A failure that may go away when tried again
    (`quiesce.rl.errors.is_transient`) is raised as RL's `GymCheckpointUnavailable` when `types`
    has it — the type RL's `is_transient_gym_checkpoint_failure` retries on — carrying the text;
    anything else is raised as it is."""
    try:
        value = await pending
    except Exception as error:
        unavailable = getattr(types, "GymCheckpointUnavailable", None)
        if unavailable is not None and is_transient(error):
            raise unavailable(str(from_quiesce(method.removeprefix("checkpoint_"), error))) from error
        raise
    return as_rl(value, types)


class _Method:
    """`handle.<method>.remote(*args, **kwargs)` as RL calls it: the host's method with the instance
    first. Returns the host's object ref (RL awaits it, and may `ray.cancel` it) — or, with `types`,
    a coroutine awaiting it and rebuilding the value as RL's class (`as_rl`; not cancellable by
    `ray.cancel`, which RL's coordinator only tries, best effort)."""

    __slots__ = ("_host", "_instance", "_name", "_types")

    def __init__(self, host: Any, instance: str, name: str, types: Any) -> None:
        self._host, self._instance, self._name, self._types = host, instance, name, types

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self._host, self._name)
        remote = getattr(method, "remote", None)
        if remote is not None:  # a Ray actor handle
            pending = remote(self._instance, *args, **kwargs)
        else:  # the host itself, on this loop: a coroutine
            pending = method(self._instance, *args, **kwargs)
        return pending if self._types is None else _converted(pending, self._types, self._name)


@dataclass(frozen=True)
class InstanceHandle:
    """One RL instance's actor handle as RL's coordinator uses it (`handle.checkpoint_*.remote(...)`),
    over an `ActorCheckpointHost` — its Ray actor handle, or the host itself on the driver's loop.
    `types`: RL's value classes to answer in (`as_rl`); None: quiesce's, matched by shape.
    Picklable when the host handle and `types` are."""

    host: Any
    instance_id: str
    types: Any = None

    def __getattr__(self, name: str) -> _Method:
        if name in METHODS:
            return _Method(self.host, self.instance_id, name, self.types)
        raise AttributeError(name)


def instance_handles(
    host: Any, instance_ids: Iterable[str], *, types: Any = None
) -> dict[str, InstanceHandle]:
    """`{instance_id: InstanceHandle}` for RL's coordinator (`checkpoint_handles`)."""
    return {i: InstanceHandle(host, i, types) for i in sorted(instance_ids)}


@dataclass(frozen=True)
class QuiesceShardSet:
    """What RL's `GymCheckpointCoordinator(shard_set, control_timeout_s=...)` reads of its shard
    set: `checkpoint_handles`, one per instance, here over quiesce."""

    checkpoint_handles: Mapping[str, InstanceHandle]

    @classmethod
    def over(cls, host: Any, instance_ids: Iterable[str], *, types: Any = None) -> QuiesceShardSet:
        """Handles over `host` for `instance_ids`; `types`: RL's adapter module, for an RL
        coordinator that checks its own classes with `isinstance` (@448b0253 does for the commit)."""
        return cls(instance_handles(host, instance_ids, types=types))
