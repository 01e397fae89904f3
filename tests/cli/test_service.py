"""`--service URL` (and `$QUIESCE_SERVICE`): the cluster commands drive a running `quiesce serve`
instead of opening the ledger it holds, with the same output; a command that finds the ledger held
by a service names the `--service` command that works. Real `quiesce serve` children, real CLI."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.pgtemp import TempPostgres
from quiesce.tools.serve.auth import API_TOKEN_ENV
from tests.cli.helpers import json_of, quiesce
from tests.serve.conftest import ServiceProcess

pytestmark = pytest.mark.timeout(300)


def test_a_held_ledger_names_the_service_and_every_command_works_through_it(
    config_file: Path, cluster: RunningCluster, tmp_path: Path, spawn_service: Callable[..., ServiceProcess]
) -> None:
    service = spawn_service(config_file)
    url = service.url
    config = ("--config", str(config_file))

    held = quiesce("resume", *config, "r-1", cwd=tmp_path)
    assert held.returncode == 1
    assert "already has a writer" in held.stderr
    assert f"It is the `quiesce serve` at {url}: rerun through it: quiesce resume --service {url} r-1" in (
        " ".join(held.stderr.split())
    )
    error = json_of(quiesce("checkpoint", *config, "--json", cwd=tmp_path))["error"]
    assert (error["code"], error["exit_code"], error["service"]) == ("fenced", 1, url)
    assert error["command"] == f"quiesce checkpoint --service {url} --json"
    recover = quiesce("recover", *config, cwd=tmp_path)
    assert recover.returncode == 1
    assert f"`quiesce status --service {url}`" in " ".join(recover.stderr.split())

    # the same commands through the service
    published = quiesce("checkpoint", "--service", url, cwd=tmp_path)
    assert published.returncode == 0, published.stderr
    match = re.fullmatch(r"published (\S+) -> (\S+)\n", published.stdout)
    assert match, published.stdout
    saved, path = match.groups()
    assert Path(path) == tmp_path / "snaps" / saved
    assert json_of(quiesce("status", "--service", url, "--json", cwd=tmp_path))["idle"] is True

    restored = json_of(quiesce("restore", "--service", url, "--snapshot", saved, "--json", cwd=tmp_path))
    assert restored["outcome"] == "restored", restored
    assert restored["servers"] == ["policy_model", "simple_agent", "tools"]
    paused = quiesce("status", "--service", url, "-o", "jsonl", cwd=tmp_path)
    assert paused.returncode == 1  # held by the restore
    assert restored["checkpoint_id"] in paused.stdout
    resumed = json_of(quiesce("resume", "--service", url, "--json", cwd=tmp_path))
    assert (resumed["checkpoint_id"], resumed["outcome"]) == (restored["checkpoint_id"], "resumed")
    nothing = json_of(quiesce("abort", "--service", url, "--json", cwd=tmp_path))
    assert nothing["outcome"] == "none"

    # $QUIESCE_SERVICE stands for --service when no --config is given
    found = quiesce("discover", "-o", "jsonl", cwd=tmp_path, env={"QUIESCE_SERVICE": url})
    assert found.returncode == 0, found.stderr
    assert "policy_model" in found.stdout
    refused = json_of(quiesce("acknowledge", "--service", url, "nope", "r0:0", "--json", cwd=tmp_path))
    assert refused["error"]["code"] == "config"
    both = quiesce("status", "--service", url, *config, cwd=tmp_path)
    assert both.returncode == 2
    assert "drop --config" in both.stderr

    # the ledger (read-only, beside the service) recorded what the service did
    rows = json_of(quiesce("history", *config, "--json", cwd=tmp_path))
    assert [(r["checkpoint_id"], r["outcome"]) for r in rows][-2:] == [
        (saved, "published"),
        (restored["checkpoint_id"], "resumed"),
    ]


def test_the_api_token_comes_from_the_environment_and_is_never_shown(
    config_file: Path, cluster: RunningCluster, tmp_path: Path, spawn_service: Callable[..., ServiceProcess]
) -> None:
    secret = "api-" + uuid.uuid4().hex
    service = spawn_service(config_file, api_token=secret)
    refused = quiesce("status", "--service", service.url, "--json", cwd=tmp_path)
    assert refused.returncode == 1
    assert json_of(refused)["error"]["code"] == "unauthorized"
    allowed = quiesce("status", "--service", service.url, cwd=tmp_path, env={API_TOKEN_ENV: secret})
    assert allowed.returncode == 0, allowed.stderr
    assert "every server is idle" in allowed.stdout
    for done in (refused, allowed):
        assert secret not in done.stdout + done.stderr
    gone = quiesce("status", "--service", "http://127.0.0.1:9", "--json", cwd=tmp_path)
    assert (gone.returncode, json_of(gone)["error"]["code"]) == (1, "unavailable")
    bad = quiesce("status", "--service", "127.0.0.1:8470", cwd=tmp_path)
    assert bad.returncode == 2
    assert "give the service's address, e.g. http://127.0.0.1:8470" in bad.stderr


@pytest.mark.postgres
def test_a_postgres_ledger_names_the_service_from_its_lease(
    cluster: RunningCluster,
    tmp_path: Path,
    postgres: TempPostgres,
    spawn_service: Callable[..., ServiceProcess],
    token: str,
) -> None:
    ledger = postgres.create_database(f"t_{uuid.uuid4().hex[:20]}")
    config_file: Path = cluster.write_config(tmp_path / "cluster.yaml", ledger, "snaps")
    service = spawn_service(config_file)
    held: Any = quiesce("abort", "--config", str(config_file), cwd=tmp_path)
    assert held.returncode == 1
    told = " ".join(held.stderr.split())
    assert (
        f"It is the `quiesce serve` at {service.url}: rerun through it: quiesce abort --service {service.url}"
        in told
    )
