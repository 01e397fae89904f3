"""The command line: `--json` shapes, exit codes 0/1/2, and `resume` / `abort` acting from the ledger."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.tools.cli.main import main
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import assert_all_accepting, assert_protocol_ok, server_states, set_faults

ROOT = Path(__file__).resolve().parents[2]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, (json.loads(out) if "--json" in argv and out.strip() else out)


@pytest.fixture
def config_file(cluster: Any, tmp_path: Path, token: str) -> Path:
    path: Path = cluster.write_config(
        tmp_path / "cluster.yaml", f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", "snaps"
    )
    return path


def _states(cluster: Any) -> dict[str, tuple[str, str]]:
    async def go() -> dict[str, tuple[str, str]]:
        async with httpx.AsyncClient() as http:
            return await server_states(http, cluster)

    return anyio.run(go)


def _all_accepting(cluster: Any) -> None:
    async def go() -> None:
        async with httpx.AsyncClient() as http:
            await assert_all_accepting(http, cluster)

    anyio.run(go)


def test_discover_json(capsys: pytest.CaptureFixture[str], config_file: Path) -> None:
    code, doc = _run(capsys, "discover", "--config", str(config_file), "--json")
    assert code == 0
    assert set(doc) == {"participants", "skipped", "refused", "warnings"}
    assert doc["participants"] == [
        {
            "name": "policy_model",
            "component": "responses_api_models",
            "checkpoint_mode": "export_restore",
            "instance_role": "policy",
            "plane": "v1",
        },
        {
            "name": "simple_agent",
            "component": "responses_api_agents",
            "checkpoint_mode": "export_restore",
            "instance_role": None,
            "plane": "v1",
        },
        {
            "name": "tools",
            "component": "resources_servers",
            "checkpoint_mode": "export_restore",
            "instance_role": None,
            "plane": "v1",
        },
    ]
    assert [s["name"] for s in doc["skipped"]] == ["judge", "math_agent"]
    assert all(set(s) == {"name", "reason"} for s in doc["skipped"])
    assert doc["refused"] == []
    assert doc["warnings"] == []


def test_checkpoint_restore_resume_history(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any, tmp_path: Path
) -> None:
    code, doc = _run(capsys, "checkpoint", "--config", str(config_file), "--json", "--deadline-s", "20")
    assert code == 0
    assert set(doc) == {
        "checkpoint_id",
        "outcome",
        "snapshot",
        "participants",
        "skipped",
        "plane",
        "scope",
        "restarts",
        "exported",
        "stop",
    }
    assert doc["plane"] == "v1"
    assert doc["outcome"] == "published"
    assert doc["participants"] == ["policy_model", "simple_agent", "tools"]
    assert Path(doc["snapshot"]) == tmp_path / "snaps" / doc["checkpoint_id"]
    saved = doc["checkpoint_id"]

    code, doc = _run(capsys, "restore", "--config", str(config_file), "--json")
    assert code == 0
    assert set(doc) == {
        "checkpoint_id",
        "outcome",
        "servers",
        "resubmit",
        "restart",
        "resubmit_unknown",
        "plane",
    }
    assert doc["plane"] == "v1"
    assert doc["outcome"] == "restored"
    assert doc["servers"] == ["policy_model", "simple_agent", "tools"]
    assert doc["resubmit"] == []  # no rollout was saved
    restored = doc["checkpoint_id"]
    assert _states(cluster)["simple_agent"][0] == "restored_paused"

    # a separate invocation (a new coordinator, a new epoch) finds the paused restore in the ledger
    code, doc = _run(capsys, "resume", "--config", str(config_file), "--json")
    assert code == 0
    assert doc == {
        "checkpoint_id": restored,
        "outcome": "resumed",
        "servers": ["tools", "policy_model", "simple_agent"],
    }
    _all_accepting(cluster)
    code, doc = _run(capsys, "resume", "--config", str(config_file), "--json")
    assert (code, doc) == (0, {"checkpoint_id": None, "outcome": "none", "servers": []})
    anyio.run(assert_protocol_ok, f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")

    code, rows = _run(capsys, "history", "--config", str(config_file), "--json")
    assert code == 0
    assert [(r["checkpoint_id"], r["kind"], r["outcome"]) for r in rows] == [
        (saved, "save", "published"),
        (restored, "restore", "resumed"),  # restored, then resumed by the separate `resume`
    ]
    code, text = _run(capsys, "history", "--ledger", f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")
    assert code == 0
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 3  # header + one line per attempt
    assert saved in lines[1]
    assert restored in lines[2]


def _start_rollouts(agent: str, rollouts: dict[str, int]) -> None:
    """Start `rollouts` (id → turns) on `agent` and wait until each ran a turn."""

    async def start() -> None:
        async with httpx.AsyncClient() as http:
            await client.start_rollouts(http, agent, rollouts)
            await client.wait_turns(http, agent, 1)

    anyio.run(start)


def test_restore_says_what_to_send_again(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any, make_cluster: Any, tmp_path: Path
) -> None:
    _start_rollouts(cluster.urls["simple_agent"], {"r1": 100_000, "r0": 100_000})
    code, doc = _run(capsys, "checkpoint", "--config", str(config_file), "--json", "--deadline-s", "20")
    assert code == 0, doc
    ledger = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    with make_cluster(None) as fresh:  # a restore goes into fresh servers
        config = str(fresh.write_config(tmp_path / "fresh.yaml", ledger, "snaps"))
        code, text = _run(capsys, "restore", "--config", config)
        assert code == 0, text
        words = " ".join(text.split())  # rich may wrap
        assert [line.strip() for line in words.split("send again: ")[1:]] == [
            "rollout r0 as attempt 1 on simple_agent",
            "rollout r1 as attempt 1 on simple_agent",
        ]
        assert "2 restored rollouts run only when sent again (once resumed)" in words
        # a separate `resume` (another process) says it again: read from the restore's snapshot
        code, doc = _run(capsys, "resume", "--config", config, "--json")
        assert (code, doc["outcome"]) == (0, "resumed")
        assert [(r["rollout_id"], r["attempt_index"]) for r in doc["resubmit"]] == [("r0", 1), ("r1", 1)]
    with make_cluster(None) as fresh:
        config = str(fresh.write_config(tmp_path / "fresh.yaml", ledger, "snaps"))
        code, doc = _run(capsys, "restore", "--config", config, "--json", "--resume")
        assert code == 0, doc
        assert doc["outcome"] == "resumed"
        assert doc["resubmit"] == [
            {"server": "simple_agent", "rollout_id": "r0", "attempt_index": 1},
            {"server": "simple_agent", "rollout_id": "r1", "attempt_index": 1},
        ]


def test_resume_says_which_restarted_servers_it_restored_again(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any, make_cluster: Any, tmp_path: Path
) -> None:
    _start_rollouts(cluster.urls["simple_agent"], {"r0": 100_000})
    code, doc = _run(capsys, "checkpoint", "--config", str(config_file), "--json", "--deadline-s", "20")
    assert code == 0, doc
    ledger = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    with make_cluster(None) as fresh:
        config = str(fresh.write_config(tmp_path / "fresh.yaml", ledger, "snaps"))
        code, text = _run(capsys, "restore", "--config", config)
        assert code == 0, text

        async def restart() -> None:
            async with httpx.AsyncClient() as http:
                await client.restart(http, fresh.urls["simple_agent"])

        anyio.run(restart)
        code, text = _run(capsys, "resume", "--config", config)
        assert code == 0, text
        words = " ".join(text.split())  # rich may wrap
        assert "restored again before the resume (restarted since the restore" in words
        assert words.split("they held none of its state): ")[1].startswith("simple_agent send again:")
        assert "send again: rollout r0 as attempt 1 on simple_agent" in words
        assert _states(fresh)["simple_agent"] == ("idle", "accepting")


def test_checkpoint_failure_json(capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any) -> None:
    async def arm() -> None:
        async with httpx.AsyncClient() as http:
            await set_faults(
                http,
                cluster.urls["tools"],
                [
                    {
                        "kind": "fail",
                        "path": "/resources-checkpoint/commit",
                        "status": 500,
                        "code": "disk_full",
                    }
                ],
            )

    anyio.run(arm)
    code, doc = _run(capsys, "checkpoint", "--config", str(config_file), "--json")
    assert code == 1
    assert set(doc) == {
        "checkpoint_id",
        "outcome",
        "snapshot",
        "participants",
        "skipped",
        "plane",
        "scope",
        "restarts",
        "exported",
        "stop",
        "error",
        "resumed",
        "not_resumed",
    }
    assert doc["outcome"] == "aborted"
    assert doc["snapshot"] is None
    assert set(doc["error"]) == {"phase", "server", "code", "message"}
    assert (doc["error"]["phase"], doc["error"]["server"], doc["error"]["code"]) == (
        "commit",
        "tools",
        "disk_full",
    )
    assert doc["resumed"] == ["tools", "policy_model", "simple_agent"]
    assert doc["not_resumed"] == []
    _all_accepting(cluster)


def test_abort_from_another_process(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any, token: str
) -> None:
    async def prepare_and_vanish() -> str:
        async with Coordinator.open(config_file) as coord:
            attempt = await coord.prepare(deadline_s=20)
            await coord.commit()
            return attempt.checkpoint_id  # the coordinator goes away with everything paused

    checkpoint_id = anyio.run(prepare_and_vanish)
    assert _states(cluster)["policy_model"] == ("committed_paused", "paused")
    code, doc = _run(capsys, "abort", "--config", str(config_file), "--json")
    assert code == 0
    if doc["outcome"] != "none":  # else the new coordinator's recovery on open rolled it back first
        assert doc == {
            "checkpoint_id": checkpoint_id,
            "outcome": "aborted",
            "servers": ["tools", "policy_model", "simple_agent"],
        }
    _all_accepting(cluster)
    code, doc = _run(capsys, "abort", "--config", str(config_file), "--json")
    assert doc["outcome"] == "none"
    code, rows = _run(capsys, "history", "--config", str(config_file), "--json")
    assert [r["outcome"] for r in rows] == ["aborted"]
    anyio.run(assert_protocol_ok, f"sqlite+aiosqlite:///{config_file.parent / 'q.db'}")


def test_config_error_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "servers:\n  - {name: policy_model, url: 'http://127.0.0.1:1'}\n  - {name: x, url: 'ftp://nope'}\n"
    )
    code = main(["checkpoint", "--config", str(bad)])
    assert code == 2
    err = capsys.readouterr().err
    assert "servers[1].url" in err
    assert str(bad) in err


def test_refused_discovery_exits_2(
    capsys: pytest.CaptureFixture[str], cluster: Any, tmp_path: Path, token: str
) -> None:
    config = cluster.config(f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", "snaps")
    config["servers"].append({"name": "ghost", "url": "http://127.0.0.1:9"})
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config))
    code, doc = _run(capsys, "discover", "--config", str(path), "--json")
    assert code == 2
    assert [r["name"] for r in doc["refused"]] == ["ghost"]
    assert "cannot be reached" in doc["refused"][0]["reason"]
    code = main(["checkpoint", "--config", str(path)])
    assert code == 2
    assert "ghost" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_quiesce_demo_exits_0(tmp_path: Path) -> None:
    """README's main job exactly: `quiesce demo` with no arguments, in a fresh folder."""
    result = subprocess.run(
        [sys.executable, "-m", "quiesce", "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "finished exactly as the uninterrupted run" in result.stdout
    assert (tmp_path / ".quiesce-demo" / "ledger.db").is_file()


def test_acknowledge_on_a_later_gym_agent_sends_the_receipts(
    capsys: pytest.CaptureFixture[str], make_cluster: Any, tmp_path: Path
) -> None:
    spec: dict[str, Any] = {
        "servers": [
            {"kind": "model", "name": "policy_model"},
            {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "acknowledgement": "receipt"},
        ]
    }
    with make_cluster(spec) as running:
        agent = running.urls["simple_agent"]

        async def finish() -> None:
            async with httpx.AsyncClient() as http:
                await client.start_rollouts(http, agent, {"d0": 1})
                await client.wait_finished(http, agent, expect=1)

        anyio.run(finish)
        config = str(
            running.write_config(tmp_path / "c.yaml", f"sqlite+aiosqlite:///{tmp_path / 'q.db'}", "s")
        )
        code, doc = _run(capsys, "acknowledge", "--config", config, "simple_agent", "d0:0", "--json")
        assert (code, doc["outcome"], doc["acknowledged"]) == (
            0,
            "acknowledged",
            [{"rollout_id": "d0", "attempt_index": 0}],
        )
        # released: later Gym keeps no receipt of it, so a repeat cannot name it, and says why
        code, doc = _run(capsys, "acknowledge", "--config", config, "simple_agent", "d0:0", "--json")
        assert (code, doc["outcome"]) == (1, "failed")
        assert "already acknowledged" in doc["error"]["message"]


def test_acknowledge_releases_held_results_and_maps_its_exit_codes(
    capsys: pytest.CaptureFixture[str], config_file: Path, cluster: Any
) -> None:
    agent = cluster.urls["simple_agent"]

    async def finish() -> None:
        async with httpx.AsyncClient() as http:
            await client.start_rollouts(http, agent, {"d0": 1, "d1": 1})
            await client.wait_finished(http, agent, expect=2)

    anyio.run(finish)
    config = str(config_file)
    # bad usage: a malformed execution (argparse), an unknown server, a server without the feature
    with pytest.raises(SystemExit) as usage:
        main(["acknowledge", "--config", config, "simple_agent", "d0"])
    assert usage.value.code == 2
    assert "is not ROLLOUT_ID:ATTEMPT_INDEX" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["acknowledge", "--config", config, "nobody", "d0:0"]) == 2
    assert "no server 'nobody'" in capsys.readouterr().err
    assert _run(capsys, "acknowledge", "--config", config, "math_agent", "d0:0")[0] == 2
    assert _run(capsys, "acknowledge", "--config", config, "simple_agent", "d0:0", "d0:0")[0] == 2
    # refused by the agent: nothing is assumed released
    code, doc = _run(capsys, "acknowledge", "--config", config, "simple_agent", "d0:0", "never:0", "--json")
    assert code == 1
    assert (doc["outcome"], doc["acknowledged"]) == ("failed", [])
    assert (doc["error"]["status"], doc["error"]["code"]) == (
        409,
        "completed_execution_acknowledgement_error",
    )
    code, doc = _run(capsys, "acknowledge", "--config", config, "simple_agent", "d0:0", "d1:0", "--json")
    assert code == 0
    assert doc == {
        "server": "simple_agent",
        "acknowledged": [{"rollout_id": "d0", "attempt_index": 0}, {"rollout_id": "d1", "attempt_index": 0}],
        "outcome": "acknowledged",
    }
    code, text = _run(capsys, "acknowledge", "--config", config, "simple_agent", "d1:0")
    assert (code, text.strip()) == (0, "simple_agent: acknowledged d1:0")  # repeatable
    code, doc = _run(capsys, "checkpoint", "--config", config, "--json", "--deadline-s", "20")
    assert (code, doc["outcome"]) == (0, "published")  # nothing held any more
