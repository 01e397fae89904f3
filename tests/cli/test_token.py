"""The control token from the command line, against a real gymsim cluster, each command a real process.

Discovery and `status` read only capabilities, which Gym serves without a token: with no token
set they work (no Authorization header, nothing else sent). Every command that must send an
authenticated request says which variable to set (exit 2). A token that cannot be a bearer token
(a space, non-ASCII) is a config error from every command (exit 2), never a traceback, and the
value itself is never shown.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.cli.helpers import json_of, quiesce
from tests.coordinator.helpers import control_logs, read_events

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch, cluster: RunningCluster) -> None:
    """The cluster runs with its token; the commands run with none in their environment."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)


def _log(cluster: RunningCluster) -> dict[str, list[dict[str, object]]]:
    """Every control request each server received (method, path, whether it was authorized)."""
    with httpx.Client() as http:
        logs: dict[str, list[dict[str, object]]] = {}
        for name, url in cluster.urls.items():
            reply = http.get(f"{url}/gymsim/admin/control-log")
            reply.raise_for_status()
            logs[name] = reply.json()
    return logs


def _ledger(config_file: Path) -> str:
    return f"sqlite+aiosqlite:///{config_file.parent / 'q.db'}"


@pytest.mark.usefixtures("no_token")
def test_discover_without_a_token_lists_the_participants(config_file: Path, cluster: RunningCluster) -> None:
    done = quiesce("discover", "--config", str(config_file), "--json", cwd=config_file.parent)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    doc = json_of(done)
    names = {p["name"] for p in doc["participants"]}
    assert {"policy_model", "simple_agent", "tools"} <= names
    assert not doc["refused"]
    people = quiesce("discover", "--config", str(config_file), cwd=config_file.parent)
    assert people.returncode == 0, people.stderr
    assert "policy_model" in people.stdout
    assert "simple_agent" in people.stdout
    seen = [entry for entries in _log(cluster).values() for entry in entries]
    # read only: capabilities alone, and no token went with them (no Authorization header)
    assert seen
    assert {(e["method"], e["path"], e["authorized"]) for e in seen} == {
        ("GET", "/ng-control/v1/capabilities", False)
    }


@pytest.mark.anyio
@pytest.mark.usefixtures("no_token")
async def test_checkpoint_without_a_token_names_the_variable_and_sends_nothing(
    config_file: Path, cluster: RunningCluster
) -> None:
    done = quiesce("checkpoint", "--config", str(config_file), cwd=config_file.parent)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert TOKEN_ENV in done.stderr
    async with httpx.AsyncClient() as http:
        logs = await control_logs(http, cluster)
    assert all(not entries for entries in logs.values()), logs  # no server was asked anything
    assert not (config_file.parent / "q.db").exists()  # refused before the ledger was opened
    for verb in (
        ["acknowledge", "--config", str(config_file), "simple_agent", "r:0"],
        ["recover", "--config", str(config_file)],
    ):
        refused = quiesce(*verb, cwd=config_file.parent)
        assert refused.returncode == 2, (verb, refused.stderr)
        assert TOKEN_ENV in refused.stderr
        assert "Traceback" not in refused.stderr


@pytest.mark.anyio
@pytest.mark.usefixtures("no_token")
async def test_a_tokenless_discovery_records_no_attempt_and_status_reports_every_server(
    config_file: Path, cluster: RunningCluster
) -> None:
    assert quiesce("discover", "--config", str(config_file), cwd=config_file.parent).returncode == 0
    events = await read_events(_ledger(config_file))
    assert not [ev for ev in events if ev.kind.startswith(("attempt.", "recovery."))]
    sent = [ev.data["path"] for ev in events if ev.kind == "call.sent"]
    assert sent
    assert all(path.endswith("/capabilities") for path in sent)
    status = quiesce("status", "--config", str(config_file), "--json", cwd=config_file.parent)
    assert status.returncode == 0, status.stderr  # every server reachable and idle
    doc = json_of(status)
    assert {s["name"] for s in doc["servers"]} == set(cluster.urls)
    assert all(s["reachable"] and s["phase"] == "idle" for s in doc["servers"])


BAD_TOKENS = ["two secret words", "caf\u00e9-secret"]


@pytest.mark.parametrize("bad", BAD_TOKENS)
def test_a_token_that_cannot_be_a_bearer_token_is_a_config_error_from_every_command(
    config_file: Path, cluster: RunningCluster, bad: str
) -> None:
    env = {TOKEN_ENV: bad}
    url = next(iter(cluster.urls.values()))
    commands = [
        ["discover", "--config", str(config_file)],
        ["discover", "--config", str(config_file), "--json"],
        ["checkpoint", "--config", str(config_file)],
        ["status", "--config", str(config_file)],
        ["acknowledge", "--config", str(config_file), "simple_agent", "r:0"],
        ["resume", "--config", str(config_file)],
        ["abort", "--config", str(config_file)],
        ["recover", "--config", str(config_file)],
        ["restore", "--config", str(config_file)],
        ["conformance", url],
    ]
    for argv in commands:
        done = quiesce(*argv, cwd=config_file.parent, env=env)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr, (argv, done.stderr)
        told = json_of(done)["error"]["message"] if "--json" in argv else done.stderr
        assert TOKEN_ENV in told, (argv, done.stdout, done.stderr)
        assert bad not in done.stderr, argv
        assert bad not in done.stdout, argv
    assert _log(cluster) == {name: [] for name in cluster.urls}  # refused before any request
    assert not (config_file.parent / "q.db").exists()  # and before the ledger was opened
