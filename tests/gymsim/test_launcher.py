"""The launcher (`python -m quiesce.tools.gymsim`, `quiesce sim`): `--workers`, config, signals;
`spawn_cluster`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from quiesce.coordinator.protocol import CAPABILITIES_PATH, TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.cli.main import build_parser
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, spawn_cluster
from tests.gymsim.conftest import TOKEN, auth

pytestmark = [pytest.mark.timeout(120)]


class Launched:
    def __init__(self, process: subprocess.Popen[bytes], config: Path, log: Path) -> None:
        self.process, self.config_path, self.log_path = process, config, log

    def config(self) -> dict[str, Any]:
        document: dict[str, Any] = yaml.safe_load(self.config_path.read_text())
        return document

    def urls(self) -> dict[str, str]:
        return {s["name"]: s["url"] for s in self.config()["servers"]}

    def output(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def run(*args: str, env: dict[str, str] | None = None, module: str = "quiesce.tools.gymsim") -> Launched:
        config = tmp_path / f"cluster-{len(started)}.yaml"
        log = tmp_path / f"log-{len(started)}.txt"
        child_env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_ENV_FALLBACK)}
        child_env.update(env or {})
        command = [sys.executable, "-m", module, *args, "--config-out", str(config)]
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command,
                cwd=IMPORT_ROOT,
                env=child_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(process)
        give_up = time.monotonic() + 60
        while not config.exists() and process.poll() is None and time.monotonic() < give_up:
            time.sleep(0.02)
        return Launched(process, config, log)

    yield run
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_default_cluster_writes_the_coordinator_config_and_stops_on_sigterm(launch: Any) -> None:
    launched = launch(env={TOKEN_ENV: TOKEN})
    config = launched.config()
    assert set(config) == {"ledger", "snapshots", "deadline_s", "token_env", "fanout", "servers"}
    assert config["token_env"] == TOKEN_ENV
    assert [s["name"] for s in config["servers"]] == [
        "policy_model",
        "judge",
        "simple_agent",
        "math_agent",
        "tools",
    ]
    assert [s.get("instance_role") for s in config["servers"]] == [None, "auxiliary", None, None, None]
    urls = launched.urls()
    with httpx.Client(trust_env=False) as http:
        for name, url in urls.items():
            assert http.get(url + CAPABILITIES_PATH).json()["name"] == name
        reply = http.post(
            urls["tools"] + "/ng-control/v1/resources-checkpoint/prepare",
            json={"checkpoint_id": "c1", "deadline_ts": time.time() + 10},
            headers=auth(),
        )
        assert reply.status_code == 200
    assert TOKEN not in launched.config_path.read_text()
    launched.process.send_signal(signal.SIGTERM)
    assert launched.process.wait(timeout=30) == 0
    output = launched.output()
    assert str(launched.config_path) in output
    assert "gymsim: stopped" in output
    assert TOKEN not in output
    assert not launched.config_path.exists()  # present exactly while the servers run


def test_workers_declare_unmanaged_and_sigint_stops(launch: Any) -> None:
    launched = launch("--workers", "simple_agent=3", env={TOKEN_ENV_FALLBACK: TOKEN})
    urls = launched.urls()
    with httpx.Client(trust_env=False) as http:
        caps = http.get(urls["simple_agent"] + CAPABILITIES_PATH).json()
        assert caps["multi_process"] == {"mode": "unmanaged", "num_workers": 3}
        assert http.get(urls["tools"] + CAPABILITIES_PATH).json()["multi_process"]["mode"] == "single_worker"
        # the fallback token variable works
        reply = http.get(
            urls["tools"] + "/ng-control/v1/resources-checkpoint/status?checkpoint_id=c1", headers=auth()
        )
        assert reply.status_code == 409
    launched.process.send_signal(signal.SIGINT)
    assert launched.process.wait(timeout=30) == 0


def test_quiesce_sim_with_workers_for_all_and_no_token(launch: Any) -> None:
    launched = launch("sim", "--workers", "2", module="quiesce")
    urls = launched.urls()
    with httpx.Client(trust_env=False) as http:
        for url in urls.values():
            assert http.get(url + CAPABILITIES_PATH).json()["multi_process"] == {
                "mode": "unmanaged",
                "num_workers": 2,
            }
        reply = http.post(
            urls["tools"] + "/ng-control/v1/resources-checkpoint/prepare",
            json={"checkpoint_id": "c1", "deadline_ts": time.time() + 10},
            headers=auth(),
        )
        assert reply.status_code == 401
    assert "every control request is 401" in launched.output()
    launched.process.send_signal(signal.SIGTERM)
    assert launched.process.wait(timeout=30) == 0


def test_bad_spec_is_exit_2(launch: Any, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"servers": [{"kind": "agent", "name": "a", "policy": "missing"}]}))
    launched = launch("--spec", str(spec))
    assert launched.process.wait(timeout=30) == 2
    assert "names no server" in launched.output()
    assert launch("--workers", "0").process.wait(timeout=30) == 2


def test_sim_is_a_quiesce_command() -> None:
    args = build_parser().parse_args(["sim", "--spec", "x.yaml", "--workers", "a=2"])
    assert args.spec == "x.yaml"
    assert args.workers == ["a=2"]
    assert args.handler.__module__ == "quiesce.tools.cli.commands.sim"


def test_spawn_cluster_exposes_urls_config_and_dies_on_sigkill(tmp_path: Path) -> None:
    with spawn_cluster(env={TOKEN_ENV: TOKEN}) as cluster:
        config = cluster.config("sqlite+aiosqlite:///x.db", tmp_path / "snaps", deadline_s=5)
        assert config["ledger"] == "sqlite+aiosqlite:///x.db"
        assert config["snapshots"] == str(tmp_path / "snaps")
        assert config["deadline_s"] == 5
        assert {s["name"]: s["url"] for s in config["servers"]} == cluster.urls
        written = cluster.write_config(tmp_path / "c.yaml", "sqlite+aiosqlite:///x.db", tmp_path / "snaps")
        assert yaml.safe_load(written.read_text()) == cluster.config(
            "sqlite+aiosqlite:///x.db", tmp_path / "snaps"
        )
        with httpx.Client(trust_env=False) as http:
            assert http.get(cluster.urls["judge"] + CAPABILITIES_PATH).json()["instance_role"] == "auxiliary"
        cluster.kill()
        assert cluster.returncode == -signal.SIGKILL
        with httpx.Client(trust_env=False) as http, pytest.raises(httpx.ConnectError):
            http.get(cluster.urls["judge"] + CAPABILITIES_PATH)
