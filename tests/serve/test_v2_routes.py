"""The service on Gym's unified plane (v2): a real `quiesce serve` process against real v2 reference
servers (`tools/gymsim/v2`), driven over HTTP, by `RemoteCoordinator` and by the CLI's `--service`.

- discovery and status carry each server's plane (and on v2 its kind, lease and blocker count);
- `POST /v1/checkpoints` with `episodes` and `stop`: the reply carries plane, scope, exported, stop;
  a stop-checkpoint leaves every server held by it; `RemoteCoordinator.checkpoint(episodes=...)`
  rebuilds the same attempt;
- `POST /v1/retire` / `/v1/forget`: bodies validated (422 `InvalidRequest` naming the field, nothing
  sent), behind the API token (401); refused with 409 and the coordinator's message while a two-step
  save is open; retire then forget mark and unmark the rollouts on every server, callers first;
  `RemoteCoordinator.retire/forget`, and `quiesce retire --service URL`;
- on a v1 cluster a retire, a forget and a checkpoint with `stop` or `episodes` are 409, nothing sent.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest

from quiesce.coordinator import EpisodeId, QuiesceError
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import SpecLike, default_v2_spec
from quiesce.tools.gymsim.v2.drive import Control
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from quiesce.tools.serve.client import RemoteCoordinator
from tests.cli.helpers import json_of, quiesce
from tests.serve.conftest import ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

SERVERS = ["environment", "policy_model", "agent", "resources"]
KINDS = ["environment", "model", "agent", "resources"]


@pytest.fixture
def v2_cluster(
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]],
) -> Iterator[RunningCluster]:
    with make_cluster(default_v2_spec()) as running:
        yield running


def _config(cluster: RunningCluster, tmp_path: Path) -> Path:
    path: Path = cluster.write_config(
        tmp_path / "cluster.yaml", "sqlite+aiosqlite:///q.db", tmp_path / "snaps"
    )
    return path


async def _service(spawn_service: Any, config: Path, api_token: str | None = None) -> ServiceProcess:
    service: ServiceProcess = spawn_service(config, api_token=api_token)
    await wait_ready(service.url)
    return service


async def _retired_counts(cluster: RunningCluster, token: str) -> dict[str, int]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        control = Control(cluster.urls, token=token, http=http)
        return {name: (await control.status(name))["retired_rollouts"] for name in cluster.urls}


async def test_discovery_status_and_checkpoint_carry_the_plane(
    v2_cluster: RunningCluster, tmp_path: Path, spawn_service: Any, token: str
) -> None:
    service = await _service(spawn_service, _config(v2_cluster, tmp_path))
    async with (
        httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http,
        Trainer(v2_cluster.urls["environment"]) as trainer,
    ):
        found = (await http.get("/v1/discovery")).json()
        assert [(p["name"], p["plane"], p["component"]) for p in found["participants"]] == list(
            zip(SERVERS, ["v2"] * 4, KINDS, strict=True)
        )
        idle = (await http.get("/v1/status")).json()
        assert [(s["plane"], s["kind"], s["phase"], s["lease_expires_at"], s["blocker_count"])
                for s in idle["servers"]] == [("v2", k, "idle", None, 0) for k in KINDS]  # fmt: skip

        await trainer.start(make_tasks(2), paced=True)
        await trainer.advance(1)
        await trainer.wait_parked()
        scope = [e.model_dump() for e in trainer.in_flight()]
        reply = await http.post("/v1/checkpoints", json={"deadline_s": 60, "episodes": scope})
        assert reply.status_code == 200, reply.text
        saved = reply.json()
        assert (saved["plane"], saved["scope"], saved["stop"], saved["restarts"]) == (
            "v2",
            ["r0", "r1"],
            False,
            {},
        )
        assert saved["exported"] == {name: ["r0", "r1"] for name in SERVERS}
        assert {p["plane"] for p in saved["participants"]} == {"v2"}

        async with RemoteCoordinator(service.url) as remote:
            attempt = await remote.checkpoint(deadline_s=60, episodes=trainer.in_flight())
            assert (attempt.plane, attempt.scope, attempt.stop) == ("v2", ("r0", "r1"), False)
            assert attempt.exported == {name: ("r0", "r1") for name in SERVERS}
            assert [s.plane for s in (await remote.status()).servers] == ["v2"] * 4
            assert (await remote.discover()).plane == "v2"

            stopped = await remote.checkpoint(deadline_s=60, stop=True)
        assert (stopped.stop, stopped.scope) == (True, ("r0", "r1"))
        held = (await http.get("/v1/status")).json()
        assert {(s["phase"], s["held_by"]) for s in held["servers"]} == {("committed", stopped.checkpoint_id)}
        assert all(s["lease_expires_at"] is not None for s in held["servers"])
        (holder,) = held["holders"]
        assert "stop-checkpoint" in holder["state"]
        cli = await anyio.to_thread.run_sync(
            lambda: quiesce("status", "--service", service.url, "--json", cwd=tmp_path)
        )
        assert cli.returncode == 1
        assert json_of(cli)["servers"] == held["servers"]
        freed = await http.post("/v1/resume", json={"checkpoint_id": stopped.checkpoint_id})
        assert freed.status_code == 200, freed.text


async def test_retire_and_forget_routes(
    v2_cluster: RunningCluster, tmp_path: Path, spawn_service: Any, token: str
) -> None:
    api_token = "api-" + secrets.token_hex(16)
    service = await _service(spawn_service, _config(v2_cluster, tmp_path), api_token=api_token)
    auth = {"Authorization": f"Bearer {api_token}"}
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120, headers=auth) as http:
        for path, body in (
            ("/v1/retire", {"episodes": [{"rollout_id": "r0"}]}),
            ("/v1/forget", {"rollout_ids": ["r0"]}),
        ):
            refused = await http.post(path, json=body, headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["type"] == "Unauthorized"
        invalid: dict[str, list[tuple[dict[str, Any], str]]] = {
            "/v1/retire": [
                ({}, "body.episodes"),
                ({"episodes": []}, "body.episodes"),
                ({"episodes": [{"rollout_id": "r0-a1"}]}, "body.episodes[0].rollout_id"),
                ({"episodes": [{"rollout_id": "r0", "attempt": -1}]}, "body.episodes[0].attempt"),
                ({"episodes": [{"rollout_id": "r0", "extra": 1}]}, "body.episodes[0].extra"),
                ({"episodes": [{"rollout_id": "r0"}], "stop": True}, "body.stop"),
                ({"episodes": [{"rollout_id": "r0"}], "deadline_s": 0}, "body.deadline_s"),
            ],
            "/v1/forget": [
                ({"rollout_ids": []}, "body.rollout_ids"),
                ({"rollout_ids": ["bad id"]}, "body.rollout_ids"),
                ({"rollout_ids": ["r0"], "episodes": []}, "body.episodes"),
            ],
        }
        for path, cases in invalid.items():
            for bad, field in cases:
                reply = await http.post(path, json=bad)
                assert reply.status_code == 422, (path, bad, reply.text)
                error = reply.json()["error"]
                assert error["type"] == "InvalidRequest", error
                assert field in [f["field"] for f in error["fields"]], (bad, error)
        assert await _retired_counts(v2_cluster, token) == dict.fromkeys(SERVERS, 0)  # nothing was sent

        # a two-step save awaiting its caller: retire and forget are refused with the coordinator's word
        started = await http.post("/v1/attempts", json={"deadline_s": 120})
        assert started.status_code == 201, started.text
        cid = started.json()["checkpoint_id"]
        for path, body in (
            ("/v1/retire", {"episodes": [{"rollout_id": "r0"}]}),
            ("/v1/forget", {"rollout_ids": ["r0"]}),
        ):
            reply = await http.post(path, json=body)
            assert reply.status_code == 409, reply.text
            message = reply.json()["error"]["message"]
            assert f"while checkpoint {cid} is open" in message
            assert "resume first" in message
        published = await http.post(f"/v1/attempts/{cid}/publish", json={"resume": True})
        assert published.status_code == 200, published.text

        retired = await http.post(
            "/v1/retire", json={"episodes": [{"rollout_id": "r1", "attempt": 2}, {"rollout_id": "r0"}]}
        )
        assert retired.status_code == 200, retired.text
        document = retired.json()
        assert (document["operation"], document["items"], document["failed"]) == (
            "retire",
            ["r0", "r1-a2"],
            {},
        )
        assert document["servers"][:2] == ["environment", "agent"]
        assert set(document["servers"][2:]) == {"policy_model", "resources"}
        assert await _retired_counts(v2_cluster, token) == dict.fromkeys(SERVERS, 2)

        async with RemoteCoordinator(service.url, token=api_token) as remote:
            again = await remote.retire([EpisodeId(rollout_id="r2")], deadline_s=30)
            assert (again.operation, again.items, again.ok) == ("retire", ("r2",), True)
            forgot = await remote.forget(["r2", "r1", "r0", "r1"])
            assert (forgot.operation, forgot.items, forgot.ok) == ("forget", ("r0", "r1", "r2"), True)
            assert set(forgot.servers) == set(SERVERS)
        assert await _retired_counts(v2_cluster, token) == dict.fromkeys(SERVERS, 0)

        # the CLI through the service
        cli = await anyio.to_thread.run_sync(
            lambda: quiesce(
                "retire",
                "--service",
                service.url,
                "r3:1",
                "--json",
                cwd=tmp_path,
                env={"QUIESCE_API_TOKEN": api_token},
            )
        )
        assert cli.returncode == 0, cli.stderr
        assert json_of(cli)["items"] == ["r3-a1"]
        assert api_token not in cli.stdout + cli.stderr


async def test_a_v1_cluster_refuses_the_unified_operations(
    cluster: RunningCluster, tmp_path: Path, spawn_service: Any, token: str
) -> None:
    service = await _service(spawn_service, _config(cluster, tmp_path))
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http:
        for path, body in (
            ("/v1/retire", {"episodes": [{"rollout_id": "r0"}]}),
            ("/v1/forget", {"rollout_ids": ["r0"]}),
            ("/v1/checkpoints", {"stop": True}),
            ("/v1/checkpoints", {"episodes": [{"rollout_id": "r0"}]}),
            ("/v1/attempts", {"episodes": [{"rollout_id": "r0"}]}),
        ):
            reply = await http.post(path, json=body)
            assert reply.status_code == 409, (path, reply.text)
            assert "speaks v1" in reply.json()["error"]["message"], reply.text
        assert (await http.get("/v1/attempts")).json() == []  # no attempt was started
        status = (await http.get("/v1/status")).json()
        assert status["idle"] is True
        assert {s["plane"] for s in status["servers"]} == {"v1"}
        async with RemoteCoordinator(service.url) as remote:
            with pytest.raises(QuiesceError, match="speaks v1"):
                await remote.retire([EpisodeId(rollout_id="r0")])


async def test_a_save_into_a_folder_of_the_callers_through_the_service(
    v2_cluster: RunningCluster, tmp_path: Path, spawn_service: Any, token: str
) -> None:
    # `into` is a folder on the service's host: the route, RemoteCoordinator and the CLI all take it
    service = await _service(spawn_service, _config(v2_cluster, tmp_path))
    folders = [tmp_path / "trainer" / f"step_{i}" for i in range(3)]
    async with (
        httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http,
        Trainer(v2_cluster.urls["environment"]) as trainer,
    ):
        await trainer.start(make_tasks(2), paced=True)
        await trainer.wait_parked()
        reply = await http.post("/v1/checkpoints", json={"deadline_s": 60, "into": str(folders[0])})
        assert reply.status_code == 200, reply.text
        assert reply.json()["snapshot"] == str(folders[0])
        async with RemoteCoordinator(service.url) as remote:
            attempt = await remote.checkpoint(deadline_s=60, into=folders[1])
        assert attempt.snapshot == folders[1]
        cli = await anyio.to_thread.run_sync(
            lambda: quiesce(
                "checkpoint", "--service", service.url, "--into", str(folders[2]), "--json", cwd=tmp_path
            )
        )
        assert cli.returncode == 0, cli.stderr
        assert json_of(cli)["snapshot"] == str(folders[2])
        again = await http.post("/v1/checkpoints", json={"deadline_s": 60, "into": str(folders[0])})
        assert again.status_code == 409, again.text  # a folder is committed into once
        assert "already holds gym" in again.text
    for folder in folders:
        assert (folder / "quiesce-manifest.json").is_file()
        assert (folder / "gym").is_dir()
    assert (
        not (tmp_path / "snaps").exists()
        or [p for p in (tmp_path / "snaps").iterdir() if p.name != ".staging"] == []
    )
