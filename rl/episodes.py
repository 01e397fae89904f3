"""The values the NeMo RL backend hands RL and takes from it: episodes, prepare and commit
summaries, and what a restore continued. Plain, frozen, picklable (they cross Ray), importing
nothing from Ray or NeMo RL: RL's types are matched by shape.

Shapes follow NeMo RL `nemo_rl/environments/gym_checkpoint_adapter.py` @ec883a24
(`GymCheckpointEpisode`, `GymCheckpointPrepareSummary`, `GymCheckpointCommitSummary` with its
participant records and `staging_keys_by_episode`, `GymCheckpointParticipantManifest`) and, for
`RestoredRollouts`, the role RL's nightly docs give `RestoredEnvironmentRollouts` (its fields are
not published there; they are quiesce's). The capture key is Gym's `EpisodeId.capture_key`
(`quiesce.coordinator.protocol_v2.capture_key_of`).

Invariants every value here keeps (checked on construction, so a value that exists is valid):

- an `Episode` has a non-empty `rollout_id` (a `str`) and an `attempt` that is an `int` (not a
  `bool`) ≥ 0;
- every tuple of episodes or keys a value holds is sorted and free of repeats (construction sorts
  it and refuses repeats), so equal contents make equal values;
- every mapping is a `FrozenMap`: immutable, picklable, hashable, equal to any mapping with the
  same items.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from quiesce.coordinator.protocol_v2 import KINDS, EpisodeId, capture_key_of
from quiesce.coordinator.protocol_v2 import ParticipantManifest as _GymManifest

__all__ = [
    "CommitSummary",
    "Episode",
    "FrozenMap",
    "ParticipantCommitSummary",
    "ParticipantManifest",
    "PrepareSummary",
    "RestoredRollouts",
    "sorted_episodes",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")

_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")


class FrozenMap(Mapping[K, V], Generic[K, V]):
    """An immutable mapping that pickles by its items (unlike `types.MappingProxyType`), hashes
    when its values do, keeps insertion order, and equals any mapping with the same items."""

    __slots__ = ("_data",)

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._data: dict[K, V] = dict(items)

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __reduce__(self) -> tuple[Callable[..., FrozenMap[K, V]], tuple[tuple[tuple[K, V], ...]]]:
        return (FrozenMap, (tuple(self._data.items()),))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


# ---------------------------------------------------------------------------------------------
# Checks shared by the values below
# ---------------------------------------------------------------------------------------------


def _text(value: object, what: str) -> str:
    """`value` when it is a non-empty `str`; TypeError / ValueError naming `what` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    return value


def _count(value: object, what: str, *, minimum: int = 0) -> int:
    """`value` when it is an `int` (never a `bool`) ≥ `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, not {value}")
    return value


def _flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be true or false, not {type(value).__name__}")
    return value


def _unique_sorted(values: Iterable[T], what: str, key: Callable[[T], Any]) -> tuple[T, ...]:
    """`values` sorted by `key`; ValueError naming the first repeat."""
    ordered = sorted(values, key=key)
    for before, after in itertools.pairwise(ordered):
        if key(before) == key(after):
            raise ValueError(f"{what} holds {after!r} twice")
    return tuple(ordered)


def _keys(values: object, what: str) -> tuple[str, ...]:
    """Non-empty strings, sorted, no repeats (a bare string is refused: it is not a list of keys)."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a list of strings, not {type(values).__name__}")
    checked = [_text(v, f"a key of {what}") for v in values]
    return _unique_sorted(checked, what, key=lambda k: k)


def _episode_sort_key(episode: Episode) -> tuple[str, int]:
    return (episode.rollout_id, episode.attempt)


def sorted_episodes(values: object, what: str = "episodes") -> tuple[Episode, ...]:
    """Each value as an `Episode` (`Episode.coerce`), sorted by (rollout_id, attempt); ValueError
    naming `what` when one repeats. A bare `Episode`, string or mapping is refused (not a list)."""
    if isinstance(values, str | bytes | Mapping | Episode) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be a list of episodes, not {type(values).__name__}")
    return _unique_sorted((Episode.coerce(v) for v in values), what, key=_episode_sort_key)


# ---------------------------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Episode:
    """One attempt of one rollout: RL's `GymCheckpointEpisode` / `EnvironmentEpisode`.

    `rollout_id` is a non-empty `str`; `attempt` an `int` ≥ 0 that is not a `bool` (TypeError for
    a wrong type, ValueError for a wrong value). Ordered by (rollout_id, attempt)."""

    rollout_id: str
    attempt: int

    def __post_init__(self) -> None:
        _text(self.rollout_id, "an episode's rollout_id")
        _count(self.attempt, "an episode's attempt")

    @property
    def capture_key(self) -> str:
        """Gym's name of this attempt: the rollout id for attempt 0, `<rollout_id>-a<attempt>` after."""
        return capture_key_of(self.rollout_id, self.attempt)

    def next_attempt(self) -> Episode:
        """The same rollout's next attempt (what a restore continues this one as)."""
        return Episode(self.rollout_id, self.attempt + 1)

    def to_dict(self) -> dict[str, Any]:
        """`{"rollout_id", "attempt"}`: an episode as `gym_checkpoint.json` holds it."""
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}

    def to_episode_id(self) -> EpisodeId:
        """quiesce's `EpisodeId` of this attempt. Gym's ids are stricter than RL's (letters,
        digits, `._-`, no trailing `-a<N>`): a rollout id Gym cannot carry raises ValueError."""
        return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt)

    @classmethod
    def from_episode_id(cls, episode_id: EpisodeId) -> Episode:
        """The episode quiesce's `EpisodeId` names (always valid: EpisodeId's rules are stricter)."""
        return cls(episode_id.rollout_id, episode_id.attempt)

    @classmethod
    def coerce(cls, value: object) -> Episode:
        """`value` as an Episode: an Episode (itself), a quiesce `EpisodeId`, a mapping with exactly
        the keys `rollout_id` and `attempt`, or any object with those two attributes (RL's
        `EnvironmentEpisode` and `GymCheckpointEpisode`). Anything else: TypeError."""
        if isinstance(value, Episode):
            return value
        if isinstance(value, EpisodeId):
            return cls.from_episode_id(value)
        if isinstance(value, Mapping):
            if set(value) != {"rollout_id", "attempt"}:
                raise ValueError(
                    "an episode mapping must hold exactly rollout_id and attempt, not"
                    f" {sorted(map(str, value))}"
                )
            return cls(value["rollout_id"], value["attempt"])
        rollout_id = getattr(value, "rollout_id", None)
        attempt = getattr(value, "attempt", None)
        if rollout_id is None or attempt is None:
            raise TypeError(
                f"cannot read an episode from {type(value).__name__}: it needs rollout_id and attempt"
            )
        return cls(rollout_id, attempt)


# ---------------------------------------------------------------------------------------------
# Prepare
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrepareSummary:
    """One deployment's prepare (RL's `GymCheckpointPrepareSummary`): `prepared`, and per server
    not yet ready the capture keys that keep it from it.

    `blockers` maps non-empty server names to sorted, repeat-free tuples of capture keys. A
    prepared deployment lists no blocker."""

    prepared: bool
    blockers: Mapping[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        _flag(self.prepared, "prepared")
        if not isinstance(self.blockers, Mapping):
            raise TypeError(f"blockers must be a mapping, not {type(self.blockers).__name__}")
        blockers = FrozenMap(
            (_text(server, "a blocker's server"), _keys(keys, f"the blockers of {server}"))
            for server, keys in sorted(self.blockers.items())
        )
        if self.prepared and any(blockers.values()):
            raise ValueError("a prepared deployment lists no blockers")
        object.__setattr__(self, "blockers", blockers)


# ---------------------------------------------------------------------------------------------
# Restore
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestoredRollouts:
    """What a restore continued (the role of RL's `RestoredEnvironmentRollouts`).

    - `restore_id` (the restore's own id) and `source_checkpoint_id` (the snapshot it restored)
      are non-empty and differ: Gym restores under a new id.
    - `episodes`: the continued attempts, each a saved attempt n continued as n + 1 (so every
      attempt is ≥ 1); sorted, no repeats.
    - `by_instance`: the same episodes per RL instance id (`<shard>/replica-<i>`); every episode is
      under exactly one instance, and the instances together hold exactly `episodes`.
    - `discarded`: the saved attempts (n, as in the snapshot) the restore did not continue; none
      of their rollouts is among the continued ones.

    `RestoredRollouts.of(...)` builds one from `by_instance` alone."""

    restore_id: str
    source_checkpoint_id: str
    episodes: tuple[Episode, ...]
    by_instance: Mapping[str, tuple[Episode, ...]]
    discarded: tuple[Episode, ...] = ()

    def __post_init__(self) -> None:
        _text(self.restore_id, "restore_id")
        _text(self.source_checkpoint_id, "source_checkpoint_id")
        if self.restore_id == self.source_checkpoint_id:
            raise ValueError(
                f"a restore runs under an id of its own, not the snapshot's ({self.restore_id!r})"
            )
        episodes = sorted_episodes(self.episodes, "the continued episodes")
        first = next((e for e in episodes if e.attempt < 1), None)
        if first is not None:
            raise ValueError(
                f"{first!r} cannot be continued: a continued attempt is a saved one plus 1 (≥ 1)"
            )
        if not isinstance(self.by_instance, Mapping):
            raise TypeError(f"by_instance must be a mapping, not {type(self.by_instance).__name__}")
        by_instance = FrozenMap(
            (_text(i, "an instance id"), sorted_episodes(eps, f"the episodes of instance {i}"))
            for i, eps in sorted(self.by_instance.items())
        )
        owner: dict[Episode, str] = {}
        for instance, eps in by_instance.items():
            for episode in eps:
                if episode in owner:
                    raise ValueError(f"{episode!r} is under two instances: {owner[episode]} and {instance}")
                owner[episode] = instance
        if set(owner) != set(episodes):
            missing = sorted(set(episodes) - set(owner), key=_episode_sort_key)
            extra = sorted(set(owner) - set(episodes), key=_episode_sort_key)
            raise ValueError(
                "by_instance must hold exactly the continued episodes:"
                f" under no instance {missing}, under an instance but not continued {extra}"
            )
        discarded = sorted_episodes(self.discarded, "the discarded episodes")
        continued = {e.rollout_id for e in episodes}
        both = sorted({e.rollout_id for e in discarded} & continued)
        if both:
            raise ValueError(f"rollouts both continued and discarded: {both}")
        object.__setattr__(self, "episodes", episodes)
        object.__setattr__(self, "by_instance", by_instance)
        object.__setattr__(self, "discarded", discarded)

    @classmethod
    def of(
        cls,
        restore_id: str,
        source_checkpoint_id: str,
        by_instance: Mapping[str, Iterable[object]],
        discarded: Iterable[object] = (),
    ) -> RestoredRollouts:
        """The restore that continued `by_instance`'s episodes (each one's attempt n + 1)."""
        instances = {
            i: sorted_episodes(eps, f"the episodes of instance {i}") for i, eps in by_instance.items()
        }
        every = tuple(e for eps in instances.values() for e in eps)
        return cls(
            restore_id, source_checkpoint_id, every, instances, sorted_episodes(discarded, "discarded")
        )

    def continued_from(self) -> tuple[Episode, ...]:
        """The saved attempts the restore continued (each continued episode's attempt - 1), sorted."""
        return tuple(Episode(e.rollout_id, e.attempt - 1) for e in self.episodes)


# ---------------------------------------------------------------------------------------------
# Commit
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParticipantManifest:
    """One participant's `manifest.json` (RL's `GymCheckpointParticipantManifest`, Gym's schema):
    `schema_version` an int ≥ 1, `kind` one of Gym's kinds, non-empty `instance`, `checkpoint_id`
    and `records_file`, `records_sha256` 64 lowercase hex digits, `record_count` an int ≥ 0."""

    schema_version: int
    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int

    def __post_init__(self) -> None:
        _count(self.schema_version, "a participant manifest's schema_version", minimum=1)
        if _text(self.kind, "a participant manifest's kind") not in KINDS:
            raise ValueError(
                f"a participant manifest's kind must be one of {sorted(KINDS)}, not {self.kind!r}"
            )
        _text(self.instance, "a participant manifest's instance")
        _text(self.checkpoint_id, "a participant manifest's checkpoint_id")
        _text(self.records_file, "a participant manifest's records_file")
        if not _SHA256.match(_text(self.records_sha256, "a participant manifest's records_sha256")):
            raise ValueError("a participant manifest's records_sha256 must be 64 lowercase hex digits")
        _count(self.record_count, "a participant manifest's record_count")

    @classmethod
    def from_gym(cls, manifest: _GymManifest | Mapping[str, Any]) -> ParticipantManifest:
        """The manifest of a commit reply (quiesce's wire model), or a `manifest.json` as read
        (a mapping; keys other than the seven fields are ignored, as newer Gym may add some)."""
        raw: Mapping[str, Any] = manifest.model_dump() if isinstance(manifest, _GymManifest) else manifest
        return cls(
            schema_version=raw["schema_version"],
            kind=raw["kind"],
            instance=raw["instance"],
            checkpoint_id=raw["checkpoint_id"],
            records_file=raw["records_file"],
            records_sha256=raw["records_sha256"],
            record_count=raw["record_count"],
        )


@dataclass(frozen=True, slots=True)
class ParticipantCommitSummary:
    """One Gym server's commit (RL's `GymCheckpointParticipantCommitSummary`): its name and kind,
    its phase (always `committed`: only a committed reply makes a summary), the capture keys it
    exported and the staging keys it reported (each sorted, no repeats), and its manifest, whose
    kind is the server's."""

    server_name: str
    kind: str
    phase: str
    capture_keys: tuple[str, ...]
    manifest: ParticipantManifest
    staging_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _text(self.server_name, "a participant's server_name")
        if _text(self.kind, "a participant's kind") not in KINDS:
            raise ValueError(f"a participant's kind must be one of {sorted(KINDS)}, not {self.kind!r}")
        if self.phase != "committed":
            raise ValueError(
                f"{self.server_name}: a commit summary is of a committed server, not {self.phase!r}"
            )
        if not isinstance(self.manifest, ParticipantManifest):
            raise TypeError(f"{self.server_name}: manifest must be a ParticipantManifest")
        if self.manifest.kind != self.kind:
            raise ValueError(
                f"{self.server_name}: its manifest is of a {self.manifest.kind} server, not {self.kind}"
            )
        capture = _keys(self.capture_keys, f"the capture keys of {self.server_name}")
        staging = _keys(self.staging_keys, f"the staging keys of {self.server_name}")
        object.__setattr__(self, "capture_keys", capture)
        object.__setattr__(self, "staging_keys", staging)


@dataclass(frozen=True, slots=True)
class CommitSummary:
    """One deployment's commit (RL's `GymCheckpointCommitSummary`).

    - `exported_episodes`: what the deployment exported (sorted, no repeats);
    - `staging_keys`: the model's staging keys (sorted, no repeats);
    - `participants`: one record per server, server names unique (kept in name order);
    - `staging_keys_by_episode`: which episode each staging key belongs to — together its values
      attribute exactly `staging_keys`;
    - `unowned_live_episodes`: parked sessions no environment or agent owns (cannot be restored);
      none of them is exported."""

    exported_episodes: tuple[Episode, ...]
    staging_keys: tuple[str, ...]
    participants: tuple[ParticipantCommitSummary, ...]
    staging_keys_by_episode: Mapping[Episode, tuple[str, ...]]
    unowned_live_episodes: tuple[Episode, ...] = ()

    def __post_init__(self) -> None:
        exported = sorted_episodes(self.exported_episodes, "exported_episodes")
        staging = _keys(self.staging_keys, "staging_keys")
        participants = tuple(self.participants)
        for p in participants:
            if not isinstance(p, ParticipantCommitSummary):
                raise TypeError(f"a participant must be a ParticipantCommitSummary, not {type(p).__name__}")
        participants = _unique_sorted(participants, "participants", key=lambda p: p.server_name)
        if not isinstance(self.staging_keys_by_episode, Mapping):
            raise TypeError("staging_keys_by_episode must be a mapping")
        pairs: list[tuple[Episode, tuple[str, ...]]] = []
        for raw, keys in self.staging_keys_by_episode.items():
            episode = Episode.coerce(raw)
            pairs.append((episode, _keys(keys, f"the staging keys of {episode.capture_key}")))
        pairs.sort(key=lambda pair: _episode_sort_key(pair[0]))
        by_episode = FrozenMap(pairs)
        if len(by_episode) != len(pairs):
            raise ValueError("staging_keys_by_episode names an episode twice")
        attributed = {k for keys in by_episode.values() for k in keys}
        if attributed != set(staging):
            raise ValueError(
                "staging_keys_by_episode must attribute exactly staging_keys:"
                f" unattributed {sorted(set(staging) - attributed)}, not staging keys"
                f" {sorted(attributed - set(staging))}"
            )
        unowned = sorted_episodes(self.unowned_live_episodes, "unowned_live_episodes")
        both = sorted(set(unowned) & set(exported), key=_episode_sort_key)
        if both:
            raise ValueError(f"episodes both exported and unowned: {both}")
        object.__setattr__(self, "exported_episodes", exported)
        object.__setattr__(self, "staging_keys", staging)
        object.__setattr__(self, "participants", participants)
        object.__setattr__(self, "staging_keys_by_episode", by_episode)
        object.__setattr__(self, "unowned_live_episodes", unowned)
