"""`quiesce sim`: help for users, `--json`, the config present exactly while it runs, and
`quiesce-sim.yaml` ignored by git. Through the real CLI."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from quiesce.coordinator.protocol import TOKEN_ENV
from tests.cli.helpers import ROOT, child_env, command, quiesce

pytestmark = [pytest.mark.timeout(120)]


def test_sim_help_speaks_to_users(tmp_path: Path) -> None:
    done = quiesce("sim", "--help", cwd=tmp_path)
    assert done.returncode == 0
    text = done.stdout
    for what in (TOKEN_ENV, "quiesce-sim.yaml", "quiesce checkpoint --config quiesce-sim.yaml", "ready"):
        assert what in text, what
    for internal in ("quiesce.tools.gymsim", "python -m", "seed"):
        assert internal not in text, internal


def _start(tmp_path: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command("sim", "--json", *argv),
        cwd=tmp_path,
        env=child_env({TOKEN_ENV: "sim-test-token"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _ready(process: subprocess.Popen[str]) -> dict[str, object]:
    """The `--json` document, read as the sim prints it (its end is the closing brace line)."""
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if line.rstrip() == "}":
            break
    document: dict[str, object] = json.loads("".join(lines))
    return document


def test_sim_config_exists_while_it_runs(tmp_path: Path) -> None:
    process = _start(tmp_path)
    try:
        document = _ready(process)
        config = tmp_path / "quiesce-sim.yaml"
        assert document["config"] == str(config)
        assert document["token_set"] is True
        assert isinstance(document["servers"], dict)
        assert "policy_model" in document["servers"]
        assert config.is_file()
        assert "sim-test-token" not in config.read_text()
        discovered = quiesce(
            "discover",
            "--config",
            "quiesce-sim.yaml",
            "--json",
            cwd=tmp_path,
            env={TOKEN_ENV: "sim-test-token"},
        )
        assert discovered.returncode == 0, discovered.stderr
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not config.exists()
    assert process.stderr is not None
    log = process.stderr.read()
    assert f"removed {config}" in log
    assert "sim-test-token" not in log


def test_sim_leaves_a_config_someone_changed(tmp_path: Path) -> None:
    process = _start(tmp_path, "--config-out", "mine.yaml", "--ledger", "ledger.db")
    try:
        _ready(process)
        config = tmp_path / "mine.yaml"
        text = config.read_text()
        assert f"ledger: sqlite+aiosqlite:///{tmp_path / 'ledger.db'}" in text  # a file path, as everywhere
        config.write_text(text + "keep_latest: 5\n")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert config.read_text().endswith("keep_latest: 5\n")


def test_sim_config_is_ignored_by_git() -> None:
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "quiesce-sim.yaml", "sub/quiesce-sim.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.stdout.split() == ["quiesce-sim.yaml", "sub/quiesce-sim.yaml"]
