"""NeMo RL's `gym_checkpoint.json`, schema 2: which episodes each RL instance committed into one
snapshot, and the model's staging keys per instance — written by quiesce's backend so RL's own
tooling still reads a snapshot quiesce took.

The document follows NeMo RL `nemo_rl/environments/gym_checkpoint_coordinator.py` @448b0253
(same in substance @ec883a24; the later variant @fa3a061a with a required `participants` field is
not followed):

    {"checkpoint_id": str, "instances": {instance_id: [{"attempt": int, "rollout_id": str}]},
     "schema_version": 2, "staging_keys": {instance_id: [str]}}

Rules a manifest keeps (on construction, and so on every load):

- `schema_version` is the integer 2 (not a bool, not 2.0); no field but these four;
- `checkpoint_id` is a non-empty string; there is at least one instance, each id non-empty;
- each episode is an object of exactly `rollout_id` (non-empty string) and `attempt` (an integer
  ≥ 0, not a bool); no instance lists an episode twice (an instance may list none);
- `staging_keys` has exactly the instance ids of `instances`; each list is sorted, without
  repeats, and holds no empty key (a list may be empty: an instance without a model's keys).

Written as RL writes it (`json.dumps(doc, sort_keys=True, indent=2)` plus a newline), atomically
and durably: a temporary file in the same folder, fsynced, renamed over the manifest, the folder
fsynced.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from quiesce.coordinator.durable import fsync_dir
from quiesce.coordinator.wording import field_path, plain
from quiesce.rl.episodes import CommitSummary, Episode, FrozenMap, sorted_episodes

__all__ = ["MANIFEST_FILENAME", "SCHEMA_VERSION", "GymCheckpointManifest"]

MANIFEST_FILENAME: Final = "gym_checkpoint.json"
SCHEMA_VERSION: Final = 2


class _EpisodeDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rollout_id: Annotated[str, StringConstraints(min_length=1)]
    attempt: Annotated[int, Field(ge=0)]


class _ManifestDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    schema_version: int
    checkpoint_id: str
    instances: dict[str, list[_EpisodeDoc]]
    staging_keys: dict[str, list[str]]


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members; ValueError when a key repeats (json keeps the last one silently)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} appears twice in one object")
        seen[key] = value
    return seen


@dataclass(frozen=True, slots=True)
class GymCheckpointManifest:
    """One snapshot's `gym_checkpoint.json` (the module docstring states its rules). `instances`
    keeps each instance's episodes in the order given (RL's order); both mappings are
    `FrozenMap`s in instance-id order."""

    checkpoint_id: str
    instances: Mapping[str, tuple[Episode, ...]]
    staging_keys: Mapping[str, tuple[str, ...]]

    schema_version: ClassVar[int] = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_id, str) or not self.checkpoint_id:
            raise ValueError("checkpoint_id must be a non-empty string")
        if not isinstance(self.instances, Mapping) or not isinstance(self.staging_keys, Mapping):
            raise TypeError("instances and staging_keys must be mappings")
        if not self.instances:
            raise ValueError("instances must hold at least one instance")
        instances: dict[str, tuple[Episode, ...]] = {}
        for instance, raw in sorted(self.instances.items()):
            if not isinstance(instance, str) or not instance:
                raise ValueError(f"an instance id must be a non-empty string, not {instance!r}")
            episodes = tuple(Episode.coerce(e) for e in raw)
            sorted_episodes(episodes, f"instances[{instance!r}]")  # refuses a repeat
            instances[instance] = episodes
        if set(self.staging_keys) != set(instances):
            missing = sorted(set(instances) - set(self.staging_keys))
            unknown = sorted(map(str, set(self.staging_keys) - set(instances)))
            raise ValueError(
                "staging_keys must name exactly the instances of instances:"
                f" missing {missing}, not an instance {unknown}"
            )
        staging: dict[str, tuple[str, ...]] = {}
        for instance in instances:
            keys = tuple(self.staging_keys[instance])
            where = f"staging_keys[{instance!r}]"
            if not all(isinstance(k, str) for k in keys):
                raise TypeError(f"{where} must hold strings")
            if any(not k for k in keys):
                raise ValueError(f"{where} holds an empty key")
            if len(set(keys)) != len(keys):
                raise ValueError(f"{where} holds a key twice")
            if list(keys) != sorted(keys):
                raise ValueError(f"{where} is not sorted")
            staging[instance] = keys
        object.__setattr__(self, "instances", FrozenMap(instances))
        object.__setattr__(self, "staging_keys", FrozenMap(staging))

    # -- building -------------------------------------------------------------------------------

    @classmethod
    def from_commit(cls, checkpoint_id: str, summaries: Mapping[str, CommitSummary]) -> GymCheckpointManifest:
        """The manifest of one commit: per instance, the episodes it exported and its staging keys
        (only exported episodes' keys, as a `CommitSummary` holds them)."""
        return cls(
            checkpoint_id,
            {i: s.exported_episodes for i, s in summaries.items()},
            {i: s.staging_keys for i, s in summaries.items()},
        )

    def episodes(self) -> tuple[Episode, ...]:
        """Every instance's episodes together, sorted."""
        return tuple(sorted(e for eps in self.instances.values() for e in eps))

    def next_attempts(self) -> Mapping[str, tuple[Episode, ...]]:
        """Per instance, the attempts a restore continues its episodes as (each attempt + 1)."""
        return FrozenMap((i, tuple(e.next_attempt() for e in eps)) for i, eps in self.instances.items())

    # -- the document ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: the four fields, plain dicts and lists."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "instances": {i: [e.to_dict() for e in eps] for i, eps in self.instances.items()},
            "schema_version": SCHEMA_VERSION,
            "staging_keys": {i: list(keys) for i, keys in self.staging_keys.items()},
        }

    def to_json(self) -> str:
        """The file's text, as RL writes it: sorted keys, indent 2, a trailing newline."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_dict(cls, document: object, *, source: str = MANIFEST_FILENAME) -> GymCheckpointManifest:
        """The manifest `document` states; ValueError naming `source` and the problem when it
        breaks a rule."""
        if not isinstance(document, Mapping):
            raise ValueError(
                f"{source}: a Gym checkpoint manifest is a JSON object, not {type(document).__name__}"
            )
        try:
            doc = _ManifestDoc.model_validate(dict(document))
        except ValidationError as error:
            problems = "; ".join(f"{field_path(e['loc'])}: {plain(e['msg'])}" for e in error.errors())
            raise ValueError(f"{source}: {problems}") from None
        if doc.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"{source}: unsupported schema_version {doc.schema_version} (this reads {SCHEMA_VERSION})"
            )
        try:
            return cls(
                doc.checkpoint_id,
                {i: tuple(Episode(e.rollout_id, e.attempt) for e in eps) for i, eps in doc.instances.items()},
                {i: tuple(keys) for i, keys in doc.staging_keys.items()},
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error}") from None

    # -- the file -------------------------------------------------------------------------------

    def write(self, root: str | os.PathLike[str]) -> Path:
        """Write `<root>/gym_checkpoint.json` atomically and durably (the module docstring);
        returns its path. A failure leaves any earlier manifest as it was, and no temporary file."""
        folder = Path(root)
        path = folder / MANIFEST_FILENAME
        temporary = folder / f"{MANIFEST_FILENAME}.tmp"
        data = self.to_json().encode("utf-8")
        try:
            fd = os.open(
                temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        fsync_dir(folder)
        return path

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> GymCheckpointManifest:
        """Read `<root>/gym_checkpoint.json` by the rules of the module docstring: ValueError naming
        the file and the problem when it breaks one (OSError when it cannot be read)."""
        path = Path(root) / MANIFEST_FILENAME
        raw = path.read_bytes()
        try:
            document = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_repeated_keys)
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"{path}: not valid JSON: {error}") from None
        return cls.from_dict(document, source=str(path))
