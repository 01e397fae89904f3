"""Signals to a running `quiesce checkpoint` / `quiesce restore`, through real processes against a
real reference cluster: SIGTERM, SIGHUP, or SIGINT twice while a prepare is in progress (the policy
model's drain poll held by a delay fault, every participant already paused) roll the attempt back
before the command exits — 143 (128 + SIGTERM's 15), 129 (128 + SIGHUP's 1), 130 (SIGINT) — with
one error line naming the signal and no traceback; every server is accepting again (read from the
servers themselves) and the ledger shows the attempt aborted (`quiesce history --json`, `quiesce
show --json`). A restore signalled in its restore phase is stopped and recorded, its servers left
paused as half-restored state must be, the line naming both ways out; a signal once a save is
publishing is held until its resume is done. On Gym's unified plane (v2) a signal while every
server holds the prepare rolls it back the same way.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.tools.gymsim.cluster import RunningCluster
from tests.cli.helpers import child_env, command, json_of, quiesce
from tests.cli.test_v2_commands import v2_cluster, v2_config
from tests.coordinator.helpers import clear_faults, server_states, set_faults
from tests.coordinator_v2.helpers import phases

__all__ = ["v2_cluster", "v2_config"]  # fixtures of the unified plane's cluster

PARTICIPANTS = ("policy_model", "simple_agent", "tools")
#: Generous: the machine is shared; nothing here measures wall-clock time.
WAIT_S = 120.0


def _states(cluster: RunningCluster) -> dict[str, tuple[str, str]]:
    async def go() -> dict[str, tuple[str, str]]:
        async with httpx.AsyncClient(timeout=30) as http:
            return await server_states(http, cluster)

    return anyio.run(go)


def _faults(cluster: RunningCluster, server: str, faults: list[dict[str, Any]]) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            await set_faults(http, cluster.urls[server], faults)

    anyio.run(go)


def _clear(cluster: RunningCluster) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            await clear_faults(http, cluster)

    anyio.run(go)


def _start(*argv: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command(*argv), cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_until_paused(cluster: RunningCluster, process: subprocess.Popen[str], phase: str) -> None:
    """Until every participant's fence is in `phase` (or beyond idle), the command still running."""
    give_up = time.monotonic() + WAIT_S
    while time.monotonic() < give_up:
        assert process.poll() is None, process.communicate()
        states = _states(cluster)
        if all(states[name][0] == phase for name in PARTICIPANTS):
            return
        time.sleep(0.1)
    raise AssertionError(f"the servers never all reached {phase}: {_states(cluster)}")


def _finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = process.communicate(timeout=WAIT_S)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def _assert_all_accepting(cluster: RunningCluster) -> None:
    states = _states(cluster)
    assert states == {name: ("idle", "accepting") for name in cluster.urls}, states


def _hold_the_drain(cluster: RunningCluster) -> None:
    # the prepare's last step polls the model's status until it drained: held here, after every
    # participant paused (the reply comes long after the command is gone)
    _faults(cluster, "policy_model", [{"kind": "delay", "path": "/model-admission/status", "seconds": 600}])


@pytest.mark.parametrize(
    ("signals", "code", "name"),
    [
        ((signal.SIGTERM,), 143, "SIGTERM"),
        ((signal.SIGHUP,), 129, "SIGHUP"),
        ((signal.SIGINT, signal.SIGINT), 130, "SIGINT"),
    ],
)
def test_a_signal_during_prepare_rolls_back_and_exits(
    config_file: Path, cluster: RunningCluster, tmp_path: Path, signals: tuple[int, ...], code: int, name: str
) -> None:
    _hold_the_drain(cluster)
    if len(signals) > 1:  # a slow rollback: the next signal arrives while it runs
        _faults(cluster, "tools", [{"kind": "delay", "path": "/resources-checkpoint/resume", "seconds": 3}])
    process = _start("checkpoint", "--config", str(config_file), "--deadline-s", "300", cwd=tmp_path)
    try:
        _wait_until_paused(cluster, process, "prepared")
        process.send_signal(signals[0])
        seen: list[str] = []
        if len(signals) > 1:
            assert process.stderr is not None
            for line in process.stderr:
                seen.append(line)
                if " rollback started" in line:
                    break
            for one in signals[1:]:
                process.send_signal(one)
        done = _finish(process)
        done.stderr = "".join(seen) + done.stderr
    finally:
        if process.poll() is None:
            process.kill()
        _clear(cluster)
    assert done.returncode == code, done.stderr
    line = _one_error_line(done)
    assert f"interrupted by {name} (exit {code})" in line, line
    assert "rolled back, nothing published" in line, line
    assert done.stdout == ""  # no `published` line
    _assert_all_accepting(cluster)
    history = json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=tmp_path))
    assert [row["outcome"] for row in history] == ["aborted"], history
    shown = json_of(quiesce("show", "latest", "--ledger", "q.db", "--json", cwd=tmp_path))
    assert shown["checkpoint_id"] == history[0]["checkpoint_id"]
    assert not (tmp_path / "snaps" / "LATEST").exists()
    if len(signals) > 1:
        assert "again: still stopping" in done.stderr


def test_json_names_the_signal_and_the_rollback(
    config_file: Path, cluster: RunningCluster, tmp_path: Path
) -> None:
    _hold_the_drain(cluster)
    process = _start(
        "checkpoint", "--config", str(config_file), "--deadline-s", "300", "--json", cwd=tmp_path
    )
    try:
        _wait_until_paused(cluster, process, "prepared")
        process.send_signal(signal.SIGTERM)
        done = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
        _clear(cluster)
    assert done.returncode == 143, done.stderr
    error = json_of(done)["error"]
    assert error["code"] == "interrupted"
    assert error["signal"] == "SIGTERM"
    assert error["exit_code"] == 143
    assert error["outcome"] == "aborted"
    assert sorted(error["resumed"]) == sorted(PARTICIPANTS)
    assert error["left_paused"] == []
    _assert_all_accepting(cluster)


def _signal_at(process: subprocess.Popen[str], marker: str, signum: int) -> list[str]:
    """Read the command's progress lines until one holds `marker`, then send `signum`; the lines read."""
    assert process.stderr is not None
    seen: list[str] = []
    for line in process.stderr:
        seen.append(line)
        if marker in line:
            process.send_signal(signum)
            return seen
    raise AssertionError(f"no {marker!r} line: {''.join(seen)}")


def test_a_signal_once_published_waits_for_the_resume(
    config_file: Path, cluster: RunningCluster, tmp_path: Path
) -> None:
    # the agent's resume answers late: the signal arrives while the published save resumes
    _faults(cluster, "simple_agent", [{"kind": "delay", "path": "/agent-checkpoint/resume", "seconds": 3}])
    process = _start("checkpoint", "--config", str(config_file), "--deadline-s", "300", cwd=tmp_path)
    try:
        seen = _signal_at(process, " resume started", signal.SIGTERM)
        done = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
        _clear(cluster)
    stderr = "".join(seen) + done.stderr
    assert done.returncode == 143, stderr
    assert "SIGTERM received: checkpoint" in stderr, stderr
    assert "resume are finished first" in stderr, stderr
    line = _one_error_line(subprocess.CompletedProcess(process.args, 143, done.stdout, stderr))
    assert "interrupted by SIGTERM (exit 143) once checkpoint" in line, line
    assert "was published at" in line, line
    assert "its resume was finished first" in line, line
    assert "resume done" in stderr, stderr
    _assert_all_accepting(cluster)
    history = json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=tmp_path))
    assert len(history) == 1, history
    assert history[0]["outcome"] != "aborted", history
    assert (tmp_path / "snaps" / "LATEST").exists()


def test_a_signal_during_a_restore_stops_it_and_names_the_ways_out(
    config_file: Path, cluster: RunningCluster, tmp_path: Path
) -> None:
    saved = quiesce("checkpoint", "--config", str(config_file), "--json", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    # the agent restores, then answers late: the policy model and the agent hold the restore
    _faults(
        cluster,
        "simple_agent",
        [{"kind": "delay", "path": "/agent-checkpoint/restore", "when": "after", "seconds": 600}],
    )
    process = _start("restore", "--config", str(config_file), "--resume", cwd=tmp_path)
    try:
        give_up = time.monotonic() + WAIT_S
        while _states(cluster)["simple_agent"][0] == "idle":
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < give_up
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        done = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
        _clear(cluster)
    assert done.returncode == 143, done.stderr
    line = _one_error_line(done)
    assert "interrupted by SIGTERM (exit 143): restore" in line, line
    assert "half-restored state must not run" in line, line
    assert "restore again" in line, line
    restore_id = json_of(quiesce("show", "latest", "--ledger", "q.db", "--json", cwd=tmp_path))[
        "checkpoint_id"
    ]
    assert f"quiesce resume --config {config_file} {restore_id}" in line, line
    history = json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=tmp_path))
    assert [row["outcome"] for row in history][-1] == "aborted", history
    # the way out the line names lets them go
    freed = quiesce("resume", "--config", str(config_file), restore_id, cwd=tmp_path)
    assert freed.returncode == 0, freed.stderr
    _assert_all_accepting(cluster)


def _v2_phases(cluster: RunningCluster, token: str) -> dict[str, str]:
    async def go() -> dict[str, str]:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            return await phases(http, cluster.urls, token)

    return anyio.run(go)


def test_a_signal_during_a_unified_plane_prepare_rolls_back(
    v2_config: Path, v2_cluster: RunningCluster, tmp_path: Path, token: str
) -> None:
    # the last stage prepares, then answers late: every server holds the save when the signal comes
    _faults(
        v2_cluster,
        "resources",
        [{"kind": "delay", "path": "/ng-control/v1/checkpoint/prepare", "when": "after", "seconds": 600}],
    )
    process = _start("checkpoint", "--config", str(v2_config), "--deadline-s", "300", cwd=tmp_path)
    try:
        give_up = time.monotonic() + WAIT_S
        while "idle" in _v2_phases(v2_cluster, token).values():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < give_up
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        done = _finish(process)
    finally:
        if process.poll() is None:
            process.kill()
        _clear(v2_cluster)
    assert done.returncode == 143, done.stderr
    line = _one_error_line(done)
    assert "interrupted by SIGTERM (exit 143): checkpoint" in line, line
    assert "rolled back, nothing published" in line, line
    assert set(_v2_phases(v2_cluster, token).values()) == {"idle"}
    history = json_of(quiesce("history", "--ledger", "q.db", "--json", cwd=tmp_path))
    assert [row["outcome"] for row in history] == ["aborted"], history
