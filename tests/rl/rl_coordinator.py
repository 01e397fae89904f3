"""A stand-in of NeMo RL's driver-side `GymCheckpointCoordinator`, for the tests of quiesce's
per-actor methods: it calls the six methods on `checkpoint_handles` as RL's coordinator does
(NeMo RL `nemo_rl/environments/gym_checkpoint_coordinator.py` @448b0253), written here from
that behaviour:

- each operation's `deadline_ts` is `time.time() + control_timeout_s`; replies are awaited until
  the deadline plus `min(control_timeout_s, 5 s)`, a call still unanswered is cancelled, and any
  failure is gathered into `OperationError(operation, {instance: error})`;
- `prepared(id)`: prepare (any instance not prepared → `NotReady`), renew once, renew in the
  background every `max(0.01, min(timeout / 3, 10))` s while the body runs, then always resume;
- `commit`: the inventory's instances must be every actor; each actor's exports must lie within
  its candidates; then `gym_checkpoint.json` is written into the root (RL's format);
- `restore`: every actor; on failure, retire every instance's next attempts (`restore_cleanup`),
  resume all, re-raise; `discard_restored` retires the next attempts after a successful restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quiesce.rl.episodes import Episode
from quiesce.rl.gym_manifest import GymCheckpointManifest

GRACE_S = 5.0


class RLTypes:
    """RL's value classes of `gym_checkpoint_adapter` @ec883a24 as RL's coordinator sees them
    (frozen dataclasses with its field names), for the `isinstance` check its commit makes."""

    class GymCheckpointUnavailable(RuntimeError):
        """RL's picklable stand-in for a Gym coordination error: text only."""

    @dataclass(frozen=True)
    class GymCheckpointEpisode:
        rollout_id: str
        attempt: int

    @dataclass(frozen=True)
    class GymCheckpointPrepareSummary:
        prepared: bool
        blockers: dict[str, tuple[str, ...]]

    @dataclass(frozen=True)
    class GymCheckpointParticipantManifest:
        schema_version: int
        kind: str
        instance: str
        checkpoint_id: str
        records_file: str
        records_sha256: str
        record_count: int

    @dataclass(frozen=True)
    class GymCheckpointParticipantCommitSummary:
        server_name: str
        kind: str
        phase: str
        capture_keys: tuple[str, ...]
        manifest: Any
        staging_keys: tuple[str, ...]

    @dataclass(frozen=True)
    class GymCheckpointCommitSummary:
        exported_episodes: tuple[Any, ...]
        staging_keys: tuple[str, ...]
        participants: tuple[Any, ...]
        staging_keys_by_episode: Mapping[Any, tuple[str, ...]] = field(default_factory=dict)
        unowned_live_episodes: tuple[Any, ...] = ()


class OperationError(RuntimeError):
    def __init__(self, operation: str, failures: Mapping[str, BaseException]) -> None:
        self.operation = operation
        self.failures = dict(failures)
        detail = "; ".join(f"{i}: {type(e).__name__}: {e}" for i, e in sorted(self.failures.items()))
        super().__init__(f"Gym checkpoint {operation} failed on {len(self.failures)} instance(s): {detail}")


class NotReady(RuntimeError):
    def __init__(self, blockers: Mapping[str, Mapping[str, tuple[str, ...]]]) -> None:
        self.blockers = {i: dict(b) for i, b in blockers.items()}
        super().__init__(f"Gym checkpoint participants are not ready: {self.blockers!r}")


class RLCoordinator:
    def __init__(self, shard_set: Any, *, control_timeout_s: float, summary_type: type | None = None) -> None:
        self._handles: dict[str, Any] = dict(shard_set.checkpoint_handles)
        self._timeout = control_timeout_s
        self._summary_type = summary_type  # RL's own class, checked with isinstance as RL does
        self.calls: list[tuple[str, str]] = []  # (operation, instance), in the order sent

    def _deadline(self) -> float:
        return time.time() + self._timeout

    async def _collect(
        self, operation: str, refs: Mapping[str, Any], *, deadline_ts: float
    ) -> dict[str, Any]:
        tasks = {i: asyncio.ensure_future(r) for i, r in refs.items()}
        self.calls.extend((operation, i) for i in refs)
        wait_s = max(0.0, deadline_ts - time.time()) + min(self._timeout, GRACE_S)
        await asyncio.wait(tasks.values(), timeout=wait_s)
        results: dict[str, Any] = {}
        failures: dict[str, BaseException] = {}
        for instance, task in tasks.items():
            if not task.done():
                task.cancel()
                failures[instance] = TimeoutError(f"no reply within {wait_s:.1f}s of the {operation} call")
            elif task.cancelled():
                failures[instance] = asyncio.CancelledError()
            elif (error := task.exception()) is not None:
                failures[instance] = error
            else:
                results[instance] = task.result()
        if failures:
            raise OperationError(operation, failures)
        return results

    async def prepare(self, checkpoint_id: str) -> dict[str, Any]:
        deadline = self._deadline()
        summaries = await self._collect(
            "prepare",
            {
                i: h.checkpoint_prepare.remote(checkpoint_id, deadline_ts=deadline)
                for i, h in self._handles.items()
            },
            deadline_ts=deadline,
        )
        blockers = {i: s.blockers for i, s in summaries.items() if not s.prepared}
        if blockers:
            raise NotReady(blockers)
        return summaries

    async def renew(self, checkpoint_id: str) -> None:
        deadline = self._deadline()
        await self._collect(
            "renew",
            {
                i: h.checkpoint_renew.remote(checkpoint_id, deadline_ts=deadline)
                for i, h in self._handles.items()
            },
            deadline_ts=deadline,
        )

    def _inventory(self, episodes_by_instance: Mapping[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
        if set(episodes_by_instance) != set(self._handles):
            raise ValueError("Gym checkpoint inventory does not match the live actor topology")
        return {i: tuple(episodes_by_instance[i]) for i in self._handles}

    async def commit(
        self, checkpoint_id: str, root: Path, episodes_by_instance: Mapping[str, tuple[Any, ...]]
    ) -> tuple[GymCheckpointManifest, dict[str, Any]]:
        inventory = self._inventory(episodes_by_instance)
        deadline = self._deadline()
        summaries: dict[str, Any] = await self._collect(
            "commit",
            {
                i: self._handles[i].checkpoint_commit.remote(
                    checkpoint_id, str(root), eps, deadline_ts=deadline
                )
                for i, eps in inventory.items()
            },
            deadline_ts=deadline,
        )
        for instance, summary in summaries.items():
            if self._summary_type is not None and not isinstance(summary, self._summary_type):
                raise TypeError(f"Gym checkpoint actor returned an invalid commit summary: {instance}")
            exported = {Episode.coerce(e) for e in summary.exported_episodes}
            unexpected = exported - {Episode.coerce(e) for e in inventory[instance]}
            if unexpected:
                raise RuntimeError(
                    f"Gym checkpoint actor exported an episode outside the candidate set: {instance}"
                )
        staging = {
            i: tuple(sorted({k for e in s.exported_episodes for k in s.staging_keys_by_episode.get(e, ())}))
            for i, s in summaries.items()
        }
        manifest = GymCheckpointManifest(
            checkpoint_id,
            {i: tuple(Episode.coerce(e) for e in s.exported_episodes) for i, s in summaries.items()},
            staging,
        )
        await asyncio.to_thread(manifest.write, root)
        return manifest, summaries

    async def retire(self, checkpoint_id: str, episodes_by_instance: Mapping[str, tuple[Any, ...]]) -> None:
        inventory = self._inventory(episodes_by_instance)
        deadline = self._deadline()
        await self._collect(
            "retire",
            {
                i: self._handles[i].checkpoint_retire.remote(checkpoint_id, eps, deadline_ts=deadline)
                for i, eps in inventory.items()
            },
            deadline_ts=deadline,
        )

    async def discard_restored(self, restore_id: str, manifest: GymCheckpointManifest) -> None:
        await self.retire(restore_id, dict(manifest.next_attempts()))

    async def restore(self, restore_id: str, root: Path, manifest: GymCheckpointManifest) -> None:
        inventory = self._inventory(manifest.instances)
        deadline = self._deadline()
        try:
            await self._collect(
                "restore",
                {
                    i: self._handles[i].checkpoint_restore.remote(
                        restore_id,
                        str(root),
                        eps,
                        source_checkpoint_id=manifest.checkpoint_id,
                        deadline_ts=deadline,
                    )
                    for i, eps in inventory.items()
                },
                deadline_ts=deadline,
            )
        except OperationError as error:
            cleanup: list[BaseException] = []
            try:
                again = self._deadline()
                await self._collect(
                    "restore_cleanup",
                    {
                        i: self._handles[i].checkpoint_retire.remote(
                            restore_id,
                            tuple(Episode.coerce(e).next_attempt() for e in inventory[i]),
                            deadline_ts=again,
                        )
                        for i in inventory
                    },
                    deadline_ts=again,
                )
            except BaseException as retire_failed:
                cleanup.append(retire_failed)
            try:
                await self.resume(restore_id)
            except BaseException as resume_failed:
                cleanup.append(resume_failed)
            for failure in cleanup:
                error.add_note(f"cleanup also failed: {type(failure).__name__}: {failure}")
            raise

    async def resume(self, checkpoint_id: str) -> None:
        deadline = self._deadline()
        await self._collect(
            "resume",
            {
                i: h.checkpoint_resume.remote(checkpoint_id, deadline_ts=deadline)
                for i, h in self._handles.items()
            },
            deadline_ts=deadline,
        )

    async def _renewing(self, checkpoint_id: str, stop: asyncio.Event) -> None:
        interval = max(0.01, min(self._timeout / 3.0, 10.0))
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                await self.renew(checkpoint_id)
            else:
                return

    @asynccontextmanager
    async def prepared(self, checkpoint_id: str) -> AsyncIterator[None]:
        try:
            await self.prepare(checkpoint_id)
            await self.renew(checkpoint_id)
            stop = asyncio.Event()
            renewing = asyncio.create_task(self._renewing(checkpoint_id, stop))
            try:
                yield
            finally:
                stop.set()
                (result,) = await asyncio.gather(renewing, return_exceptions=True)
                if isinstance(result, BaseException):
                    raise result
        except BaseException as error:
            with contextlib.suppress(Exception):
                await self.resume(checkpoint_id)
            raise error
        else:
            await self.resume(checkpoint_id)


class RLNightlyTypes:
    """The nightly shape of RL's adapter values (docs.nvidia.com/nemo/rl/nightly): the episode is
    the backend-neutral `EnvironmentEpisode`, a commit summary's participants are server names,
    and the module has no participant or manifest class."""

    GymCheckpointUnavailable = RLTypes.GymCheckpointUnavailable
    GymCheckpointEpisode = RLTypes.GymCheckpointEpisode
    GymCheckpointPrepareSummary = RLTypes.GymCheckpointPrepareSummary

    @dataclass(frozen=True)
    class GymCheckpointCommitSummary:
        exported_episodes: tuple[Any, ...]
        staging_keys: tuple[str, ...]
        participants: tuple[str, ...]
        staging_keys_by_episode: Mapping[Any, tuple[str, ...]] = field(default_factory=dict)
