"""`quiesce conformance` against the unified-plane (v2) reference servers of `tools/gymsim/v2`.

Every kind passes every row that applies to it (environment, policy model, agent, resources;
restart-only agent and resources, stateless resources; a multi-worker environment), with the lease
row run where the server has a short grace; an environment holding parked episodes passes with
real records in its commit; and the wire oracle (`tests/oracle`) judges all of that traffic
without a complaint (the autouse `wire_oracle` fixture fails a test that drifted).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from quiesce.tools.cli.main import main
from quiesce.tools.conformance_report import ConformanceReport
from quiesce.tools.conformance_v2 import check_server
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from tests.conformance.conftest import TOKEN
from tests.oracle.wire import Violations

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

SHORT_GRACE_S = 1.0

SPEC: dict[str, list[dict[str, Any]]] = {
    "servers": [
        {"kind": "environment", "plane": "v2", "name": "environment", "agent": "agent"},
        {"kind": "model", "plane": "v2", "name": "policy_model", "lease_grace_s": SHORT_GRACE_S},
        {
            "kind": "agent",
            "plane": "v2",
            "name": "agent",
            "policy": "policy_model",
            "resources": "resources",
            "lease_grace_s": SHORT_GRACE_S,
        },
        {"kind": "resources", "plane": "v2", "name": "resources", "lease_grace_s": SHORT_GRACE_S},
        {
            "kind": "agent",
            "plane": "v2",
            "name": "agent_restart_only",
            "policy": "policy_model",
            "checkpoint_mode": "restart_only",
        },
        {
            "kind": "resources",
            "plane": "v2",
            "name": "resources_restart_only",
            "checkpoint_mode": "restart_only",
        },
        {"kind": "resources", "plane": "v2", "name": "resources_stateless", "checkpoint_mode": "stateless"},
        {
            "kind": "environment",
            "plane": "v2",
            "name": "environment_workers",
            "agent": "agent",
            "workers": 2,
            "worker_mode": "coordinator",
            "lease_grace_s": SHORT_GRACE_S,
        },
    ]
}
KIND_OF = {server["name"]: server["kind"] for server in SPEC["servers"]}
BASIC = ("environment", "policy_model", "agent", "resources")
SHORT_GRACE = {server["name"] for server in SPEC["servers"] if "lease_grace_s" in server}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    # Module-scoped: started before a test's `oracle_v2` wraps the maker, so each test that wants
    # the oracle on these servers starts its own (below); this one serves the plain checks.
    with start_cluster(SPEC, token=TOKEN) as running:
        yield running


def _failures(report: ConformanceReport) -> list[str]:
    return [f"{r.name}: {r.detail}" for r in report.results if r.status == "fail"]


def _not_passed(report: ConformanceReport) -> dict[str, str]:
    return {r.name: r.status for r in report.results if r.status != "pass"}


@pytest.mark.parametrize("name", list(KIND_OF))
async def test_every_v2_reference_server_passes(cluster: RunningCluster, name: str) -> None:
    report = await check_server(cluster.urls[name], TOKEN, timeout_s=20, lease_check=True)
    assert _failures(report) == []
    assert (report.plane, report.component, report.name) == ("v2", KIND_OF[name], name)
    expected = {"validation.deadline_ts": "warn"}  # real Gym's 500 for a non-finite deadline
    if KIND_OF[name] != "model":
        expected["commit.scope_required"] = "skip"
    if name not in SHORT_GRACE:
        expected["lease.expiry"] = "skip"
    assert _not_passed(report) == expected
    async with httpx.AsyncClient() as client:
        status = (
            await client.get(
                cluster.urls[name] + "/ng-control/v1/checkpoint/status",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
        ).json()
    assert (status["phase"], status["checkpoint_id"], status["lease_expires_at"]) == ("idle", None, None)


async def test_the_oracle_judges_the_checkers_traffic_on_every_kind(oracle_v2: Violations) -> None:
    spec = {
        "servers": [
            s for s in SPEC["servers"] if s["name"] in ("environment", "policy_model", "agent", "resources")
        ]
    }
    with start_cluster(spec, token=TOKEN) as running:
        before = oracle_v2.replies_checked
        for name, url in running.urls.items():
            report = await check_server(url, TOKEN, timeout_s=20)
            assert _failures(report) == [], name
        assert oracle_v2.replies_checked - before >= 4 * 60  # every probe's reply, on every kind
    assert oracle_v2.take() == []


async def test_an_environment_with_parked_episodes_commits_their_records(oracle_v2: Violations) -> None:
    spec = {
        "servers": [
            s for s in SPEC["servers"] if s["name"] in ("environment", "policy_model", "agent", "resources")
        ]
    }
    with start_cluster(spec, token=TOKEN) as running:
        async with Trainer(running.urls["environment"]) as trainer:
            await trainer.start(make_tasks(3, turns=4), paced=True)
            await trainer.advance(1)
            await trainer.wait_parked()
            report = await check_server(running.urls["environment"], TOKEN, timeout_s=20)
            rows = {r.name: (r.status, r.detail) for r in report.results}
            assert _failures(report) == []
            assert rows["storage.records"] == (
                "pass",
                "3 records, digest and count as the manifest says, episode ids objects",
            )
            await trainer.unpace()
            results = await trainer.wait_results()
        assert sorted(results) == ["r0", "r1", "r2"]  # the checker left them running: every one finished


def test_the_cli_detects_the_unified_plane(
    cluster: RunningCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NEMO_GYM_CHECKPOINT_CONTROL_TOKEN", TOKEN)
    assert main(["conformance", cluster.urls["resources"], "--timeout", "20"]) == 0
    out = capsys.readouterr().out
    assert "unified plane" in out
    assert "cleanup.idle" in out
    assert "conformant" in out
    assert TOKEN not in out


async def test_the_oracle_accepts_the_multi_worker_environments_traffic(oracle_v2: Violations) -> None:
    spec = {
        "servers": [
            s
            for s in SPEC["servers"]
            if s["name"] in ("environment_workers", "agent", "policy_model", "resources")
        ]
    }
    with start_cluster(spec, token=TOKEN) as running:
        report = await check_server(running.urls["environment_workers"], TOKEN, timeout_s=20)
        assert _failures(report) == []
    problems = oracle_v2.take()
    assert problems == []
