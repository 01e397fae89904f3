"""`quiesce.rl.episodes`: every rule of the values the NeMo RL backend exchanges with RL holds on
construction, each can fail with a message naming the problem, and every value survives a pickle
round trip (Ray moves them between processes) equal to itself."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quiesce.coordinator.protocol_v2 import EpisodeId, episode_of_key
from quiesce.coordinator.protocol_v2 import ParticipantManifest as WireManifest
from quiesce.rl.episodes import (
    CommitSummary,
    Episode,
    FrozenMap,
    ParticipantCommitSummary,
    ParticipantManifest,
    PrepareSummary,
    RestoredRollouts,
    sorted_episodes,
)

SHA = "ab" * 32


def roundtrip(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value))


@dataclass(frozen=True)
class RLShapedEpisode:
    """An object of another library with the attributes of RL's `EnvironmentEpisode`."""

    rollout_id: str
    attempt: int


# ---------------------------------------------------------------------------------------------
# Episode
# ---------------------------------------------------------------------------------------------


def test_an_episode_names_its_capture_key_and_next_attempt() -> None:
    first = Episode("grp7_g0_a0", 0)
    assert first.capture_key == "grp7_g0_a0"
    assert first.next_attempt() == Episode("grp7_g0_a0", 1)
    assert first.next_attempt().capture_key == "grp7_g0_a0-a1"
    assert Episode("r", 12).capture_key == "r-a12"
    assert first.to_dict() == {"rollout_id": "grp7_g0_a0", "attempt": 0}


def test_episodes_order_by_rollout_then_attempt() -> None:
    episodes = [Episode("b", 0), Episode("a", 2), Episode("a", 1)]
    assert sorted(episodes) == [Episode("a", 1), Episode("a", 2), Episode("b", 0)]


@pytest.mark.parametrize(
    ("rollout_id", "attempt", "error", "words"),
    [
        ("", 0, ValueError, "rollout_id must not be empty"),
        (7, 0, TypeError, "rollout_id must be a string, not int"),
        (None, 0, TypeError, "rollout_id must be a string"),
        ("r", -1, ValueError, "attempt must be at least 0, not -1"),
        ("r", True, TypeError, "attempt must be an integer, not bool"),
        ("r", False, TypeError, "attempt must be an integer, not bool"),
        ("r", 1.0, TypeError, "attempt must be an integer, not float"),
        ("r", "1", TypeError, "attempt must be an integer, not str"),
    ],
)
def test_an_episode_refuses_what_rl_refuses(
    rollout_id: Any, attempt: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        Episode(rollout_id, attempt)


def test_an_episode_is_frozen() -> None:
    episode = Episode("r", 0)
    with pytest.raises(AttributeError):
        episode.attempt = 1  # type: ignore[misc]


def test_an_episode_converts_to_and_from_quiesces_episode_id() -> None:
    episode = Episode("grp_g1_a0", 3)
    episode_id = episode.to_episode_id()
    assert episode_id == EpisodeId(rollout_id="grp_g1_a0", attempt=3)
    assert episode_id.capture_key == episode.capture_key
    assert episode_of_key(episode.capture_key) == episode_id
    assert Episode.from_episode_id(episode_id) == episode
    assert Episode.from_episode_id(EpisodeId(rollout_id="x")) == Episode("x", 0)


@pytest.mark.parametrize("rollout_id", ["r-a3", "has space", "-leading-dash", "slash/inside"])
def test_an_rl_rollout_id_gym_cannot_carry_is_refused_on_conversion(rollout_id: str) -> None:
    episode = Episode(rollout_id, 0)  # RL's rules allow it
    with pytest.raises(ValueError, match="rollout_id"):
        episode.to_episode_id()


def test_coerce_takes_every_shape_rl_and_quiesce_hand_over() -> None:
    episode = Episode("r", 2)
    assert Episode.coerce(episode) is episode
    assert Episode.coerce(EpisodeId(rollout_id="r", attempt=2)) == episode
    assert Episode.coerce({"rollout_id": "r", "attempt": 2}) == episode
    assert Episode.coerce(RLShapedEpisode("r", 2)) == episode


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ({"rollout_id": "r"}, ValueError, "exactly rollout_id and attempt"),
        ({"rollout_id": "r", "attempt": 0, "x": 1}, ValueError, "exactly rollout_id and attempt"),
        ({"rollout_id": "", "attempt": 0}, ValueError, "must not be empty"),
        (RLShapedEpisode("r", -2), ValueError, "at least 0"),
        ("r", TypeError, "cannot read an episode from str"),
        (3, TypeError, "cannot read an episode from int"),
        (("r", 0), TypeError, "cannot read an episode from tuple"),
    ],
)
def test_coerce_refuses_what_is_not_an_episode(value: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        Episode.coerce(value)


def test_sorted_episodes_sorts_and_refuses_repeats_and_non_lists() -> None:
    mixed: list[object] = [{"rollout_id": "b", "attempt": 0}, Episode("a", 1), EpisodeId(rollout_id="a")]
    assert sorted_episodes(mixed) == (Episode("a", 0), Episode("a", 1), Episode("b", 0))
    with pytest.raises(ValueError, match="scope holds Episode"):
        sorted_episodes([Episode("a", 0), {"rollout_id": "a", "attempt": 0}], "scope")
    for bare in ("a", Episode("a", 0), {"rollout_id": "a", "attempt": 0}, 5):
        with pytest.raises(TypeError, match="must be a list of episodes"):
            sorted_episodes(bare)


@given(st.text(min_size=1), st.integers(min_value=0, max_value=2**70))
def test_an_episode_pickles_to_an_equal_one(rollout_id: str, attempt: int) -> None:
    episode = Episode(rollout_id, attempt)
    again = roundtrip(episode)
    assert again == episode
    assert hash(again) == hash(episode)
    assert again.capture_key == episode.capture_key


# ---------------------------------------------------------------------------------------------
# FrozenMap
# ---------------------------------------------------------------------------------------------


def test_a_frozen_map_is_an_immutable_mapping_that_pickles() -> None:
    frozen = FrozenMap({"b": (1,), "a": (2,)})
    assert frozen == {"b": (1,), "a": (2,)}
    assert list(frozen) == ["b", "a"]
    assert frozen != {"a": (2,)}
    assert frozen != [("a", (2,))]
    assert hash(frozen) == hash(FrozenMap([("a", (2,)), ("b", (1,))]))
    again = roundtrip(frozen)
    assert again == frozen
    assert type(again) is FrozenMap
    assert repr(frozen) == "FrozenMap({'b': (1,), 'a': (2,)})"
    with pytest.raises(TypeError):
        frozen["c"] = (3,)  # type: ignore[index]
    assert not hasattr(frozen, "__dict__")


# ---------------------------------------------------------------------------------------------
# PrepareSummary
# ---------------------------------------------------------------------------------------------


def test_a_prepare_summary_keeps_its_blockers_sorted_and_frozen() -> None:
    as_rl_sends_them: Any = {"env": ["r2", "r1-a1"], "agent": ()}  # lists, unsorted
    summary = PrepareSummary(False, as_rl_sends_them)
    assert summary.blockers == {"agent": (), "env": ("r1-a1", "r2")}
    assert isinstance(summary.blockers, FrozenMap)
    assert roundtrip(summary) == summary
    assert PrepareSummary(True, {}).prepared is True


@pytest.mark.parametrize(
    ("prepared", "blockers", "error", "words"),
    [
        (1, {}, TypeError, "prepared must be true or false"),
        (False, [("env", ["r"])], TypeError, "blockers must be a mapping"),
        (True, {"env": ["r"]}, ValueError, "a prepared deployment lists no blockers"),
        (False, {"": ["r"]}, ValueError, "server must not be empty"),
        (False, {"env": ["r", "r"]}, ValueError, "the blockers of env holds 'r' twice"),
        (False, {"env": [""]}, ValueError, "must not be empty"),
        (False, {"env": "r1"}, TypeError, "must be a list of strings"),
        (False, {"env": [3]}, TypeError, "must be a string"),
    ],
)
def test_a_prepare_summary_refuses(prepared: Any, blockers: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        PrepareSummary(prepared, blockers)


# ---------------------------------------------------------------------------------------------
# RestoredRollouts
# ---------------------------------------------------------------------------------------------


def restored(**changes: Any) -> RestoredRollouts:
    fields: dict[str, Any] = {
        "restore_id": "restore-2",
        "source_checkpoint_id": "ck-1",
        "episodes": (Episode("a", 1), Episode("b", 3), Episode("c", 1)),
        "by_instance": {
            "gym/replica-0": (Episode("b", 3), Episode("a", 1)),
            "gym/replica-1": (Episode("c", 1),),
        },
        "discarded": (Episode("d", 0),),
    }
    fields.update(changes)
    return RestoredRollouts(**fields)


def test_restored_rollouts_hold_the_continued_attempts_per_instance() -> None:
    value = restored()
    assert value.episodes == (Episode("a", 1), Episode("b", 3), Episode("c", 1))
    assert value.by_instance["gym/replica-0"] == (Episode("a", 1), Episode("b", 3))
    assert value.continued_from() == (Episode("a", 0), Episode("b", 2), Episode("c", 0))
    assert roundtrip(value) == value
    built = RestoredRollouts.of(
        "restore-2",
        "ck-1",
        {
            "gym/replica-1": [{"rollout_id": "c", "attempt": 1}],
            "gym/replica-0": [Episode("b", 3), Episode("a", 1)],
        },
        [RLShapedEpisode("d", 0)],
    )
    assert built == value
    assert list(built.by_instance) == ["gym/replica-0", "gym/replica-1"]


def test_restored_rollouts_sort_what_they_are_given() -> None:
    value = restored(episodes=(Episode("c", 1), Episode("a", 1), Episode("b", 3)))
    assert value.episodes == (Episode("a", 1), Episode("b", 3), Episode("c", 1))


def test_a_restore_that_continued_nothing_is_allowed() -> None:
    empty = RestoredRollouts.of("r2", "r1", {"gym/replica-0": []})
    assert empty.episodes == ()
    assert empty.continued_from() == ()


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"restore_id": ""}, ValueError, "restore_id must not be empty"),
        ({"source_checkpoint_id": None}, TypeError, "source_checkpoint_id must be a string"),
        ({"restore_id": "ck-1"}, ValueError, "an id of its own"),
        (
            {"episodes": (Episode("a", 0),), "by_instance": {"i": (Episode("a", 0),)}, "discarded": ()},
            ValueError,
            "cannot be continued",
        ),
        (
            {"episodes": (Episode("a", 1), Episode("a", 1)), "by_instance": {"i": (Episode("a", 1),)}},
            ValueError,
            "holds Episode.*twice",
        ),
        ({"by_instance": {"i": (Episode("a", 1), Episode("b", 3))}}, ValueError, "under no instance"),
        (
            {"by_instance": {"i": (Episode("a", 1), Episode("b", 3), Episode("c", 1), Episode("z", 1))}},
            ValueError,
            "under an instance but not continued",
        ),
        (
            {
                "by_instance": {
                    "i": (Episode("a", 1), Episode("b", 3)),
                    "j": (Episode("c", 1), Episode("a", 1)),
                }
            },
            ValueError,
            "under two instances",
        ),
        ({"by_instance": {"": restored().episodes}}, ValueError, "instance id must not be empty"),
        ({"by_instance": list(restored().by_instance.items())}, TypeError, "by_instance must be a mapping"),
        ({"discarded": (Episode("b", 2),)}, ValueError, r"both continued and discarded: \['b'\]"),
        ({"discarded": (Episode("d", 0), Episode("d", 0))}, ValueError, "discarded episodes holds"),
    ],
)
def test_restored_rollouts_refuse(changes: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        restored(**changes)


episodes_strategy = st.lists(
    st.builds(Episode, st.text(min_size=1, max_size=12), st.integers(min_value=1, max_value=50)),
    unique_by=lambda e: e.rollout_id,
    max_size=12,
)


@given(episodes_strategy, st.integers(min_value=1, max_value=4), st.data())
def test_restored_rollouts_pickle_to_equal_ones(
    episodes: list[Episode], instances: int, data: st.DataObject
) -> None:
    by_instance: dict[str, list[Episode]] = {f"gym/replica-{i}": [] for i in range(instances)}
    for episode in episodes:
        by_instance[f"gym/replica-{data.draw(st.integers(0, instances - 1))}"].append(episode)
    value = RestoredRollouts.of("restore-b", "save-a", by_instance)
    again = roundtrip(value)
    assert again == value
    assert hash(again) == hash(value)
    assert again.continued_from() == tuple(sorted(Episode(e.rollout_id, e.attempt - 1) for e in episodes))
    assert [e.next_attempt() for e in again.continued_from()] == list(again.episodes)


# ---------------------------------------------------------------------------------------------
# Commit summaries
# ---------------------------------------------------------------------------------------------


def manifest(**changes: Any) -> ParticipantManifest:
    fields: dict[str, Any] = {
        "schema_version": 1,
        "kind": "environment",
        "instance": "env",
        "checkpoint_id": "ck-1",
        "records_file": "records.jsonl",
        "records_sha256": SHA,
        "record_count": 2,
    }
    fields.update(changes)
    return ParticipantManifest(**fields)


def test_a_participant_manifest_reads_gyms_reply_and_file() -> None:
    wire = WireManifest.model_validate(
        {
            "schema_version": 1,
            "kind": "environment",
            "instance": "env",
            "checkpoint_id": "ck-1",
            "records_file": "records.jsonl",
            "records_sha256": SHA,
            "record_count": 2,
            "newer_gym_field": True,
        }
    )
    assert ParticipantManifest.from_gym(wire) == manifest()
    assert ParticipantManifest.from_gym(wire.model_dump()) == manifest()
    assert roundtrip(manifest()) == manifest()


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"schema_version": 0}, ValueError, "schema_version must be at least 1"),
        ({"schema_version": True}, TypeError, "schema_version must be an integer"),
        ({"kind": "trainer"}, ValueError, "kind must be one of"),
        ({"instance": ""}, ValueError, "instance must not be empty"),
        ({"checkpoint_id": 3}, TypeError, "checkpoint_id must be a string"),
        ({"records_file": ""}, ValueError, "records_file must not be empty"),
        ({"records_sha256": "AB" * 32}, ValueError, "64 lowercase hex digits"),
        ({"records_sha256": "ab"}, ValueError, "64 lowercase hex digits"),
        ({"record_count": -1}, ValueError, "record_count must be at least 0"),
    ],
)
def test_a_participant_manifest_refuses(changes: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        manifest(**changes)


def participant(**changes: Any) -> ParticipantCommitSummary:
    fields: dict[str, Any] = {
        "server_name": "env",
        "kind": "environment",
        "phase": "committed",
        "capture_keys": ("r2", "r1"),
        "manifest": manifest(),
    }
    fields.update(changes)
    return ParticipantCommitSummary(**fields)


def test_a_participant_summary_sorts_its_keys() -> None:
    summary = participant(staging_keys=["k2", "k1"])
    assert summary.capture_keys == ("r1", "r2")
    assert summary.staging_keys == ("k1", "k2")
    assert roundtrip(summary) == summary


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"server_name": ""}, ValueError, "server_name must not be empty"),
        ({"kind": "judge"}, ValueError, "kind must be one of"),
        ({"phase": "prepared"}, ValueError, "of a committed server, not 'prepared'"),
        ({"manifest": {"kind": "environment"}}, TypeError, "must be a ParticipantManifest"),
        ({"kind": "model"}, ValueError, "its manifest is of a environment server, not model"),
        ({"capture_keys": ("r1", "r1")}, ValueError, "capture keys of env holds 'r1' twice"),
        ({"staging_keys": ("",)}, ValueError, "must not be empty"),
    ],
)
def test_a_participant_summary_refuses(changes: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        participant(**changes)


def commit(**changes: Any) -> CommitSummary:
    model = participant(
        server_name="policy",
        kind="model",
        capture_keys=("r1",),
        manifest=manifest(kind="model", instance="policy"),
        staging_keys=("k1", "k2", "k3"),
    )
    fields: dict[str, Any] = {
        "exported_episodes": (Episode("r2", 0), Episode("r1", 0)),
        "staging_keys": ("k3", "k1", "k2"),
        "participants": (participant(), model),
        "staging_keys_by_episode": {Episode("r1", 0): ("k2", "k1"), EpisodeId(rollout_id="r2"): ("k3",)},
        "unowned_live_episodes": (Episode("u", 1),),
    }
    fields.update(changes)
    return CommitSummary(**fields)


def test_a_commit_summary_is_sorted_frozen_and_picklable() -> None:
    summary = commit()
    assert summary.exported_episodes == (Episode("r1", 0), Episode("r2", 0))
    assert summary.staging_keys == ("k1", "k2", "k3")
    assert [p.server_name for p in summary.participants] == ["env", "policy"]
    assert summary.staging_keys_by_episode == {Episode("r1", 0): ("k1", "k2"), Episode("r2", 0): ("k3",)}
    assert isinstance(summary.staging_keys_by_episode, FrozenMap)
    again = roundtrip(summary)
    assert again == summary
    assert hash(again) == hash(summary)
    empty = CommitSummary((), (), (), {})
    assert empty.unowned_live_episodes == ()


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"exported_episodes": (Episode("r1", 0), Episode("r1", 0))}, ValueError, "exported_episodes holds"),
        ({"staging_keys": ("k1", "k1", "k2", "k3")}, ValueError, "staging_keys holds 'k1' twice"),
        ({"staging_keys": ("k1", "k2")}, ValueError, r"unattributed \[\], not staging keys \['k3'\]"),
        ({"staging_keys": ("k1", "k2", "k3", "k4")}, ValueError, r"unattributed \['k4'\]"),
        ({"participants": (participant(), participant())}, ValueError, "participants holds"),
        ({"participants": ("env",)}, TypeError, "must be a ParticipantCommitSummary"),
        ({"staging_keys_by_episode": [(Episode("r1", 0), ("k1",))]}, TypeError, "must be a mapping"),
        (
            {
                "staging_keys_by_episode": {
                    Episode("r1", 0): ("k1", "k2"),
                    EpisodeId(rollout_id="r1"): ("k3",),
                }
            },
            ValueError,
            "names an episode twice",
        ),
        ({"unowned_live_episodes": (Episode("r2", 0),)}, ValueError, "both exported and unowned"),
    ],
)
def test_a_commit_summary_refuses(changes: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        commit(**changes)
