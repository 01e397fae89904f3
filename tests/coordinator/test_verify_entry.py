"""A committed participant's folder is checked before the next role group is called: a symlink on
the way down to it (at any depth) is refused and named; a real folder is checked file by file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from quiesce.coordinator.protocol import AGENT, agent_instance_dir, manifest_path
from quiesce.coordinator.save import _verify_entry


def _entry(staging: Path, name: str) -> dict[str, object]:
    rel = manifest_path(AGENT, name)
    path = staging / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"files": []}\n')
    return {"name": name, "manifest": rel, "manifest_digest": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_a_real_folder_with_its_manifest_passes(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    assert _verify_entry(staging, _entry(staging, "a1")) == []


@pytest.mark.parametrize("depth", [1, 2])
def test_a_symlink_on_the_way_to_the_folder_is_named(tmp_path: Path, depth: int) -> None:
    staging = tmp_path / "staging"
    elsewhere = tmp_path / "elsewhere"
    entry = _entry(elsewhere, "a1")  # the real files live outside the staging folder
    parts = agent_instance_dir("a1").split("/")
    linked = "/".join(parts[:depth])
    (staging / linked).parent.mkdir(parents=True, exist_ok=True)
    (staging / linked).symlink_to(elsewhere / linked, target_is_directory=True)
    problems = _verify_entry(staging, entry)
    assert problems == [f"a1: {linked} is a symlink, not a folder"]


def test_a_wrong_digest_and_an_odd_file_are_both_reported(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    entry = {**_entry(staging, "a1"), "manifest_digest": "0" * 64}
    folder = staging / agent_instance_dir("a1")
    (folder / "out").symlink_to(tmp_path)
    problems = _verify_entry(staging, entry)
    assert len(problems) == 2
    assert problems[0].startswith(f"a1: {agent_instance_dir('a1')}/out: a symlink")
    assert "does not match the sha256" in problems[1]
