"""API v1 against a real `quiesce serve` process, real gymsim servers, SQLite and PostgreSQL.

- auth: no token, a wrong one, a non-bearer scheme → 401 (with `WWW-Authenticate`); the right one
  → 200; `/healthz` and `/readyz` need none; neither token reaches the service's output or the ledger;
  listening beyond loopback without an API token is refused before anything is bound (exit 2);
- the two-step save: `POST /v1/attempts` → the caller writes its half → publish: the snapshot holds
  it; while the attempt waits, another attempt gets 409 naming it;
- 409 while a save runs (held in prepare by a hung resources prepare), naming its checkpoint id;
- the event stream of an attempt equals the ledger's events of that attempt, in seq order, and ends
  after its terminal event; a stream opened after the end replays it and ends too;
- OpenAPI is served and names the v1 routes;
- a restore's reply lists what to send again (`attempt.resubmit`: each saved rollout as its next
  attempt, on its agent): sent, the rollouts finish; the client rebuilds them as `Resubmission`s.
"""

from __future__ import annotations

import secrets
import signal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Resubmission
from quiesce.tools.gymsim import client as gc
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster
from quiesce.tools.serve.models import RestoreReply
from tests.coordinator.helpers import assert_all_accepting, read_events, server_states
from tests.serve.conftest import ServiceProcess, save_in_progress, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def _config(cluster: RunningCluster, tmp_path: Path, ledger_url: str, **overrides: Any) -> Path:
    return cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps", **overrides)


async def _sse(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    """Every event of one attempt's stream until its `end` (the `end` document last)."""
    import json

    out: list[dict[str, Any]] = []
    async with http.stream("GET", url, timeout=httpx.Timeout(120, connect=10)) as reply:
        assert reply.status_code == 200, await reply.aread()
        assert reply.headers["content-type"].startswith("text/event-stream")
        kind, data = None, None
        async for line in reply.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and data is not None:
                document = json.loads(data)
                if kind == "end":
                    out.append({"end": document})
                    return out
                assert document["kind"] == kind
                out.append(document)
                kind, data = None, None
    raise AssertionError("the stream closed without an end event")


async def test_auth_missing_wrong_and_right_token(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any, token: str
) -> None:
    api_token = "api-" + secrets.token_hex(16)
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url), api_token=api_token)
    assert service.announced["auth"] is True
    await wait_ready(service.url)
    guarded = [("GET", "/v1/attempts"), ("POST", "/v1/checkpoints"), ("GET", "/metrics"),
               ("POST", "/v1/attempts"), ("POST", "/v1/attempts/e1-0000001/publish")]  # fmt: skip
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {api_token}"},
                        {"Authorization": f"Bearer {token}"}):  # fmt: skip
            # the last two: a save's two requests, served by their direct path (tools/serve/fastpath)
            for method, path in guarded:
                reply = await http.request(method, path, headers=headers, json={})
                assert reply.status_code == 401, (headers, path, reply.text)
                assert reply.headers["www-authenticate"] == "Bearer"
                assert reply.json()["error"]["type"] == "Unauthorized"
                assert api_token not in reply.text
                assert token not in reply.text
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200
        right = {"Authorization": f"Bearer {api_token}"}
        assert (await http.get("/v1/attempts", headers=right)).json() == []
        saved = await http.post("/v1/checkpoints", headers=right, json={})
        assert saved.status_code == 200, saved.text
        assert saved.json()["outcome"] == "published"
        assert (await http.get("/metrics", headers=right)).status_code == 200
    service.stop()
    assert service.process.returncode == 0
    output = service.log() + (service.process.stdout.read() if service.process.stdout else "")
    assert api_token not in output
    assert token not in output
    stored = " ".join(str((e.checkpoint_id, e.server, e.data)) for e in await read_events(ledger_url))
    assert api_token not in stored
    assert token not in stored


def test_listening_beyond_loopback_needs_an_api_token(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, token: str
) -> None:
    import os
    import subprocess
    import sys

    config = _config(cluster, tmp_path, sqlite_url)
    env = {k: v for k, v in os.environ.items() if k != "QUIESCE_API_TOKEN"}
    env.update({"PYTHONPATH": str(IMPORT_ROOT), "NEMO_GYM_CHECKPOINT_CONTROL_TOKEN": token})
    done = subprocess.run(
        [sys.executable, "-m", "quiesce", "serve", "--config", str(config), "--listen", "0.0.0.0:0"],
        cwd=str(IMPORT_ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "QUIESCE_API_TOKEN" in done.stderr
    assert "Traceback" not in done.stderr
    assert not Path(sqlite_url.removeprefix("sqlite+aiosqlite:///")).exists()  # nothing was opened


async def test_two_step_save_and_409_while_it_waits(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        started = await http.post("/v1/attempts", json={"deadline_s": 60})
        assert started.status_code == 201, started.text
        attempt = started.json()
        cid = attempt["checkpoint_id"]
        assert attempt["state"] == "committed"
        staging = Path(attempt["staging_dir"])
        (staging / "trainer").mkdir()
        (staging / "trainer" / "step.txt").write_text("1200\n")
        states = await server_states(http, cluster)
        assert states["policy_model"][0] == "committed_paused"
        for method, path in (("POST", "/v1/attempts"), ("POST", "/v1/checkpoints"), ("POST", "/v1/resume")):
            busy = await http.request(method, path, json={})
            assert busy.status_code == 409, busy.text
            assert busy.json()["error"]["type"] == "Busy"
            assert busy.json()["error"]["checkpoint_id"] == cid
            assert cid in busy.json()["error"]["message"]
        wrong = await http.post("/v1/attempts/e9-999999/publish", json={})
        assert wrong.status_code == 404
        published = await http.post(f"/v1/attempts/{cid}/publish", json={"resume": True})
        assert published.status_code == 200, published.text
        assert published.json()["state"] == "completed"
        snapshot = Path(published.json()["snapshot"])
        assert (snapshot / "trainer" / "step.txt").read_text() == "1200\n"
        await assert_all_accepting(http, cluster)
        rows = (await http.get("/v1/attempts")).json()
        assert [(r["checkpoint_id"], r["outcome"]) for r in rows] == [(cid, "published")]
        shown = (await http.get(f"/v1/attempts/{cid}")).json()
        assert shown["checkpoint_id"] == cid
        assert shown["outcome"] == "published"
        assert shown["check"]["violations"] == []
        assert (await http.get("/v1/attempts/nope")).status_code == 404
        schema = (await http.get("/openapi.json")).json()
        routes = {"/v1/checkpoints", "/v1/attempts", "/v1/attempts/{checkpoint_id}/publish", "/v1/restore",
                  "/v1/resume", "/v1/discovery", "/v1/attempts/{checkpoint_id}/events", "/v1/status",
                  "/v1/acknowledge", "/v1/abort", "/v1/attempts/{checkpoint_id}/resume"}  # fmt: skip
        assert routes <= set(schema["paths"])


async def test_restore_reply_lists_what_to_send_again(
    cluster: RunningCluster, make_cluster: Any, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    agent = cluster.urls["simple_agent"]
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        await gc.start_rollouts(http, agent, {"s1": 100_000, "s0": 100_000})
        await gc.wait_turns(http, agent, 1)
    first: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(first.url)
    async with httpx.AsyncClient(base_url=first.url, trust_env=False, timeout=60) as http:
        saved = await http.post("/v1/checkpoints", json={"deadline_s": 30})
        assert saved.status_code == 200, saved.text
        assert saved.json()["resubmit"] == []  # a save lists nothing
    first.stop()
    with make_cluster(None) as fresh:
        service: ServiceProcess = spawn_service(_config(fresh, tmp_path, ledger_url))
        await wait_ready(service.url)
        async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
            reply = await http.post("/v1/restore", json={"resume": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["attempt"]["resubmit"] == [
                {"server": "simple_agent", "rollout_id": "s0", "attempt_index": 1},
                {"server": "simple_agent", "rollout_id": "s1", "attempt_index": 1},
            ]
            attempt = RestoreReply.model_validate(reply.json()).attempt.attempt()
            assert attempt.resubmit == (
                Resubmission("simple_agent", "s0", 1),
                Resubmission("simple_agent", "s1", 1),
            )
            schema = (await http.get("/openapi.json")).json()
            assert "resubmit" in schema["components"]["schemas"]["AttemptModel"]["properties"]
            restored = await gc.get_rollouts(http, fresh.urls["simple_agent"])
            assert {rid: r["status"] for rid, r in restored.items()} == {"s0": "restored", "s1": "restored"}
            await gc.resubmit(http, fresh.urls["simple_agent"], attempt.resubmit)
            rollouts = await gc.wait_until(  # sent again, each continues from its saved boundary
                http,
                fresh.urls["simple_agent"],
                lambda rs: all(r["turns_done"] > restored[rid]["turns_done"] for rid, r in rs.items()),
            )
    assert {rid: r["attempt_index"] for rid, r in rollouts.items()} == {"s0": 1, "s1": 1}
    assert gc.turn_log_problems(rollouts) == []


async def test_409_names_the_save_in_progress(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http:
        async with save_in_progress(http, cluster) as result:
            busy = await http.post("/v1/checkpoints", json={})
            assert busy.status_code == 409
            error = busy.json()["error"]
            assert error["checkpoint_id"] is not None
            assert error["checkpoint_id"] in error["message"]
            assert error["operation"] == "checkpoint"
            rows = (await http.get("/v1/attempts")).json()
            assert [r["checkpoint_id"] for r in rows if r["outcome"] is None] == [error["checkpoint_id"]]
        assert result["reply"].status_code == 200, result["reply"].text
        assert result["reply"].json()["checkpoint_id"] == error["checkpoint_id"]
        await assert_all_accepting(http, cluster)


async def test_event_stream_order_equals_the_ledger(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, ledger_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http:
        started = (await http.post("/v1/attempts", json={"deadline_s": 60})).json()
        cid = started["checkpoint_id"]
        streamed: dict[str, list[dict[str, Any]]] = {}

        async def follow() -> None:
            streamed["live"] = await _sse(http, f"/v1/attempts/{cid}/events")

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await anyio.sleep(0.3)  # let the stream catch up on what is stored, then go live
            assert (await http.post(f"/v1/attempts/{cid}/publish", json={"resume": True})).status_code == 200
        after = await _sse(http, f"/v1/attempts/{cid}/events")  # opened after the end: replays, ends
    stored = [e for e in await read_events(ledger_url, cid)]
    live = streamed["live"]
    assert live[-1] == {"end": {"checkpoint_id": cid, "last_seq": stored[-1].seq}}
    assert [(e["seq"], e["kind"], e["hash"]) for e in live[:-1]] == [(e.seq, e.kind, e.hash) for e in stored]
    assert [e["seq"] for e in after[:-1]] == [e.seq for e in stored]
    assert stored[-1].kind == "attempt.completed"
    service.signal(signal.SIGTERM)
    assert service.wait() == 0


@pytest.mark.parametrize(
    ("listen", "env_token", "says"),
    [
        ("nonsense", True, "HOST:PORT"),
        ("127.0.0.1:99999", True, "HOST:PORT"),
        ("127.0.0.1:0", False, "control token"),
    ],
)
def test_bad_usage_exits_2_with_a_clear_message(
    tmp_path: Path, sqlite_url: str, token: str, listen: str, env_token: bool, says: str
) -> None:
    import os
    import subprocess
    import sys

    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"ledger: {sqlite_url}\nsnapshots: {tmp_path / 'snaps'}\nservers:\n"
        "  - {name: policy_model, url: 'http://127.0.0.1:9'}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM_")}
    env["PYTHONPATH"] = str(IMPORT_ROOT)
    if env_token:
        env["NEMO_GYM_CHECKPOINT_CONTROL_TOKEN"] = token
    done = subprocess.run(
        [sys.executable, "-m", "quiesce", "serve", "--config", str(config), "--listen", listen],
        cwd=str(IMPORT_ROOT), env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr
