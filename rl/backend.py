"""quiesce as NeMo RL's environment checkpoint backend: RL's `EnvironmentCheckpoint`, over one
quiesce `Coordinator` and its ledger, for every Gym deployment of a run.

RL's single controller uses the interface in this order (`nemo_rl.environments.checkpointing.
interfaces`, nightly docs): enter `snapshot(path)` — the backend pauses — take the data-plane cut,
`await snapshot.check_against_cut(cut)`, save RL's own half into `path`, release the cut, leave
the block — the backend resumes. A restore returns what it continued. The shapes are matched
structurally; nothing of RL is imported. Where RL's published summaries leave a shape open (the
restore method's name and arguments, the fields of `RestoredEnvironmentRollouts`), this module
chooses: `restore(path) -> RestoredRollouts` (`quiesce.rl.episodes`).

Rules the backend keeps:

- **One coordinator, one ledger.** It is opened on first use (or `start()`), which runs recovery
  first: whatever a previous holder of this ledger left half-done — a process killed mid-commit,
  restarted by Ray — is rolled back or finished before this backend answers anything.
- **`snapshot(path)`** (Gym's unified plane): prepare every server, commit into `path` itself (each
  deployment into its folder, `gym-instances/<shard>/replica-<i>`), write RL's
  `gym_checkpoint.json` there (schema 2, `quiesce.rl.gym_manifest`), then yield the snapshot; the
  servers' leases are renewed while RL's block runs. Leaving the block publishes in place
  (`quiesce-manifest.json`, the commit point) and resumes every server. If the block raises,
  everything is rolled back — every server resumed, what the servers wrote and
  `gym_checkpoint.json` removed — and RL's exception propagates unchanged (with a note). On v1
  (each deployment in its folder there too) the snapshot goes into quiesce's snapshots folder —
  a save in place is the unified plane's — and `path` receives `quiesce-snapshot.json`, naming
  it (v1 has no episode ids: no `gym_checkpoint.json`).
- **`check_against_cut(cut)`**: the cut must still be held (RL's cut has `require_live()`), and
  the episodes RL has in flight — `expected(cut)` when the backend was given one, else the cut's
  own `episodes` — must be exactly the committed scope plus the restarts Gym left out of it;
  anything else raises (`cut_mismatch`), which rolls the snapshot back. A backend that can read
  neither refuses (`cut_unreadable`) rather than pass a check it cannot make.
- **`restore(path)`**: restore the snapshot in `path` into every server (verified against the
  ledger first), resume them, and return the continued episodes (attempt n + 1) per RL instance;
  with `gym_checkpoint.json` present they must be exactly its episodes' next attempts.
- **Errors** leave as `EnvironmentCheckpointError` (`quiesce.rl.errors`: operation, server, code,
  transient; it pickles across Ray), raised from the quiesce error; RL's own exceptions from inside
  the snapshot block are never wrapped. The control token never appears in one.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread

from quiesce.coordinator import Attempt, ClusterConfig, Coordinator, QuiesceError
from quiesce.coordinator.config import load_config
from quiesce.coordinator.discovery import Member
from quiesce.coordinator.protocol_v2 import episode_of_key
from quiesce.coordinator.publish import write_json_durably
from quiesce.coordinator.recovery import RecoveryReport
from quiesce.rl.deployments import parse_quiesce_name
from quiesce.rl.episodes import Episode, FrozenMap, RestoredRollouts, sorted_episodes
from quiesce.rl.errors import EnvironmentCheckpointError, from_quiesce
from quiesce.rl.gym_manifest import MANIFEST_FILENAME, GymCheckpointManifest

__all__ = [
    "POINTER",
    "QuiesceEnvironmentCheckpoint",
    "QuiesceEnvironmentSnapshot",
    "instance_of",
    "read_cut",
]

#: On v1: the file in RL's snapshot folder that names the quiesce snapshot holding Gym's state.
POINTER: Final = "quiesce-snapshot.json"
#: The RL instance id of a server without a `gym-instances/<shard>/replica-<i>` folder.
DEFAULT_INSTANCE: Final = "nemo_gym/replica-0"
#: Episodes named in an error (the rest are counted).
NAMED: Final = 5

#: `expected(cut)`: the episodes RL has in flight at the cut (sync or async).
Expected = Callable[[Any], Iterable[Any] | Awaitable[Iterable[Any]]]
#: `scope()`: the commit scope — the episodes RL continues — when RL gives one (sync or async).
Scope = Callable[[], Iterable[Any] | Awaitable[Iterable[Any]]]


def instance_of(member: Member) -> str:
    """The RL instance id (`<shard>/replica-<i>`) of a participant: read from its folder
    (`gym-instances/<shard>/replica-<i>`, as `quiesce.rl.deployments` writes it on either plane),
    else from its name (`<shard>.r<i>.<gym name>`), else RL's unsharded default."""
    prefix = "gym-instances/"
    if member.folder.startswith(prefix) and member.folder.count("/") == 2:
        return member.folder.removeprefix(prefix)
    named = parse_quiesce_name(member.name)
    if named is not None:
        return f"{named[0]}/replica-{named[1]}"
    return DEFAULT_INSTANCE


def _episode(key: str) -> Episode:
    """The episode a Gym capture key names."""
    return Episode.from_episode_id(episode_of_key(key))


def absolute_folder(path: str | os.PathLike[str]) -> Path:
    """`path` made absolute without resolving symlinks (the coordinator refuses a symlink)."""
    return Path(os.path.abspath(os.fspath(path)))


def _read_folder(folder: Path) -> tuple[GymCheckpointManifest | None, Path]:
    """RL's `gym_checkpoint.json` in `folder` (None: there is none) and the quiesce snapshot to
    restore: `folder` itself, or the one its v1 pointer names."""
    manifest = GymCheckpointManifest.load(folder) if (folder / MANIFEST_FILENAME).is_file() else None
    pointer = folder / POINTER
    if pointer.is_file():
        named = json.loads(pointer.read_text(encoding="utf-8"))
        return manifest, Path(str(named["snapshot"]))
    return manifest, folder


def _named(episodes: Sequence[Episode]) -> str:
    shown = ", ".join(e.capture_key for e in episodes[:NAMED])
    return shown + (f" and {len(episodes) - NAMED} more" if len(episodes) > NAMED else "")


async def _call(function: Callable[..., Any], *args: Any) -> Any:
    value = function(*args)
    return await value if inspect.isawaitable(value) else value


class QuiesceEnvironmentSnapshot:
    """The backend's part of one RL snapshot while every Gym server is paused (RL's
    `EnvironmentSnapshot`). Valid only inside `QuiesceEnvironmentCheckpoint.snapshot`'s block.

    `episodes`: the committed scope; `restarts`: the episodes Gym reported as restarts, left out
    of it (RL starts them over); `by_instance`: what each RL instance exported; `manifest`: the
    `gym_checkpoint.json` written into `path` (None on v1)."""

    def __init__(
        self,
        attempt: Attempt,
        path: Path,
        by_instance: Mapping[str, tuple[Episode, ...]],
        manifest: GymCheckpointManifest | None,
        expected: Expected | None,
    ) -> None:
        self.checkpoint_id = attempt.checkpoint_id
        self.path = path
        self.plane = attempt.plane
        self.episodes = sorted_episodes(_episode(k) for k in attempt.scope)
        self.restarts = sorted_episodes(
            {_episode(k) for keys in attempt.restarts.values() for k in keys}, "restarts"
        )
        self.by_instance: Mapping[str, tuple[Episode, ...]] = FrozenMap(by_instance)
        self.manifest = manifest
        self._expected = expected
        self.checked = False

    async def check_against_cut(self, cut: Any) -> None:
        """Check this snapshot against RL's data-plane cut (module docstring); raises
        `EnvironmentCheckpointError` (`cut_mismatch`, `cut_unreadable`), which — raised inside the
        snapshot block — rolls the snapshot back."""
        self.compare(await read_cut(self.checkpoint_id, cut, self._expected))

    def compare(self, expected: Iterable[Episode]) -> None:
        """The episodes RL has in flight against the committed scope and the restarts left out of
        it (on v1, which names no episodes, nothing to compare); `cut_mismatch` when they differ."""
        if self.plane != "v2":
            self.checked = True
            return
        wanted, saved = set(expected), set(self.episodes)
        missing = sorted(wanted - saved - set(self.restarts))
        extra = sorted(saved - wanted)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"in flight in RL but not committed: {_named(missing)} ({len(missing)})")
            if extra:
                parts.append(f"committed but not in flight in RL: {_named(extra)} ({len(extra)})")
            raise EnvironmentCheckpointError(
                f"checkpoint {self.checkpoint_id} does not match RL's data-plane cut — "
                + "; ".join(parts)
                + ". The snapshot is rolled back; take it again once RL and Gym agree",
                operation="check_against_cut",
                code="cut_mismatch",
                transient=False,
            )
        self.checked = True


async def read_cut(checkpoint_id: str, cut: Any, expected: Expected | None) -> tuple[Episode, ...]:
    """The episodes RL has in flight at `cut`: `expected(cut)` when given, else the cut's own
    `episodes`. The cut must still be held (RL's cut has `require_live()`); a cut that names no
    episodes, with no reader, is `cut_unreadable` — never a check passed without comparing."""
    live = getattr(cut, "require_live", None)
    if callable(live):
        try:
            live()
        except Exception as error:
            raise EnvironmentCheckpointError(
                f"checkpoint {checkpoint_id}: RL's data-plane cut is no longer held ({error}); check the"
                " snapshot while the cut is held",
                operation="check_against_cut",
                code="cut_mismatch",
                transient=False,
            ) from error
    if expected is not None:
        raw = await _call(expected, cut)
    elif getattr(cut, "episodes", None) is not None:
        raw = cut.episodes
    else:
        raise EnvironmentCheckpointError(
            f"checkpoint {checkpoint_id}: the cut names no episodes and the backend was given no"
            " `expected` reader, so the committed episodes cannot be checked against RL's; build the"
            " backend with expected=<a function of the cut returning the episodes RL has in flight>",
            operation="check_against_cut",
            code="cut_unreadable",
            transient=False,
        )
    return sorted_episodes(raw, "the episodes RL has in flight")


class QuiesceEnvironmentCheckpoint:
    """RL's `EnvironmentCheckpoint` over one quiesce `Coordinator` (module docstring).

    `config`: the cluster config (a `ClusterConfig`, a YAML path, or a zero-argument async
    function returning one, called once on first use — the builder finds RL's deployments that
    way). `deadline_s`: each snapshot's budget (default: the config's). `scope`: the episodes RL
    continues, when RL gives them (default: what Gym's environment servers export). `expected`:
    reads the episodes RL has in flight from the cut. Use as an async context manager, or call
    `start()` / `aclose()`; every method must be called on one asyncio loop (the driver's, or an
    async Ray actor's)."""

    def __init__(
        self,
        config: ClusterConfig | str | os.PathLike[str] | Callable[[], Awaitable[ClusterConfig]],
        *,
        token: str | None = None,
        deadline_s: float | None = None,
        scope: Scope | None = None,
        expected: Expected | None = None,
    ) -> None:
        self._config = config
        self._token = token
        self._deadline_s = deadline_s
        self._scope = scope
        self._expected = expected
        self._stack: AsyncExitStack | None = None
        self._coord: Coordinator | None = None
        self._lock = anyio.Lock()
        self.recovery: RecoveryReport | None = None

    # -- life --------------------------------------------------------------------------------------

    async def __aenter__(self) -> QuiesceEnvironmentCheckpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator, once started."""
        if self._coord is None:
            raise EnvironmentCheckpointError(
                "the backend is not started", operation="start", code="invariant", transient=False
            )
        return self._coord

    async def start(self) -> RecoveryReport | None:
        """Open the coordinator (its recovery runs first) and discover every server; idempotent.
        Returns what recovery did."""
        async with self._lock:
            if self._coord is not None:
                return self.recovery
            stack = AsyncExitStack()
            try:
                config = self._config
                if callable(config):
                    config = await config()
                elif not isinstance(config, ClusterConfig):
                    config = load_config(Path(config))
                coord = await stack.enter_async_context(Coordinator.open(config, token=self._token))
                self.recovery = coord.last_recovery
                await coord.discover()
            except BaseException as error:
                with anyio.CancelScope(shield=True):
                    await stack.aclose()
                if isinstance(error, (QuiesceError, OSError)):
                    raise from_quiesce("start", error) from error
                raise
            self._stack, self._coord = stack, coord
            return self.recovery

    async def aclose(self) -> None:
        """Close the coordinator and its ledger; idempotent."""
        stack, self._stack, self._coord = self._stack, None, None
        if stack is not None:
            with anyio.CancelScope(shield=True):
                await stack.aclose()

    # -- snapshot ------------------------------------------------------------------------------

    @asynccontextmanager
    async def snapshot(self, path: str | os.PathLike[str]) -> AsyncIterator[QuiesceEnvironmentSnapshot]:
        """Pause, commit into `path`, yield the snapshot; publish and resume on leaving, roll back
        if the block raises (module docstring)."""
        await self.start()
        coord = self.coordinator
        folder = absolute_folder(path)
        v2 = coord.discovery is not None and coord.discovery.plane == "v2"
        try:
            scope = None
            if self._scope is not None and v2:
                scope = [e.to_episode_id() for e in sorted_episodes(await _call(self._scope), "the scope")]
            saving = coord.save(deadline_s=self._deadline_s, episodes=scope, into=folder if v2 else None)
            attempt = await saving.__aenter__()
        except QuiesceError as error:
            raise from_quiesce("snapshot", error) from error
        written: list[Path] = []
        try:
            snap = await self._after_commit(attempt, folder, written)
        except BaseException as error:
            await self._leave(saving, error, written)
            raise
        try:
            yield snap
        except BaseException as error:
            await self._leave(saving, error, written)
            raise
        try:
            await saving.__aexit__(None, None, None)
        except QuiesceError as error:
            if attempt.snapshot is None:  # not published: rolled back, RL's folder as it was
                await anyio.to_thread.run_sync(self._unlink, written)
            raise from_quiesce("snapshot", error) from error
        if not v2:  # v1: the snapshot is quiesce's; RL's folder names it
            pointer = {"checkpoint_id": attempt.checkpoint_id, "snapshot": str(attempt.snapshot)}
            await anyio.to_thread.run_sync(write_json_durably, folder / POINTER, pointer)

    async def _after_commit(
        self, attempt: Attempt, folder: Path, written: list[Path]
    ) -> QuiesceEnvironmentSnapshot:
        """What a committed save adds before RL's block runs: RL's `gym_checkpoint.json` (v2)."""
        by_instance: dict[str, set[Episode]] = {}
        environments = {m.name for m in attempt.participants if m.component == "environment"}
        for m in attempt.participants:
            by_instance.setdefault(instance_of(m), set())
            if m.name in environments or not environments:
                keys = attempt.exported.get(m.name, ())
                by_instance[instance_of(m)].update(_episode(k) for k in keys)
        exported = {i: tuple(sorted(eps)) for i, eps in sorted(by_instance.items())}
        manifest = None
        if attempt.plane == "v2":
            staging: dict[str, set[str]] = {i: set() for i in exported}
            for m in attempt.participants:
                reply = attempt.commits.get(m.name, {}).get("reply", {})
                keys_of = reply.get("staging_keys_by_episode") or {}
                mine = {e.capture_key for e in exported[instance_of(m)]}
                for key, keys in keys_of.items():
                    if key in mine:
                        staging[instance_of(m)].update(keys)
            manifest = GymCheckpointManifest(
                attempt.checkpoint_id, exported, {i: tuple(sorted(k)) for i, k in staging.items()}
            )
            written.append(folder / MANIFEST_FILENAME)
            await anyio.to_thread.run_sync(manifest.write, folder)
        return QuiesceEnvironmentSnapshot(attempt, folder, exported, manifest, self._expected)

    async def _leave(self, saving: Any, error: BaseException, written: list[Path]) -> None:
        """Roll the save back for `error` (the coordinator re-raises it with a note: swallowed
        here, the caller re-raises it), and remove what this backend wrote into RL's folder. The
        save shields its own rollback."""
        try:  # not in a scope of ours: the save's own scopes must close in the order they opened
            await saving.__aexit__(type(error), error, error.__traceback__)
        except BaseException as again:
            if again is not error:
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._unlink, written)

    @staticmethod
    def _unlink(paths: list[Path]) -> None:
        for path in paths:
            path.unlink(missing_ok=True)

    # -- restore -------------------------------------------------------------------------------

    async def restore(self, path: str | os.PathLike[str]) -> RestoredRollouts:
        """Restore the snapshot in `path` into every server, resume them, and return what the
        restore continued (module docstring)."""
        await self.start()
        coord = self.coordinator
        folder = absolute_folder(path)
        try:
            manifest, source = await anyio.to_thread.run_sync(_read_folder, folder)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise EnvironmentCheckpointError(
                f"{folder} holds no readable environment snapshot: {error}",
                operation="restore",
                code="snapshot_invalid",
                transient=False,
            ) from error
        try:
            attempt = await coord.restore(source, deadline_s=self._deadline_s, resume=True)
        except QuiesceError as error:
            raise from_quiesce("restore", error) from error
        by_instance: dict[str, set[Episode]] = {}
        environments = [m for m in attempt.participants if m.component == "environment"]
        if attempt.plane == "v2":
            for m in environments or attempt.participants:
                by_instance.setdefault(instance_of(m), set()).update(
                    _episode(k) for k in attempt.restored.get(m.name, ())
                )
        else:
            for r in attempt.resubmit:
                member = attempt.member(r.server)
                where = instance_of(member) if member is not None else DEFAULT_INSTANCE
                by_instance.setdefault(where, set()).add(Episode(r.rollout_id, r.attempt_index))
        # v1: continuations a restore discarded (they depend on a restart_only resources server)
        discarded = [Episode(d.rollout_id, d.attempt_index - 1) for d in attempt.restart]
        restored = RestoredRollouts.of(
            attempt.checkpoint_id,
            attempt.source_checkpoint_id or "",
            {i: sorted(eps) for i, eps in sorted(by_instance.items())},
            discarded,
        )
        if manifest is not None:
            wanted = {i: set(eps) for i, eps in manifest.next_attempts().items() if eps}
            got = {i: set(eps) for i, eps in restored.by_instance.items() if eps}
            if wanted != got:
                await self.discard_restored(restored)
                raise EnvironmentCheckpointError(
                    f"restore {restored.restore_id} continued other episodes than {folder}/"
                    f"{MANIFEST_FILENAME} names (wanted {sum(map(len, wanted.values()))} across"
                    f" {sorted(wanted)}, got {sum(map(len, got.values()))} across {sorted(got)}); the"
                    " continued attempts were retired",
                    operation="restore",
                    code="invariant",
                    transient=False,
                )
        return restored

    async def discard_restored(self, restored: RestoredRollouts) -> None:
        """Retire what a restore continued, everywhere (RL's `discard_restored`: RL will not run
        those attempts)."""
        if not restored.episodes:
            return
        try:
            await self.coordinator.retire([e.to_episode_id() for e in restored.episodes])
        except QuiesceError as error:
            raise from_quiesce("retire", error) from error

    async def retire(self, episodes: Iterable[Any]) -> None:
        """Retire these attempts on every server (Gym refuses them and every earlier attempt)."""
        await self.start()
        try:
            await self.coordinator.retire([e.to_episode_id() for e in sorted_episodes(episodes)])
        except QuiesceError as error:
            raise from_quiesce("retire", error) from error

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop the retire marks of these rollouts on every server."""
        await self.start()
        try:
            await self.coordinator.forget(sorted(set(rollout_ids)))
        except QuiesceError as error:
            raise from_quiesce("forget", error) from error
