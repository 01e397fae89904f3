"""`quiesce config check` through the real CLI: offline checks, then every server with `--servers`.

A wrong Gym token is found here, by an authenticated read that changes nothing — not by a save
that then rolls back. Nothing is recorded: the ledger stays as it was (or absent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.cli.helpers import json_of, quiesce
from tests.conformance.fakegym import serve
from tests.coordinator.test_discovery import _v2_server


def _checks(done: Any) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in json_of(done)["checks"]}


def test_a_ready_config_passes_every_check(config_file: Path, cluster: RunningCluster, token: str) -> None:
    ledger = config_file.parent / "q.db"
    done = quiesce(
        "config", "check", "--config", str(config_file), "--servers", "--json", cwd=config_file.parent
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checks = _checks(done)
    assert {"install", "ledger", "snapshots", "token"} <= set(checks)
    assert set(checks) - {"install", "ledger", "snapshots", "token"} == set(cluster.urls)
    for name in cluster.urls:
        assert checks[name]["ok"] is True, checks[name]
        assert checks[name]["plane"] == "v1"
        assert "token is accepted" in checks[name]["detail"]
    assert checks["policy_model"]["role"] == "responses_api_models"
    assert checks["simple_agent"]["role"] == "responses_api_agents"
    assert checks["tools"]["role"] == "resources_servers"
    assert not ledger.exists()  # nothing recorded: the ledger is not even created
    assert token not in done.stdout + done.stderr
    # people's output: one row per check, and the verdict
    table = quiesce("config", "check", "--config", str(config_file), "--servers", cwd=config_file.parent)
    assert table.returncode == 0, table.stderr
    assert "every check passed" in table.stdout
    assert "FAILED" not in table.stdout


def test_a_wrong_token_is_found_without_a_save(config_file: Path, cluster: RunningCluster) -> None:
    wrong = {TOKEN_ENV: "not-the-servers-token-0123456789"}
    offline = quiesce(
        "config", "check", "--config", str(config_file), "--json", cwd=config_file.parent, env=wrong
    )
    assert offline.returncode == 0, offline.stdout  # offline, a token that is set is all one can tell
    done = quiesce(
        "config",
        "check",
        "--config",
        str(config_file),
        "--servers",
        "--json",
        cwd=config_file.parent,
        env=wrong,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    checks = _checks(done)
    for name in cluster.urls:
        assert checks[name]["ok"] is False
        assert "refused the control token (401)" in checks[name]["detail"]
        assert checks[name]["plane"] == "v1"  # reachable, and its plane known all the same
    assert "not-the-servers-token" not in done.stdout + done.stderr


def test_offline_problems_are_each_named_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "ledger: sqlite+aiosqlite:///missing-folder/q.db\n"
        "snapshots: no-parent/here/snaps\n"
        "servers:\n  - {name: policy_model, url: 'http://127.0.0.1:9'}\n",
        encoding="utf-8",
    )
    done = quiesce("config", "check", "--config", str(config), "--json", cwd=tmp_path, env={TOKEN_ENV: ""})
    assert done.returncode == 2, done.stdout + done.stderr
    checks = _checks(done)
    assert checks["install"]["ok"] is True
    assert checks["ledger"]["ok"] is False
    assert "missing-folder of the ledger file does not exist" in checks["ledger"]["detail"]
    assert checks["snapshots"]["ok"] is False
    assert "does not exist" in checks["snapshots"]["detail"]
    assert checks["token"]["ok"] is False
    assert TOKEN_ENV in checks["token"]["detail"]
    assert "policy_model" not in checks  # offline: no server asked
    assert not (tmp_path / "no-parent").exists()  # a missing parent is never created
    # an unreachable server is a server failure (exit 1) once the setup itself is sound
    (tmp_path / "missing-folder").mkdir()
    config.write_text(config.read_text().replace("no-parent/here/snaps", "snaps"), encoding="utf-8")
    unreachable = quiesce(
        "config",
        "check",
        "--config",
        str(config),
        "--servers",
        "--json",
        cwd=tmp_path,
        env={TOKEN_ENV: "t" * 20},
    )
    assert unreachable.returncode == 1, unreachable.stdout
    assert "could not connect" in _checks(unreachable)["policy_model"]["detail"]


def test_an_existing_ledger_at_an_old_schema_is_named(config_file: Path, cluster: RunningCluster) -> None:
    ledger = config_file.parent / "q.db"
    upgraded = quiesce("db", "upgrade", "--ledger", str(ledger), "--json", cwd=config_file.parent)
    assert upgraded.returncode == 0, upgraded.stderr
    fine = _checks(quiesce("config", "check", "--config", str(config_file), "--json", cwd=config_file.parent))
    assert fine["ledger"]["ok"] is True
    import sqlite3

    with sqlite3.connect(ledger) as conn:
        conn.execute("UPDATE quiesce_alembic_version SET version_num = '0001'")
    old = quiesce("config", "check", "--config", str(config_file), "--json", cwd=config_file.parent)
    assert old.returncode == 2, old.stdout
    assert "quiesce db upgrade" in _checks(old)["ledger"]["detail"]


def test_the_plane_of_each_server_is_named(config_file: Path, cluster: RunningCluster, token: str) -> None:
    with serve(_v2_server(token)) as v2, serve(FastAPI()) as blank:
        document = yaml.safe_load(config_file.read_text(encoding="utf-8"))
        document["servers"] += [{"name": "sandbox", "url": v2}, {"name": "blank", "url": blank}]
        config_file.write_text(yaml.safe_dump(document), encoding="utf-8")
        done = quiesce(
            "config", "check", "--config", str(config_file), "--servers", "--json", cwd=config_file.parent
        )
    assert done.returncode == 1, done.stdout + done.stderr
    checks = _checks(done)
    assert checks["sandbox"]["plane"] == "v2"
    assert checks["sandbox"]["role"] == "resources"
    assert checks["sandbox"]["ok"] is True  # its token is accepted
    assert checks["blank"]["ok"] is False
    assert "serves neither control plane" in checks["blank"]["detail"]
    assert checks["planes"]["ok"] is False
    assert "sandbox: v2" in checks["planes"]["detail"]
    assert "policy_model: v1" in checks["planes"]["detail"]
