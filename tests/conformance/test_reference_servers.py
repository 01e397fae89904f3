"""The checker against the reference servers of `tools/gymsim` (the seed's example cluster).

Every reference server must pass (skips allowed where the spec makes a check
inapplicable: the judge is auxiliary, math_agent is stateless), an agent with
rollouts in flight must park, commit and release them, and a server broken through
gymsim's own fault injection must fail with a clear row while the checker still
leaves it idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from quiesce.tools.conformance import ConformanceReport, run_conformance
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from tests.conformance.conftest import TOKEN

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with start_cluster(token=TOKEN) as running:
        yield running


def _rows(report: ConformanceReport) -> dict[str, tuple[str, str]]:
    return {r.name: (r.status, r.detail) for r in report.results}


def _failures(report: ConformanceReport) -> list[str]:
    return [f"{r.name}: {r.detail}" for r in report.results if r.status == "fail"]


async def _fence(client: httpx.AsyncClient, url: str) -> tuple[str, str | None]:
    caps = (await client.get(url + "/ng-control/v1/capabilities")).json()
    return caps["phase"], caps["active_checkpoint_id"]


@pytest.mark.parametrize("name", ["policy_model", "simple_agent", "tools"])
async def test_stateful_reference_servers_pass_every_check(cluster: RunningCluster, name: str) -> None:
    report = await run_conformance(cluster.urls[name], TOKEN, timeout_s=20)
    assert _failures(report) == []
    rows = _rows(report)
    assert report.name == name
    for check in ("cycle.prepare", "cycle.commit", "artifacts.manifest_digest", "fence.stale_after_resume"):
        assert rows[check][0] == "pass", rows[check]
    if name == "simple_agent":
        assert rows["artifacts.index"][0] == "pass"
    async with httpx.AsyncClient() as client:
        assert await _fence(client, cluster.urls[name]) == ("idle", None)


@pytest.mark.parametrize("shape", ["receipt_status", "receipt_plain", "receipt"])
async def test_later_gym_agents_pass_the_acknowledgement_rows_in_their_own_form(shape: str) -> None:
    # as Gym's own routes, the agent validates a request's body before its token
    agent = {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "acknowledgement": shape}
    spec: dict[str, Any] = {
        "servers": [{"kind": "model", "name": "policy_model"}, {**agent, "body_before_auth": True}]
    }
    with start_cluster(spec, token=TOKEN) as running:
        report = await run_conformance(running.urls["simple_agent"], TOKEN, timeout_s=20)
        async with httpx.AsyncClient() as client:
            assert await _fence(client, running.urls["simple_agent"]) == ("idle", None)
    assert _failures(report) == []
    rows = _rows(report)
    for name in ("acknowledge.auth", "acknowledge.validation", "acknowledge.unknown_execution"):
        assert rows[name][0] == "pass", rows[name]
    assert rows["acknowledge.unknown_execution"][1].startswith("a completion receipt of an execution")
    assert (
        "a malformed batch without a token → 422 (the body is validated before" in rows["acknowledge.auth"][1]
    )
    assert rows["auth.post_missing_token"][0] == rows["auth.status_wrong_token"][0] == "pass"


async def test_judge_is_checked_as_an_auxiliary_instance(cluster: RunningCluster) -> None:
    report = await run_conformance(cluster.urls["judge"], TOKEN, timeout_s=20)
    assert _failures(report) == []
    rows = _rows(report)
    assert report.instance_role == "auxiliary"
    assert rows["auxiliary.not_a_policy_instance"][0] == "pass"
    assert rows["auth.post_wrong_token"][0] == "pass"
    assert rows["cycle.prepare"][0] == "skip"


async def test_stateless_math_agent_is_skipped_with_the_reason(cluster: RunningCluster) -> None:
    report = await run_conformance(cluster.urls["math_agent"], TOKEN, timeout_s=20)
    assert _failures(report) == []
    rows = _rows(report)
    assert rows["capabilities.shape"][0] == "pass"
    assert rows["cycle.prepare"] == (
        "skip",
        "checkpoint_mode stateless: the coordinator never drives its control routes",
    )


async def test_agent_with_rollouts_in_flight_parks_commits_and_releases_them() -> None:
    with start_cluster(token=TOKEN) as running:
        agent, model = running.urls["simple_agent"], running.urls["policy_model"]
        async with httpx.AsyncClient() as client:
            reply = await client.post(model + "/gymsim/admin/options", json={"latency_s": 0.02})
            assert reply.status_code == 200, reply.text
            for i in range(3):  # long enough to be parked, not finished, when the cycle prepares
                reply = await client.post(agent + "/run", json={"rollout_id": f"r{i}", "turns": 150})
                assert reply.status_code == 200, reply.text
            report = await run_conformance(agent, TOKEN, timeout_s=20)
            assert _failures(report) == []
            status, detail = _rows(report)["artifacts.index"]
            assert status == "pass"
            assert "(3 records" in detail  # every running rollout was parked and recorded
            # The checker's resume released them: they all run to the end.
            while True:
                views = (await client.get(agent + "/rollouts")).json()["rollouts"]
                if all(v["status"] == "completed" for v in views):
                    break
                assert not any(v["status"] == "failed" for v in views), views
                await anyio.sleep(0.05)
            assert len(views) == 3


@pytest.mark.parametrize(
    ("path", "kind", "row", "words"),
    [
        (
            "/resources-checkpoint/commit",
            "wrong_schema",
            "cycle.commit",
            "does not match ResourcesCommitReply",
        ),
        (
            "/resources-checkpoint/prepare",
            "malformed",
            "cycle.prepare",
            "prepare reply is not JSON",
        ),
    ],
)
async def test_injected_fault_fails_a_clear_row_and_leaves_the_server_idle(
    cluster: RunningCluster, path: str, kind: str, row: str, words: str
) -> None:
    url = cluster.urls["tools"]
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            url + "/gymsim/admin/faults", json={"faults": [{"kind": kind, "path": path}]}
        )
        assert reply.status_code == 200, reply.text
        try:
            report = await run_conformance(url, TOKEN, timeout_s=20)
        finally:
            await client.delete(url + "/gymsim/admin/faults")
        status, detail = _rows(report)[row]
        assert status == "fail"
        assert words in detail
        assert not report.passed
        assert _rows(report)["cleanup.idle"][0] == "pass"
        assert await _fence(client, url) == ("idle", None)


async def test_model_drain_that_never_ends_fails_status_and_commit_but_is_resumed() -> None:
    # gymsim's `hang` fault keeps a data-plane request in flight: the pause can only reach
    # draining, so the long-poll must give up with a clear row, commit must be refused,
    # and the checker must still resume the model.
    with start_cluster(token=TOKEN) as running:
        model = running.urls["policy_model"]
        async with httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as tg:
            fault = {"kind": "hang", "path": "/v1/responses"}
            reply = await client.post(model + "/gymsim/admin/faults", json={"faults": [fault]})
            assert reply.status_code == 200, reply.text

            async def hung_call() -> None:
                await client.post(model + "/v1/responses", json={"input": "hello"})

            tg.start_soon(hung_call)
            state_url = model + "/gymsim/admin/state"
            while (await client.get(state_url)).json().get("inflight_total") != 1:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            try:
                report = await run_conformance(model, TOKEN, timeout_s=2)
            finally:
                await client.delete(model + "/gymsim/admin/faults")
            rows = _rows(report)
            assert rows["cycle.prepare"][0] == "pass"
            assert "state=draining" in rows["cycle.prepare"][1]
            assert rows["cycle.status"] == ("fail", "not paused within 2s: state draining, 1 in flight")
            assert rows["cycle.commit"][0] == "fail"
            assert rows["cycle.resume"][0] == "pass"
            assert rows["cleanup.idle"][0] == "pass"
            assert await _fence(client, model) == ("idle", None)
            tg.cancel_scope.cancel()


#: Every other kind of reference server gymsim can run, and the rows that show what it is.
SPECIAL: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "coordinator": (
        {"kind": "model", "name": "policy_model", "workers": 2, "worker_mode": "coordinator"},
        {"status.workers": "pass", "artifacts.index": "pass"},
    ),
    "later_gym_model": (
        {"kind": "model", "name": "policy_model", "restore_index": "always"},
        {"artifacts.index": "pass"},
    ),
    "drain_only_model": (
        {"kind": "model", "name": "policy_model", "checkpoint_mode": "stateless"},
        {"cycle.status": "pass", "cycle.commit": "skip", "cycle.resume": "pass"},
    ),
    "restart_only_model": (
        {"kind": "model", "name": "policy_model", "checkpoint_mode": "restart_only"},
        {"cycle.prepare": "skip"},
    ),
    "restart_only_agent": (
        {"kind": "agent", "name": "agent", "checkpoint_mode": "restart_only", "policy": "policy_model"},
        {"cycle.prepare": "skip", "acknowledge.auth": "skip"},
    ),
    "restart_only_resources": (
        {"kind": "resources", "name": "tools", "checkpoint_mode": "restart_only"},
        {"cycle.prepare": "skip"},
    ),
}


@pytest.mark.parametrize("kind", sorted(SPECIAL))
async def test_every_kind_of_reference_server_passes(kind: str) -> None:
    server, expected = SPECIAL[kind]
    servers = [server] if server["kind"] == "model" else [{"kind": "model", "name": "policy_model"}, server]
    with start_cluster({"servers": servers}, token=TOKEN) as running:
        report = await run_conformance(running.urls[server["name"]], TOKEN, timeout_s=20)
        assert _failures(report) == []
        rows = _rows(report)
        assert {name: rows[name][0] for name in expected} == expected, rows
        assert rows["cleanup.idle"][0] == "pass" or rows["cycle.prepare"][0] == "skip"


async def test_the_agents_acknowledgement_rows_pass(cluster: RunningCluster) -> None:
    report = await run_conformance(cluster.urls["simple_agent"], TOKEN, timeout_s=20)
    rows = _rows(report)
    for name in ("acknowledge.auth", "acknowledge.validation", "acknowledge.unknown_execution"):
        assert rows[name][0] == "pass", rows[name]


async def test_servers_hosted_under_a_path_prefix() -> None:
    # Many servers on one port under /s/<name>: the URL given is the server's base, prefix included.
    spec = {
        "servers": [
            {"kind": "model", "name": "policy_model"},
            {"kind": "resources", "name": "tools_{i}", "count": 2, "prefix": True},
            {
                "kind": "agent",
                "name": "agent_{i}",
                "count": 2,
                "prefix": True,
                "policy": "policy_model",
                "resources": "tools_{i}",
            },
        ]
    }
    with start_cluster(spec, token=TOKEN) as running:
        for name in ("agent_1", "tools_1"):
            url = running.urls[name]
            assert url.endswith(f"/s/{name}")
            report = await run_conformance(url, TOKEN, timeout_s=20)
            assert _failures(report) == []
            assert report.name == name


async def test_a_connection_the_server_dropped_after_a_500_is_reopened(cluster: RunningCluster) -> None:
    """A real Gym agent answers a non-finite `deadline_ts` with a 500 and closes the connection
    without saying so: the checker's next request on that connection must go out again on a new
    one, so only the check that met the 500 is marked and no later row fails for the dropped
    connection."""
    from tests.hostile.front import Rule, hostile_front, status_500_then_drop

    rule = Rule("/agent-checkpoint/prepare", status_500_then_drop)
    async with hostile_front(cluster.urls["simple_agent"], rule) as url:
        report = await run_conformance(url, TOKEN, timeout_s=20)
    assert len(rule.fired) == 1
    dropped = [f"{r.name}: {r.detail}" for r in report.results if "disconnect" in r.detail.lower()]
    assert dropped == []
    hit = [r for r in report.results if r.status != "pass" and "500" in r.detail]
    assert len(hit) <= 1, hit  # the one check whose request met the 500
    others = [f for f in _failures(report) if not (hit and f.startswith(hit[0].name + ":"))]
    assert others == []
    async with httpx.AsyncClient() as client:
        assert await _fence(client, cluster.urls["simple_agent"]) == ("idle", None)
