"""`/metrics` after a recovery, a save and a rollback, checked against what the ledger holds.

A `quiesce checkpoint` process is SIGKILLed right before its second POST (the policy model paused);
the service started on that ledger recovers it (a recovery, a save rolled back). Then one save
through the service is published and one fails at the resources commit (an injected 500) and is
rolled back. The metrics must say exactly that: attempts by kind and outcome, rollbacks,
recoveries, the histogram counts of control calls (per route and outcome) and of phases equal to
the outcomes and phase ends in the ledger's events of the service's epoch, a held lease, a ledger
commit count, and the seconds since the published snapshot.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiesce.coordinator.crashpoints import CRASH_BEFORE_SEND
from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster
from tests.coordinator.helpers import assert_all_accepting, read_events, set_faults
from tests.serve.conftest import ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _sum(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and all((k, v) in sample_labels for k, v in labels.items())
    )


async def test_metrics_after_a_recovery_a_save_and_a_rollback(
    cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn_service: Any, token: str
) -> None:
    config = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    env = {**os.environ, TOKEN_ENV: token, CRASH_BEFORE_SEND: "2", "PYTHONPATH": str(IMPORT_ROOT)}
    dead = await anyio.run_process(
        [sys.executable, "-m", "quiesce", "checkpoint", "--config", str(config)],
        cwd=str(IMPORT_ROOT),
        env=env,
        check=False,
    )
    assert dead.returncode == -9, dead.stderr
    service: ServiceProcess = spawn_service(config)
    ready = await wait_ready(service.url)
    assert [a["action"] for a in ready["recovery"]["attempts"]] == ["resumed"]
    epoch = ready["epoch"]
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http:
        assert (await http.post("/v1/checkpoints", json={})).status_code == 200
        fault = {"kind": "fail", "path": "/resources-checkpoint/commit", "status": 500, "times": 1}
        await set_faults(http, cluster.urls["tools"], [fault])
        failed = await http.post("/v1/checkpoints", json={})
        assert failed.status_code == 502
        assert failed.json()["error"]["phase"] == "commit"
        await assert_all_accepting(http, cluster)
        scraped = await http.get("/metrics")
    assert scraped.headers["content-type"].startswith("text/plain")
    samples = _samples(scraped.text)
    assert _sum(samples, "quiesce_attempts_total", kind="save", outcome="published") == 1
    assert _sum(samples, "quiesce_attempts_total", kind="save", outcome="aborted") == 2
    assert _sum(samples, "quiesce_attempts_total") == 3
    assert _sum(samples, "quiesce_rollbacks_total") == 2
    assert _sum(samples, "quiesce_recoveries_total") == 1
    assert _sum(samples, "quiesce_fenced_appends_total") == 0
    assert _sum(samples, "quiesce_lease_held") == 1
    since = _sum(samples, "quiesce_seconds_since_last_published")
    assert math.isfinite(since)
    assert since >= 0
    assert _sum(samples, "quiesce_ledger_commit_seconds_count") > 0

    events = [e for e in await read_events(ledger_url) if e.epoch == epoch]
    sent = {e.call_id: e for e in events if e.kind == "call.sent"}
    calls: Counter[tuple[str, str]] = Counter()
    for e in events:
        if e.kind in ("call.replied", "call.failed") and e.call_id in sent:
            call = sent[e.call_id]
            route = f"{call.data['method']} {str(call.data['path']).removeprefix('/ng-control/v1')}"
            calls[(route, "replied" if e.kind == "call.replied" else str(e.data["error"]))] += 1
    measured = {
        (dict(labels)["route"], dict(labels)["outcome"]): value
        for (name, labels), value in samples.items()
        if name == "quiesce_control_call_seconds_count"
    }
    assert measured == dict(calls)
    assert measured[("POST /resources-checkpoint/commit", "http")] == 1
    phases: Counter[tuple[str, str]] = Counter(
        (str(e.data["phase"]), "completed" if e.kind == "phase.completed" else "failed")
        for e in events
        if e.kind in ("phase.completed", "phase.failed")
    )
    for (phase, outcome), count in phases.items():
        assert _sum(samples, "quiesce_phase_duration_seconds_count", phase=phase, outcome=outcome) == count
    aborting = {e.checkpoint_id for e in events if e.kind == "attempt.aborting"}
    rollbacks = [e for e in events if e.kind == "attempt.aborted" and e.checkpoint_id in aborting]
    assert len(rollbacks) == 2  # recovery's, and the failed commit's
    assert _sum(samples, "quiesce_phase_duration_seconds_count", phase="rollback") == len(rollbacks)
