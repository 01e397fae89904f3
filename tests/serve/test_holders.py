"""What holds the servers, through the service: `GET /v1/status`, resume and abort by checkpoint
id, and `POST /v1/acknowledge` — real `quiesce serve` processes, real gymsim servers, SQLite and
PostgreSQL.

- a restore a CLI left held before the service started: `GET /v1/status` is what `quiesce status
  --json` prints (each holder's `verb` added), names the restore and the command that frees it; a
  save is refused with 409 `ServersHeld` naming it; `POST /v1/resume` with no id frees it and the
  status is idle; the client's `status()` is a `ClusterStatus`; the new routes need the API token;
- by id: another ledger's restore (resumed by its id through the client), an unknown id (409, says
  why), the service's own restore aborted by id (finished and resumed), the two-step save waiting
  here aborted by `POST /v1/abort {"checkpoint_id"}`, and a resume of another id while it waits is
  409 `Busy`;
- a status read while a save runs claims no operation: 200 naming the save in progress and `quiesce
  abort --service URL` as what frees it (the service holds the ledger), while a second save still
  gets 409;
- a save the agent refuses only for a finished result nobody acknowledged fails at once naming it;
  acknowledging it through the client lets the next save publish (an acknowledgement, like a
  status read, claims no operation: it runs beside a save in progress); an unknown server,
  a duplicate and an id Gym refuses raise `ConfigError` (400 / 422), a result the agent does not
  hold raises `AcknowledgementError` with the agent's status and code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Attempt, ConfigError, QuiesceError
from quiesce.coordinator.errors import AcknowledgementError, ServersHeld
from quiesce.coordinator.status import ClusterStatus
from quiesce.tools.gymsim import client as gym
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.errors import Busy
from tests.coordinator.helpers import assert_all_accepting, control_log, server_states
from tests.serve.conftest import ServiceProcess, save_in_progress, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

API = "api-secret-for-tests"
RIGHT = {"Authorization": f"Bearer {API}"}


async def _cli(*argv: str) -> tuple[int, Any]:
    """The CLI as a child process (it takes signals, which only a main thread can); `--json`
    output parsed. The control token is in the environment (the `token` fixture)."""
    done = await anyio.run_process(
        [sys.executable, "-m", "quiesce", *argv],
        cwd=str(IMPORT_ROOT),
        env={**os.environ, "PYTHONPATH": str(IMPORT_ROOT)},
        check=False,
    )
    out = done.stdout.decode()
    assert "Traceback" not in done.stderr.decode(), done.stderr.decode()
    return done.returncode, json.loads(out) if out.strip() else None


def _without(document: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in document.items() if k not in keys}


def _comparable(status: dict[str, Any]) -> dict[str, Any]:
    """A status document without what moves between two reads (the deadline left) or what only the
    API adds (each holder's `verb`)."""
    return {
        **status,
        "servers": [_without(s, "deadline_left_s") for s in status["servers"]],
        "holders": [_without(h, "verb") for h in status["holders"]],
    }


async def test_status_names_a_restore_a_cli_left_held_and_resume_without_id_frees_it(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    config = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    assert (await _cli("checkpoint", "--config", str(config), "--json"))[0] == 0
    code, restored = await _cli("restore", "--config", str(config), "--json")
    assert code == 0
    held_by = restored["checkpoint_id"]
    service: ServiceProcess = spawn_service(config, api_token=API)
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for method, path in (("GET", "/v1/status"), ("POST", "/v1/acknowledge"), ("POST", "/v1/resume"),
                                 ("POST", "/v1/abort"), ("POST", f"/v1/attempts/{held_by}/resume"),
                                 ("POST", f"/v1/attempts/{held_by}/abort")):  # fmt: skip
                reply = await http.request(
                    method, path, headers=headers, json=None if method == "GET" else {}
                )
                assert reply.status_code == 401, (method, path, reply.text)
                assert reply.json()["error"]["type"] == "Unauthorized"
        assert (await server_states(http, cluster))["policy_model"][0] != "idle"  # nothing freed them

        reply = await http.get("/v1/status", headers=RIGHT)
        assert reply.status_code == 200, reply.text
        status = reply.json()
        assert (status["idle"], status["held"]) == (False, True)
        [holder] = status["holders"]
        assert (holder["checkpoint_id"], holder["kind"], holder["verb"]) == (held_by, "restore", "resume")
        # the service holds the ledger: the command that frees them goes through it
        assert holder["frees"] == f"quiesce resume --service {service.url} {held_by}"
        held = {s["name"] for s in status["servers"] if s["held"]}
        assert {"policy_model", "simple_agent", "tools"} <= held
        assert all(s["frees"] == holder["frees"] for s in status["servers"] if s["held"])
        code, printed = await _cli("status", "--config", str(config), "--json")
        assert code == 1
        assert _comparable(status) == _comparable(printed)  # what `quiesce status --json` prints

        refused = await http.post("/v1/checkpoints", headers=RIGHT, json={})
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["type"] == "ServersHeld"
        assert set(error["held"].values()) == {held_by}
        assert holder["frees"] in error["message"]

        async with RemoteCoordinator(service.url, token=API) as coord:
            seen = await coord.status()
            assert isinstance(seen, ClusterStatus)
            assert seen.held
            assert not seen.idle
            assert [(h.checkpoint_id, h.kind, h.frees) for h in seen.holders] == [
                (held_by, "restore", holder["frees"])
            ]
            assert seen.as_json()["holders"] == [_without(holder, "verb")]
            with pytest.raises(ServersHeld) as caught:
                await coord.checkpoint()
            assert set(caught.value.held.values()) == {held_by}

        resumed = await http.post("/v1/resume", headers=RIGHT, json={})  # no id: whatever holds the servers
        assert resumed.status_code == 200, resumed.text
        assert (resumed.json()["checkpoint_id"], resumed.json()["outcome"]) == (held_by, "resumed")
        after = (await http.get("/v1/status", headers=RIGHT)).json()
        assert (after["idle"], after["held"], after["holders"]) == (True, False, [])
        await assert_all_accepting(http, cluster)
        nothing = await http.post("/v1/resume", headers=RIGHT, json={})
        assert (nothing.json()["checkpoint_id"], nothing.json()["outcome"]) == (None, "none")


async def test_resume_and_abort_by_id_of_attempts_the_service_did_not_start(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    other = cluster.write_config(tmp_path / "other.yaml", f"sqlite+aiosqlite:///{tmp_path / 'other.db'}", "o")
    assert (await _cli("checkpoint", "--config", str(other), "--json"))[0] == 0
    code, restored = await _cli("restore", "--config", str(other), "--json")
    assert code == 0
    foreign = restored["checkpoint_id"]  # another ledger's id holds the servers
    config = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config)
    await wait_ready(service.url)
    async with (
        httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http,
        RemoteCoordinator(service.url) as coord,
    ):
        [holder] = (await coord.status()).holders
        assert (holder.checkpoint_id, holder.kind, holder.verb) == (foreign, "unknown", "resume")
        unknown = await http.post("/v1/abort", json={"checkpoint_id": "q0000000000-0000000001-aa"})
        assert unknown.status_code == 409, unknown.text
        assert "is not an attempt of this ledger" in unknown.json()["error"]["message"]
        assert "no server reports it active" in unknown.json()["error"]["message"]
        outcome = await coord.resume(foreign)  # POST /v1/attempts/{id}/resume: any id
        assert (outcome.checkpoint_id, outcome.outcome) == (foreign, "resumed")
        assert (await coord.status()).idle
        await assert_all_accepting(http, cluster)

        saved = await coord.checkpoint(deadline_s=60)
        mine = await coord.restore(saved.snapshot)  # the service's own restore, not a waiting save
        assert isinstance(mine, Attempt)
        assert (await coord.status()).holders[0].checkpoint_id == mine.checkpoint_id
        aborted = await coord.abort(mine.checkpoint_id)  # a restore is finished and resumed
        assert (aborted.checkpoint_id, aborted.outcome) == (mine.checkpoint_id, "resumed")
        assert (await coord.status()).idle

        waiting = (await http.post("/v1/attempts", json={"deadline_s": 60})).json()["checkpoint_id"]
        busy = await http.post("/v1/resume", json={"checkpoint_id": foreign})
        assert busy.status_code == 409
        assert (busy.json()["error"]["type"], busy.json()["error"]["checkpoint_id"]) == ("Busy", waiting)
        with pytest.raises(Busy):
            await coord.resume(mine.checkpoint_id)
        named = await http.post("/v1/abort", json={"checkpoint_id": waiting, "reason": "test"})
        assert named.status_code == 200, named.text
        assert (named.json()["checkpoint_id"], named.json()["outcome"]) == (waiting, "aborted")
        assert (await coord.status()).idle
        await assert_all_accepting(http, cluster)
        rows = {r.checkpoint_id: r.outcome for r in await coord.history()}
        assert rows[waiting] == "aborted"
        assert foreign not in rows  # another ledger's id: let go, never recorded as an attempt here


async def test_status_is_served_while_a_save_runs(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    config = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config)
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http:
        async with save_in_progress(http, cluster) as result:
            reply = await http.get("/v1/status")
            assert reply.status_code == 200, reply.text  # not 409: a status claims no operation
            status = reply.json()
            [holder] = status["holders"]
            assert (holder["kind"], holder["verb"]) == ("save", "abort")
            cid = holder["checkpoint_id"]
            assert holder["frees"] == f"quiesce abort --service {service.url} {cid}"
            busy = await http.post("/v1/checkpoints", json={})
            assert busy.status_code == 409
            assert busy.json()["error"]["checkpoint_id"] == holder["checkpoint_id"]
            # an acknowledgement claims no operation either: it reaches the agent (which holds no
            # such result and says so), where a second save is refused as Busy
            body = {"server": "simple_agent", "executions": [["never", 0]]}
            beside = await http.post("/v1/acknowledge", json=body)
            assert beside.status_code == 409, beside.text
            assert beside.json()["error"]["type"] == "AcknowledgementError"
        assert result["reply"].status_code == 200, result["reply"].text
        assert result["reply"].json()["checkpoint_id"] == holder["checkpoint_id"]
        assert (await http.get("/v1/status")).json()["idle"] is True


SPEC = {
    "servers": [
        {"kind": "model", "name": "policy_model", "latency_s": 0.01},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
        {"kind": "resources", "name": "tools", "judge": "judge"},
    ]
}


async def test_acknowledge_through_the_client_lets_its_waiting_save_publish(
    make_cluster: Any, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    with make_cluster(SPEC) as running:
        agent = running.urls["simple_agent"]
        config = running.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
        service: ServiceProcess = spawn_service(config, api_token=API)
        await wait_ready(service.url)
        async with (
            httpx.AsyncClient(trust_env=False, timeout=60) as http,
            RemoteCoordinator(service.url, token=API) as coord,
        ):
            await gym.start_rollouts(http, agent, {"done": 1, "long": 100_000})
            await gym.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            # the agent refuses the prepare only for the finished result nobody acknowledged: the
            # save fails at once, naming it and how to acknowledge it (no retries to the deadline)
            with pytest.raises(QuiesceError) as blocked:
                await coord.checkpoint(deadline_s=60)
            assert "done:0" in str(blocked.value)
            assert "acknowledge" in str(blocked.value)
            prepares = [
                e for e in await control_log(http, agent) if e["path"].endswith("/agent-checkpoint/prepare")
            ]
            assert [e["status"] for e in prepares] == [409]
            assert await coord.acknowledge_completed("simple_agent", [("done", 0)]) == [("done", 0)]
            saved = [await coord.checkpoint(deadline_s=60)]
            assert saved[0].snapshot is not None
            assert (await gym.get_rollouts(http, agent))["done"]["acknowledged"] is True
            rows = {r.checkpoint_id: r.outcome for r in await coord.history()}
            assert rows[saved[0].checkpoint_id] == "published"

            with pytest.raises(ConfigError, match="no server 'nobody' in the config"):
                await coord.acknowledge_completed("nobody", [("r", 0)])
            with pytest.raises(ConfigError, match="executions must be unique"):
                await coord.acknowledge_completed("simple_agent", [("r", 0), ("r", 0)])
            with pytest.raises(ConfigError, match=r"executions\[0\]\.rollout_id: must match the pattern"):
                await coord.acknowledge_completed("simple_agent", [("-r", 0)])
            refused = "completed_execution_acknowledgement_error"
            with pytest.raises(AcknowledgementError, match=refused) as caught:
                await coord.acknowledge_completed("simple_agent", [("never", 0)])
            assert (caught.value.server, caught.value.status, caught.value.code) == (
                "simple_agent",
                409,
                "completed_execution_acknowledgement_error",
            )
            for body in ({"server": "simple_agent", "executions": []},
                         {"server": "simple_agent", "executions": [["r", -1]]},
                         {"server": "simple_agent", "executions": [["r"]]},
                         {"executions": [["r", 0]]},
                         {"server": "simple_agent", "executions": [["r", 0]], "typo": 1}):  # fmt: skip
                bad = await http.post(f"{service.url}/v1/acknowledge", json=body, headers=RIGHT)
                assert bad.status_code == 422, (body, bad.text)
            nobody = {"server": "nobody", "executions": [["r", 0]]}
            unknown = await http.post(f"{service.url}/v1/acknowledge", json=nobody, headers=RIGHT)
            assert (unknown.status_code, unknown.json()["error"]["type"]) == (400, "ConfigError")
            acks = [e for e in await control_log(http, agent) if e["path"].endswith("/acknowledge-completed")]
            assert len(acks) == 2  # "done" and "never": nothing refused up front was sent
            await assert_all_accepting(http, running)
