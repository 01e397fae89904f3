"""The command line on Gym's unified plane (v2): real `quiesce` processes against real v2 reference
servers (`tools/gymsim/v2`: environment, policy model, agent, resources) with paced episodes in flight.

- `checkpoint --episodes FILE` and `--episodes -` (standard input) commit that scope: `--json`
  carries `plane`, `scope`, `restarts`, `exported`, `stop`; piped, stdout keeps its one `published`
  line and the v2 outcome goes to stderr;
- a bad episodes file is exit 2 naming the line, before the ledger is opened or a server asked;
- `checkpoint --stop` publishes and leaves every server paused: `status` shows each held by the
  stop-checkpoint (plane, lease left, blockers) and says the way on; a restore into fresh servers
  lists the attempts to start, and the rollouts finish as if never interrupted;
- `retire` then `forget`: callers first, every server marks then unmarks the rollouts; a retired
  attempt is refused until forgotten; retire while the servers hold a checkpoint fails naming it;
- on a v1 cluster `retire`, `forget`, `--episodes` and `--stop` are bad usage (exit 2), nothing sent;
- `discover` and `status` show each server's plane; `show` says the attempt's.
The episodes-file and `ROLLOUT[:ATTEMPT]` parsing is tested in-process too (no server).
"""

from __future__ import annotations

import functools
import io
import json
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest

from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.cli.episodes import episode_arg, read_episodes
from quiesce.tools.cli.flags import UsageError
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import SpecLike, default_v2_spec
from quiesce.tools.gymsim.v2.drive import Control
from quiesce.tools.gymsim.v2.trainer import Trainer, expected_results, make_tasks
from tests.cli.helpers import json_of, quiesce

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

ROLLOUTS = ["r0", "r1", "r2"]
SERVERS = ["environment", "policy_model", "agent", "resources"]


@pytest.fixture
def v2_cluster(
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]],
) -> Iterator[RunningCluster]:
    with make_cluster(default_v2_spec()) as running:
        yield running


@pytest.fixture
def v2_config(v2_cluster: RunningCluster, tmp_path: Path) -> Path:
    path: Path = v2_cluster.write_config(tmp_path / "cluster.yaml", "sqlite+aiosqlite:///q.db", "snaps")
    return path


async def run(*argv: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`quiesce ARGV` in a thread, so the trainer's episodes go on meanwhile."""
    return await anyio.to_thread.run_sync(functools.partial(quiesce, *argv, cwd=cwd, stdin=stdin))


@asynccontextmanager
async def in_flight(cluster: RunningCluster, count: int = 3) -> AsyncIterator[Trainer]:
    """`count` paced episodes, each parked at its first boundary (one turn done, none mid-turn)."""
    async with Trainer(cluster.urls["environment"]) as trainer:
        await trainer.start(make_tasks(count), paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        yield trainer


def lines(episodes: list[EpisodeId]) -> str:
    return "".join(json.dumps(e.model_dump()) + "\n" for e in episodes)


async def statuses(cluster: RunningCluster, token: str) -> dict[str, dict[str, Any]]:
    """Every server's unified-plane status, read raw."""
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        control = Control(cluster.urls, token=token, http=http)
        return {name: await control.status(name) for name in cluster.urls}


def one_line(text: str) -> str:
    return " ".join(text.split())


# -- parsing (in-process) ---------------------------------------------------------------------


def test_episode_files_are_json_lines_checked_line_by_line(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"rollout_id": "r0"}\n\n{"rollout_id": "r1", "attempt": 2}\n')
    assert read_episodes(str(good)) == [EpisodeId(rollout_id="r0"), EpisodeId(rollout_id="r1", attempt=2)]
    cases = {
        '{"rollout_id": "r0"}\nnot json\n': "line 2: not JSON",
        '{"rollout_id": "r0", "attempt": -1}\n': "line 1: attempt: must be at least 0",
        '{"rollout_id": "r0", "extra": 1}\n': "line 1: extra: unknown key",
        '{"rollout_id": "r0-a1"}\n': "line 1: rollout_id:",
        '{"rollout_id": "r0", "attempt": "1"}\n': "line 1: attempt: must be a whole number",
        '["r0"]\n': "line 1:",
    }
    for text, said in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(UsageError) as refused:
            read_episodes(str(bad))
        assert said in str(refused.value), (text, str(refused.value))
        assert refused.value.exit_code == 2
        assert refused.value.code == "episodes"
    with pytest.raises(UsageError, match="cannot read it"):
        read_episodes(str(tmp_path / "missing.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"rollout_id": "r\xe9"}\n')
    with pytest.raises(UsageError, match="not UTF-8"):
        read_episodes(str(tmp_path / "latin1.jsonl"))


def test_standard_input_is_read_for_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('{"rollout_id": "r3", "attempt": 1}\n'))
    assert read_episodes("-") == [EpisodeId(rollout_id="r3", attempt=1)]


def test_rollout_attempt_arguments() -> None:
    assert episode_arg("r0") == EpisodeId(rollout_id="r0")
    assert episode_arg("r0:2") == EpisodeId(rollout_id="r0", attempt=2)
    for text, said in {
        "r0:x": "must be a whole number",
        "r0:-1": "attempt: must be at least 0",
        ":1": "rollout_id",
        "r 0": "must match the pattern",
        "r0-a1": "write r0:1",
    }.items():
        with pytest.raises(UsageError, match=said):
            episode_arg(text)


# -- checkpoint -------------------------------------------------------------------------------


async def test_checkpoint_with_an_episodes_file_and_from_standard_input(
    v2_cluster: RunningCluster, v2_config: Path, tmp_path: Path
) -> None:
    config = ("--config", str(v2_config))
    async with in_flight(v2_cluster) as trainer:
        scope = trainer.in_flight()
        (tmp_path / "episodes.jsonl").write_text(lines(scope))
        done = await run("checkpoint", *config, "--episodes", "episodes.jsonl", "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        document = json_of(done)
        assert document["outcome"] == "published"
        assert (document["plane"], document["scope"], document["restarts"], document["stop"]) == (
            "v2",
            ROLLOUTS,
            {},
            False,
        )
        assert document["exported"] == {server: ROLLOUTS for server in SERVERS}
        assert (tmp_path / "snaps" / document["checkpoint_id"] / "manifest.json").is_file()

        piped = await run("checkpoint", *config, "--episodes", "-", cwd=tmp_path, stdin=lines(scope))
        assert piped.returncode == 0, piped.stderr
        assert piped.stdout.startswith("published "), piped.stdout
        assert piped.stdout.count("\n") == 1, piped.stdout
        told = one_line(piped.stderr)
        assert "scope: 3 episodes (r0, r1, r2)" in told
        assert "restarts: none" in told
        assert "exported: environment 3, policy_model 3, agent 3, resources 3" in told
        assert "stop:" not in told
        # the servers run on: the episodes finish as if never paused
        await trainer.unpace()
        assert await trainer.wait_results() == expected_results(trainer.tasks)


async def test_a_bad_episodes_file_names_its_line_and_sends_nothing(
    v2_cluster: RunningCluster, v2_config: Path, tmp_path: Path
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"rollout_id": "r0"}\n{"rollout_id": "r1", "attempt": -1}\n')
    done = await run("checkpoint", "--config", str(v2_config), "--episodes", "bad.jsonl", cwd=tmp_path)
    assert done.returncode == 2
    assert "line 2: attempt: must be at least 0" in one_line(done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    refused = json_of(
        await run(
            "checkpoint",
            "--config",
            str(v2_config),
            "--episodes",
            "-",
            "--json",
            cwd=tmp_path,
            stdin='{"rollout_id": "r0"}\n{"rollout": "r1"}\n',
        )
    )["error"]
    assert (refused["code"], refused["exit_code"], refused["line"]) == ("episodes", 2, 2)
    assert "standard input line 2" in refused["message"]
    # refused before the ledger was opened: no ledger, no attempt, every server idle and untouched
    assert not (tmp_path / "q.db").exists()
    status = json_of(await run("status", "--config", str(v2_config), "--json", cwd=tmp_path))
    assert status["idle"] is True


async def test_stop_leaves_the_servers_paused_and_a_restore_into_fresh_servers_goes_on(
    v2_cluster: RunningCluster,
    v2_config: Path,
    tmp_path: Path,
    token: str,
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]],
) -> None:
    config = ("--config", str(v2_config))
    async with in_flight(v2_cluster) as trainer:
        stopped = json_of(await run("checkpoint", *config, "--stop", "--json", cwd=tmp_path))
        assert (stopped["outcome"], stopped["stop"], stopped["scope"]) == ("published", True, ROLLOUTS)
        cid = stopped["checkpoint_id"]

        status = await run("status", *config, "--json", cwd=tmp_path)
        assert status.returncode == 1  # held
        document = json_of(status)
        assert [s["name"] for s in document["servers"]] == SERVERS
        for server in document["servers"]:
            assert (server["plane"], server["phase"], server["held_by"], server["holder_kind"]) == (
                "v2",
                "committed",
                cid,
                "save",
            ), server
            assert server["lease_expires_at"] is not None
            assert server["blocker_count"] == 0
        (holder,) = document["holders"]
        assert "stop-checkpoint" in holder["state"]
        assert "freshly started servers" in holder["state"]
        table = await run("status", *config, cwd=tmp_path)
        header = table.stdout.splitlines()[0]
        assert all(word in header for word in ("plane", "phase", "held by", "lease left", "blockers"))
        assert "deadline left" not in header  # v1's fence deadline: no column on an all-v2 cluster
        assert f"quiesce resume --config {v2_config} {cid}" in one_line(table.stdout)

        # a retire now: every server holds the checkpoint and says to resume first
        refused = await run("retire", *config, "r0", cwd=tmp_path)
        assert refused.returncode == 1
        assert "resume first" in refused.stderr  # refused before anything is sent
        assert "resume first" in one_line(refused.stderr)
        await trainer.detach()  # the old cluster is shut down with its episodes

    # the way on: a restore into freshly started servers, then the trainer starts the attempts listed
    with make_cluster(default_v2_spec()) as fresh:
        fresh_config = fresh.write_config(tmp_path / "fresh.yaml", "sqlite+aiosqlite:///q.db", "snaps")
        restored = await run("restore", "--config", str(fresh_config), "--snapshot", cid, cwd=tmp_path)
        assert restored.returncode == 0, restored.stderr
        words = one_line(restored.stdout)
        assert "start these attempts once resumed" in words
        assert [f"start: rollout {r} attempt 1 on environment" in words for r in ROLLOUTS] == [True] * 3
        resumed = await run("resume", "--config", str(fresh_config), cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        async with Trainer(fresh.urls["environment"]) as after:
            after.tasks = dict(trainer.tasks)
            after.attempts = dict(trainer.attempts)
            await after.continue_on(fresh.urls["environment"])
            assert await after.wait_results() == expected_results(trainer.tasks)


async def test_restarts_are_left_out_of_the_scope_and_named(
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]], tmp_path: Path
) -> None:
    spec = default_v2_spec().model_dump()
    for server in spec["servers"]:
        if server["kind"] == "agent":
            server["checkpoint_mode"] = "restart_only"  # every live session is a restart
    with make_cluster(spec) as restarting:
        config = (
            "--config",
            str(restarting.write_config(tmp_path / "c.yaml", "sqlite+aiosqlite:///q.db", "snaps")),
        )
        async with in_flight(restarting, 2):
            saved = json_of(await run("checkpoint", *config, "--json", cwd=tmp_path))
            assert (saved["outcome"], saved["scope"]) == ("published", [])
            assert saved["restarts"] == {"environment": ["r0", "r1"], "agent": ["r0", "r1"]}
            assert saved["exported"] == {key: [] for key in SERVERS}
            piped = await run("checkpoint", *config, cwd=tmp_path)
            assert piped.returncode == 0, piped.stderr
            told = one_line(piped.stderr)
            assert "scope: 0 episodes" in told
            assert (
                "left out as restarts (environment: 2, agent: 2): r0, r1 — the trainer starts them over"
                in told
            )


# -- retire and forget ------------------------------------------------------------------------


async def test_retire_then_forget(
    v2_cluster: RunningCluster, v2_config: Path, tmp_path: Path, token: str
) -> None:
    config = ("--config", str(v2_config))
    async with in_flight(v2_cluster) as trainer:
        (tmp_path / "retire.jsonl").write_text('{"rollout_id": "r1", "attempt": 0}\n')
        done = await run("retire", *config, "r0", "--episodes", "retire.jsonl", "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        retired = json_of(done)
        assert (retired["operation"], retired["outcome"], retired["items"], retired["failed"]) == (
            "retire",
            "retired",
            ["r0", "r1"],
            {},
        )
        # callers first: the environment, then the agent, then the model and resources together
        assert retired["servers"][:2] == ["environment", "agent"]
        assert set(retired["servers"][2:]) == {"policy_model", "resources"}
        assert {s["retired_rollouts"] for s in (await statuses(v2_cluster, token)).values()} == {2}
        await trainer.unpace()
        with pytest.raises(Exception, match="episodes without a result"):
            await trainer.wait_results()
        assert {r: trainer.failures[r][0] for r in ("r0", "r1")} == {"r0": 409, "r1": 409}
        assert trainer.results.keys() == {"r2"}  # the one not retired finished
        # a retired attempt is refused until its rollout is forgotten
        await trainer.start({"r0": trainer.tasks["r0"]}, paced=False)  # returns once its run ended
        assert trainer.failures["r0"][1]["error"]["code"] == "stale_attempt"

        forgot = await run("forget", *config, "r1", "r0", "r1", cwd=tmp_path)
        assert forgot.returncode == 0, forgot.stderr
        assert one_line(forgot.stdout).startswith("forgot r0, r1 on 4 servers")
        assert {s["retired_rollouts"] for s in (await statuses(v2_cluster, token)).values()} == {0}
        await trainer.start({r: trainer.tasks[r] for r in ("r0", "r1")}, paced=False)
        assert await trainer.wait_results() == expected_results(trainer.tasks)

    bad = await run("retire", *config, cwd=tmp_path)
    assert bad.returncode == 2
    assert "name at least one episode" in bad.stderr
    bad = await run("forget", *config, "r0:1", cwd=tmp_path)
    assert bad.returncode == 2
    assert "without an attempt" in bad.stderr


async def test_v1_cluster_refuses_the_unified_commands(config_file: Path, tmp_path: Path) -> None:
    config = ("--config", str(config_file))
    (tmp_path / "episodes.jsonl").write_text('{"rollout_id": "r0"}\n')
    for argv in (
        ("retire", *config, "r0"),
        ("forget", *config, "r0"),
        ("checkpoint", *config, "--stop"),
        ("checkpoint", *config, "--episodes", "episodes.jsonl"),
    ):
        done = await run(*argv, "--json", cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        error = json_of(done)["error"]
        assert error["code"] == "plane", error
        assert "control plane v1" in error["message"], error
    history = json_of(await run("history", *config, "--json", cwd=tmp_path))
    assert history == [] or all(row["kind"] != "save" for row in history)  # nothing was started
    discovered = json_of(await run("discover", *config, "--json", cwd=tmp_path))
    assert {p["plane"] for p in discovered["participants"]} == {"v1"}
    status = json_of(await run("status", *config, "--json", cwd=tmp_path))
    assert {s["plane"] for s in status["servers"]} == {"v1"}


# -- what the listings show --------------------------------------------------------------------


async def test_discover_status_and_show_name_the_plane(
    v2_cluster: RunningCluster, v2_config: Path, tmp_path: Path
) -> None:
    config = ("--config", str(v2_config))
    table = await run("discover", *config, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    rows = [[cell.strip() for cell in line.strip("│ ").split("│")] for line in table.stdout.splitlines()]
    assert {row[0]: row[1] for row in rows if row[0] in SERVERS} == {name: "v2" for name in SERVERS}
    assert "plane" in table.stdout
    jsonl = await run("discover", *config, "-o", "jsonl", cwd=tmp_path)
    listed = [json.loads(line) for line in jsonl.stdout.splitlines()]
    assert [(r["name"], r["plane"], r["component"]) for r in listed] == [
        ("environment", "v2", "environment"),
        ("policy_model", "v2", "model"),
        ("agent", "v2", "agent"),
        ("resources", "v2", "resources"),
    ]
    idle = await run("status", *config, "-o", "jsonl", cwd=tmp_path)
    assert idle.returncode == 0
    servers = [json.loads(line) for line in idle.stdout.splitlines()]
    assert [
        (s["plane"], s["kind"], s["phase"], s["lease_expires_at"], s["blocker_count"]) for s in servers
    ] == [("v2", kind, "idle", None, 0) for kind in ("environment", "model", "agent", "resources")]

    saved = json_of(await run("checkpoint", *config, "--json", cwd=tmp_path))
    assert saved["outcome"] == "published"
    assert saved["scope"] == []
    shown = await run("show", *config, saved["checkpoint_id"], cwd=tmp_path)
    assert "plane: v2 (Gym's unified checkpoint plane)" in shown.stdout
    assert json_of(await run("show", *config, "latest", "--json", cwd=tmp_path))["plane"] == "v2"


_BASH = """
source "$1"
complete_words() {
  COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
  _shtab_quiesce; echo "${COMPREPLY[*]}"
}
complete_words quiesce ret
complete_words quiesce forg
complete_words quiesce checkpoint --sto
complete_words quiesce checkpoint --epi
complete_words quiesce retire --dead
"""


def test_shell_completion_knows_the_unified_commands_and_flags(tmp_path: Path) -> None:
    done = quiesce("completion", "bash", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (tmp_path / "quiesce.bash").write_text(done.stdout)
    ran = subprocess.run(
        ["bash", "-c", _BASH, "bash", str(tmp_path / "quiesce.bash")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["retire", "forget", "--stop", "--episodes", "--deadline-s"]
