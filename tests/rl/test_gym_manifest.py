"""`quiesce.rl.gym_manifest`: `gym_checkpoint.json` (schema 2) is written byte for byte as NeMo RL
writes it, atomically, and read back equal; every rule RL's loader keeps refuses a file that
breaks it, with a message naming the file and the problem."""

from __future__ import annotations

import copy
import json
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiesce.rl.episodes import CommitSummary, Episode
from quiesce.rl.gym_manifest import MANIFEST_FILENAME, SCHEMA_VERSION, GymCheckpointManifest

#: A document as RL writes it (hand-written, not produced by the code under test).
DOC: dict[str, Any] = {
    "checkpoint_id": "ckpt-000042",
    "instances": {
        "nemo_gym/replica-0": [
            {"attempt": 0, "rollout_id": "grp3_g0_a0"},
            {"attempt": 2, "rollout_id": "grp1_g0_a1"},
        ],
        "nemo_gym/replica-1": [],
    },
    "schema_version": 2,
    "staging_keys": {"nemo_gym/replica-0": ["tq/grp1/0", "tq/grp3/0"], "nemo_gym/replica-1": []},
}


def manifest_of(doc: dict[str, Any]) -> GymCheckpointManifest:
    return GymCheckpointManifest(
        doc["checkpoint_id"],
        {
            i: tuple(Episode(e["rollout_id"], e["attempt"]) for e in eps)
            for i, eps in doc["instances"].items()
        },
        {i: tuple(keys) for i, keys in doc["staging_keys"].items()},
    )


def rl_bytes(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Writing and reading
# ---------------------------------------------------------------------------------------------


def test_write_is_byte_identical_to_rls_file(tmp_path: Path) -> None:
    path = manifest_of(DOC).write(tmp_path)
    assert path == tmp_path / MANIFEST_FILENAME
    assert path.read_bytes() == rl_bytes(DOC)
    assert sorted(os.listdir(tmp_path)) == [MANIFEST_FILENAME]  # no temporary file left behind


def test_load_reads_rls_file_back_equal(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILENAME).write_bytes(rl_bytes(DOC))
    loaded = GymCheckpointManifest.load(tmp_path)
    assert loaded == manifest_of(DOC)
    assert loaded.to_dict() == DOC
    # each instance's episodes stay in the file's order
    assert loaded.instances["nemo_gym/replica-0"] == (Episode("grp3_g0_a0", 0), Episode("grp1_g0_a1", 2))
    assert GymCheckpointManifest.schema_version == SCHEMA_VERSION == 2
    # RL's file without indentation reads the same
    (tmp_path / MANIFEST_FILENAME).write_text(json.dumps(DOC))
    assert GymCheckpointManifest.load(str(tmp_path)) == loaded


def test_write_replaces_an_earlier_manifest(tmp_path: Path) -> None:
    manifest_of(DOC).write(tmp_path)
    later = dict(DOC, checkpoint_id="ckpt-000043")
    manifest_of(later).write(tmp_path)
    assert (tmp_path / MANIFEST_FILENAME).read_bytes() == rl_bytes(later)
    assert sorted(os.listdir(tmp_path)) == [MANIFEST_FILENAME]


def test_a_failed_write_leaves_the_earlier_manifest(tmp_path: Path) -> None:
    manifest_of(DOC).write(tmp_path)
    (tmp_path / f"{MANIFEST_FILENAME}.tmp").mkdir()  # the temporary file cannot be created
    with pytest.raises(OSError, match=r"gym_checkpoint\.json\.tmp"):
        manifest_of(dict(DOC, checkpoint_id="other")).write(tmp_path)
    assert (tmp_path / MANIFEST_FILENAME).read_bytes() == rl_bytes(DOC)


def test_write_into_a_missing_folder_fails_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        manifest_of(DOC).write(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


def test_load_of_a_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GymCheckpointManifest.load(tmp_path)


def test_a_manifest_pickles_and_knows_its_episodes() -> None:
    manifest = manifest_of(DOC)
    assert pickle.loads(pickle.dumps(manifest)) == manifest
    assert manifest.episodes() == (Episode("grp1_g0_a1", 2), Episode("grp3_g0_a0", 0))
    assert manifest.next_attempts() == {
        "nemo_gym/replica-0": (Episode("grp3_g0_a0", 1), Episode("grp1_g0_a1", 3)),
        "nemo_gym/replica-1": (),
    }


def test_from_commit_takes_each_instances_export_and_staging_keys() -> None:
    summaries = {
        "nemo_gym/replica-1": CommitSummary((), (), (), {}),
        "nemo_gym/replica-0": CommitSummary(
            (Episode("grp3_g0_a0", 0), Episode("grp1_g0_a1", 2)),
            ("tq/grp3/0", "tq/grp1/0"),
            (),
            {Episode("grp3_g0_a0", 0): ("tq/grp3/0",), Episode("grp1_g0_a1", 2): ("tq/grp1/0",)},
        ),
    }
    manifest = GymCheckpointManifest.from_commit("ckpt-000042", summaries)
    assert manifest.to_dict()["staging_keys"] == DOC["staging_keys"]
    assert set(manifest.episodes()) == set(manifest_of(DOC).episodes())


# ---------------------------------------------------------------------------------------------
# Construction refuses what the file may not hold
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("checkpoint_id", "instances", "staging_keys", "error", "words"),
    [
        ("", {"i": ()}, {"i": ()}, ValueError, "checkpoint_id must be a non-empty string"),
        ("c", {}, {}, ValueError, "at least one instance"),
        ("c", [("i", ())], {"i": ()}, TypeError, "must be mappings"),
        ("c", {"": ()}, {"": ()}, ValueError, "instance id must be a non-empty string"),
        ("c", {"i": (Episode("r", 0), Episode("r", 0))}, {"i": ()}, ValueError, "holds Episode.*twice"),
        (
            "c",
            {"i": ({"rollout_id": "r", "attempt": 0, "x": 1},)},
            {"i": ()},
            ValueError,
            "exactly rollout_id",
        ),
        ("c", {"i": (), "j": ()}, {"i": ()}, ValueError, r"missing \['j'\]"),
        ("c", {"i": ()}, {"i": (), "k": ()}, ValueError, r"not an instance \['k'\]"),
        ("c", {"i": ()}, {"i": ("b", "a")}, ValueError, "is not sorted"),
        ("c", {"i": ()}, {"i": ("a", "a")}, ValueError, "holds a key twice"),
        ("c", {"i": ()}, {"i": ("",)}, ValueError, "holds an empty key"),
        ("c", {"i": ()}, {"i": (1,)}, TypeError, "must hold strings"),
    ],
)
def test_a_manifest_refuses(
    checkpoint_id: Any, instances: Any, staging_keys: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        GymCheckpointManifest(checkpoint_id, instances, staging_keys)


# ---------------------------------------------------------------------------------------------
# Loading refuses every malformed file
# ---------------------------------------------------------------------------------------------


def _set(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        target: Any = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.pop(key) and None


R0 = "nemo_gym/replica-0"
MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown top-level field", _set("participants", value={}), r"participants: unknown key"),
    ("missing checkpoint_id", _drop("checkpoint_id"), r"checkpoint_id: required"),
    ("missing staging_keys", _drop("staging_keys"), r"staging_keys: required"),
    ("schema 1", _set("schema_version", value=1), r"unsupported schema_version 1"),
    ("schema 3", _set("schema_version", value=3), r"unsupported schema_version 3"),
    ("schema as text", _set("schema_version", value="2"), r"schema_version: must be a whole number"),
    ("schema as a float", _set("schema_version", value=2.0), r"schema_version: must be a whole number"),
    ("schema as a bool", _set("schema_version", value=True), r"schema_version: must be a whole number"),
    ("empty checkpoint_id", _set("checkpoint_id", value=""), r"checkpoint_id must be a non-empty string"),
    ("checkpoint_id a number", _set("checkpoint_id", value=42), r"checkpoint_id: must be text"),
    ("instances a list", _set("instances", value=[]), r"instances: must be a mapping"),
    ("no instance", _set("instances", value={}), r"at least one instance"),
    (
        "episodes not a list",
        _set("instances", R0, value={}),
        r"instances\.nemo_gym/replica-0: must be a list",
    ),
    ("an episode not an object", _set("instances", R0, 0, value=["r", 0]), r"\[0\]: must be"),
    ("an episode with an extra field", _set("instances", R0, 0, "gen", value=1), r"\[0\]\.gen: unknown key"),
    (
        "an episode without attempt",
        lambda d: d["instances"][R0][1].pop("attempt") and None,
        r"\[1\]\.attempt: required",
    ),
    (
        "an empty rollout_id",
        _set("instances", R0, 0, "rollout_id", value=""),
        r"rollout_id: must be at least 1",
    ),
    ("a negative attempt", _set("instances", R0, 0, "attempt", value=-1), r"attempt: must be at least 0"),
    ("a bool attempt", _set("instances", R0, 0, "attempt", value=True), r"attempt: must be a whole number"),
    (
        "a fractional attempt",
        _set("instances", R0, 0, "attempt", value=1.5),
        r"attempt: must be a whole number",
    ),
    (
        "a duplicate episode",
        lambda d: d["instances"][R0].append(dict(d["instances"][R0][0])),
        r"instances\['nemo_gym/replica-0'\] holds Episode\(rollout_id='grp3_g0_a0', attempt=0\) twice",
    ),
    (
        "staging_keys of another instance",
        _set("staging_keys", "nemo_gym/replica-9", value=[]),
        r"not an instance",
    ),
    (
        "staging_keys missing an instance",
        lambda d: d["staging_keys"].pop(R0) and None,
        r"missing \['nemo_gym/replica-0'\]",
    ),
    ("unsorted staging keys", _set("staging_keys", R0, value=["tq/b", "tq/a"]), r"is not sorted"),
    ("a repeated staging key", _set("staging_keys", R0, value=["tq/a", "tq/a"]), r"holds a key twice"),
    ("an empty staging key", _set("staging_keys", R0, value=["", "tq/a"]), r"holds an empty key"),
    ("staging keys not a list", _set("staging_keys", R0, value="tq/a"), r"must be a list"),
    ("a staging key not text", _set("staging_keys", R0, value=[1]), r"\[0\]: must be text"),
]


@pytest.mark.parametrize(("what", "change", "words"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_load_refuses_a_malformed_manifest(
    tmp_path: Path, what: str, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    doc = copy.deepcopy(DOC)
    change(doc)
    path = tmp_path / MANIFEST_FILENAME
    path.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
    with pytest.raises(ValueError, match=words) as caught:
        GymCheckpointManifest.load(tmp_path)
    assert str(caught.value).startswith(f"{path}: "), what


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"[]", "a Gym checkpoint manifest is a JSON object, not list"),
        (b'{"checkpoint_id": "a",', "not valid JSON"),
        (
            b'{"checkpoint_id": "a", "checkpoint_id": "b"}',
            "not valid JSON: the key 'checkpoint_id' appears twice",
        ),
        (b'{"checkpoint_id": "\xff"}', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_load_refuses_what_is_no_manifest_at_all(tmp_path: Path, content: bytes, words: str) -> None:
    path = tmp_path / MANIFEST_FILENAME
    path.write_bytes(content)
    with pytest.raises(ValueError, match=words) as caught:
        GymCheckpointManifest.load(tmp_path)
    assert str(caught.value).startswith(f"{path}: ")


# ---------------------------------------------------------------------------------------------
# Property: write → load is the identity, and the bytes are RL's
# ---------------------------------------------------------------------------------------------

_ids = st.text(min_size=1, max_size=16)
_episodes = st.lists(
    st.builds(Episode, _ids, st.integers(min_value=0, max_value=2**40)),
    unique_by=lambda e: (e.rollout_id, e.attempt),
    max_size=6,
)
_keys = st.lists(st.text(min_size=1, max_size=12), unique=True, max_size=6).map(sorted)
_manifests = st.builds(
    lambda checkpoint_id, instances: GymCheckpointManifest(
        checkpoint_id,
        {i: tuple(eps) for i, (eps, _) in instances.items()},
        {i: tuple(keys) for i, (_, keys) in instances.items()},
    ),
    _ids,
    st.dictionaries(_ids, st.tuples(_episodes, _keys), min_size=1, max_size=4),
)


@settings(max_examples=60, deadline=None)
@given(_manifests)
def test_write_then_load_is_the_identity(manifest: GymCheckpointManifest) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = manifest.write(folder)
        assert path.read_bytes() == rl_bytes(manifest.to_dict())
        loaded = GymCheckpointManifest.load(folder)
    assert loaded == manifest
    assert loaded.to_dict() == manifest.to_dict()
    assert pickle.loads(pickle.dumps(loaded)) == manifest
