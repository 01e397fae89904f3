"""Acknowledging finished results on each shape of Gym's agent, against real gymsim processes.

Gym's agent versions differ in how a finished result is acknowledged: the anchor's takes the bare
`{rollout_id, attempt_index}` pairs; later ones take each result's completion receipt, in their
own fields — five (`receipt_status`: shown only in the status entries, no receipt route;
`receipt_plain`: also `GET /agent-checkpoint/completion-receipt`) or seven (`receipt`: the
model-lineage pair too). An agent refuses a field it does not have, even null, with 422. Each
test drives the embedded API and the real CLI (`quiesce acknowledge`) against a gymsim cluster
in its own process, and reads what was sent from the ledger.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, load_config
from quiesce.coordinator.errors import AcknowledgementError
from quiesce.coordinator.protocol import AGENT, CAPABILITIES_PATH, TOKEN_ENV, route
from quiesce.ledger import Event
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import spawn_cluster
from tests.coordinator.helpers import assert_protocol_ok, read_events
from tests.hostile.helpers import no_traceback, run_cli

pytestmark = pytest.mark.timeout(240)

FIVE = ["rollout_id", "attempt_index", "execution_generation", "result_identity", "result_digest"]
SEVEN = [*FIVE, "manifest_capture_key", "terminal_model_call_id"]
#: the receipt fields each shape shows (None: it acknowledges pairs)
FIELDS: dict[str, list[str] | None] = {
    "pair": None,
    "receipt_status": FIVE,
    "receipt_plain": FIVE,
    "receipt": SEVEN,
}
#: the steps of one acknowledgement by a coordinator that has not met the agent yet
FIRST_STEPS: dict[str, list[tuple[str, str, str]]] = {
    "pair": [("POST", "acknowledge-completed", "call.replied")],
    "receipt_status": [
        ("POST", "acknowledge-completed", "call.failed"),  # the pairs: 422
        ("GET", "completion-receipt", "call.failed"),  # 404: no receipt route
        ("GET", "capabilities", "call.replied"),
        ("GET", "status", "call.replied"),  # the receipts, in completed_unacknowledged_attempts
        ("POST", "acknowledge-completed", "call.replied"),
    ],
    "receipt_plain": [
        ("POST", "acknowledge-completed", "call.failed"),
        ("GET", "completion-receipt", "call.replied"),
        ("POST", "acknowledge-completed", "call.replied"),
    ],
    "receipt": [
        ("POST", "acknowledge-completed", "call.failed"),
        ("GET", "completion-receipt", "call.replied"),
        ("POST", "acknowledge-completed", "call.replied"),
    ],
}
#: ... and once it knows where the agent shows its receipts
NEXT_STEPS: dict[str, list[tuple[str, str, str]]] = {
    "pair": [("POST", "acknowledge-completed", "call.replied")],
    "receipt_status": [
        ("GET", "capabilities", "call.replied"),
        ("GET", "status", "call.replied"),
        ("POST", "acknowledge-completed", "call.replied"),
    ],
    "receipt_plain": FIRST_STEPS["receipt_plain"][1:],
    "receipt": FIRST_STEPS["receipt"][1:],
}


def _spec(shape: str) -> dict[str, Any]:
    return {
        "servers": [
            {"kind": "model", "name": "policy_model"},
            {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "acknowledgement": shape},
        ]
    }


def _steps(events: list[Event]) -> list[tuple[str, str, str]]:
    """(method, last path segment, outcome kind) of each recorded acknowledge call, in order."""
    calls = [ev for ev in events if ev.call_id and "-acknowledge/" in ev.call_id]
    outcomes = {ev.call_id: ev.kind for ev in calls if ev.kind != "call.sent"}
    return [
        (ev.data["method"], ev.data["path"].rsplit("/", 1)[-1], outcomes[ev.call_id])
        for ev in calls
        if ev.kind == "call.sent"
    ]


def _acknowledged_bodies(events: list[Event]) -> list[list[dict[str, Any]]]:
    """The `executions` of every acknowledge-completed the agent accepted."""
    replied = {ev.call_id for ev in events if ev.kind == "call.replied"}
    return [
        ev.data["body"]["executions"]
        for ev in events
        if ev.kind == "call.sent"
        and ev.call_id in replied
        and ev.data["path"].endswith("/acknowledge-completed")
    ]


async def _shown_receipts(http: httpx.AsyncClient, agent: str, token: str) -> dict[str, dict[str, Any]]:
    """Each held result's receipt as the agent's status shows it, by rollout id."""
    reply = await http.get(
        agent + route(AGENT, "status").full_path,
        params={"checkpoint_id": "test-peek"},
        headers={"Authorization": f"Bearer {token}"},
    )
    reply.raise_for_status()
    return {
        entry["rollout_id"]: entry["completion_receipt"]
        for entry in reply.json()["completed_unacknowledged_attempts"]
        if "completion_receipt" in entry
    }


@pytest.mark.parametrize("shape", list(FIELDS))
def test_each_agent_shape_is_acknowledged_in_its_own_fields(
    shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "qz-" + secrets.token_hex(12)
    monkeypatch.setenv(TOKEN_ENV, token)
    ledger_url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    fields = FIELDS[shape]
    with spawn_cluster(_spec(shape), env={TOKEN_ENV: token}, workdir=tmp_path / "gym") as gym:
        agent = gym.urls["simple_agent"]
        config_path = gym.write_config(tmp_path / "quiesce.yaml", ledger_url, tmp_path / "snapshots")

        async def api() -> dict[str, dict[str, Any]]:
            async with httpx.AsyncClient(timeout=60) as http:
                await client.start_rollouts(http, agent, {"d0": 1, "d1": 1, "d2": 1})
                await client.wait_finished(http, agent, expect=3)
                shown = await _shown_receipts(http, agent, token)
                if fields is not None:
                    assert all(sorted(receipt) == sorted(fields) for receipt in shown.values()), shown
                if fields == FIVE:
                    # what the old coordinator sent: the lineage pair as nulls — refused, released nothing
                    nulls = {**shown["d0"], "manifest_capture_key": None, "terminal_model_call_id": None}
                    refused = await http.post(
                        agent + route(AGENT, "acknowledge").full_path,
                        json={"executions": [nulls]},
                        headers={"Authorization": f"Bearer {token}"},
                    )
                    assert refused.status_code == 422
                    assert "extra_forbidden" in refused.text
                async with Coordinator.open(load_config(config_path)) as coord:
                    await coord.discover()
                    assert await coord.acknowledge_completed("simple_agent", [("d0", 0)]) == [("d0", 0)]
                    assert await coord.acknowledge_completed("simple_agent", [("d1", 0)]) == [("d1", 0)]
                views = await client.get_rollouts(http, agent)
                assert [views[r]["acknowledged"] for r in ("d0", "d1", "d2")] == [True, True, False]
                return shown

        shown = anyio.run(api)
        done = run_cli("acknowledge", "--config", str(config_path), "simple_agent", "d2:0", token=token)
        no_traceback(done)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "simple_agent: acknowledged d2:0" in done.stdout

        async def after() -> list[Event]:
            async with httpx.AsyncClient(timeout=60) as http:
                views = await client.get_rollouts(http, agent)
                assert all(views[r]["acknowledged"] for r in ("d0", "d1", "d2")), views
            return await read_events(ledger_url)

        events = anyio.run(after)
    api_steps = FIRST_STEPS[shape] + NEXT_STEPS[shape]
    cli_steps = [("GET", "capabilities", "call.replied"), *FIRST_STEPS[shape]]  # no discovery: features read
    assert _steps(events) == api_steps + cli_steps
    sent = _acknowledged_bodies(events)
    if fields is None:
        assert sent == [[{"rollout_id": r, "attempt_index": 0}] for r in ("d0", "d1", "d2")]
    else:
        # exactly the receipt the agent gave, field for field: no null it did not give
        assert sent == [[shown[r]] for r in ("d0", "d1", "d2")]
        assert all(sorted(body[0]) == sorted(fields) for body in sent)
    anyio.run(assert_protocol_ok, ledger_url)


def test_a_status_shown_receipt_that_is_gone_is_reported_not_guessed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an agent that shows receipts only in its status: a result it does not hold (never ran, or
    # already acknowledged) has no receipt there — the coordinator says so and sends nothing
    token = "qz-" + secrets.token_hex(12)
    monkeypatch.setenv(TOKEN_ENV, token)
    ledger_url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    with spawn_cluster(_spec("receipt_status"), env={TOKEN_ENV: token}, workdir=tmp_path / "gym") as gym:
        agent = gym.urls["simple_agent"]
        config_path = gym.write_config(tmp_path / "quiesce.yaml", ledger_url, tmp_path / "snapshots")

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                await client.start_rollouts(http, agent, {"d0": 1})
                await client.wait_finished(http, agent, expect=1)
                async with Coordinator.open(load_config(config_path)) as coord:
                    assert await coord.acknowledge_completed("simple_agent", [("d0", 0)]) == [("d0", 0)]
                    with pytest.raises(AcknowledgementError) as caught:
                        await coord.acknowledge_completed("simple_agent", [("d0", 0)])
                    assert str(caught.value) == (
                        "simple_agent did not acknowledge d0:0: d0:0: its status shows no completion"
                        " receipt of it (not a finished result it holds, or one already acknowledged)"
                    )
                    with pytest.raises(AcknowledgementError, match="never:0: its status shows no completion"):
                        await coord.acknowledge_completed("simple_agent", [("never", 0)])

        anyio.run(run)
        events = anyio.run(read_events, ledger_url)
    posts = [
        ev for ev in events if ev.kind == "call.sent" and ev.data["path"].endswith("/acknowledge-completed")
    ]
    assert len(posts) == 2  # the first pairs (422) and the receipt of d0; nothing after
    anyio.run(assert_protocol_ok, ledger_url)


def test_a_status_read_during_a_prepare_names_the_agents_active_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a prepare waits for a slow turn to park (the agent's fence is active under its id): the
    # receipts are read from the status under that id — another id would be a checkpoint_conflict
    token = "qz-" + secrets.token_hex(12)
    monkeypatch.setenv(TOKEN_ENV, token)
    ledger_url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    spec = _spec("receipt_status")
    spec["servers"][0]["latency_s"] = 1.5
    checkpoint_id = "ck-held-by-a-prepare"
    with spawn_cluster(spec, env={TOKEN_ENV: token}, workdir=tmp_path / "gym") as gym:
        agent = gym.urls["simple_agent"]
        config_path = gym.write_config(tmp_path / "quiesce.yaml", ledger_url, tmp_path / "snapshots")
        headers = {"Authorization": f"Bearer {token}"}

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                await client.start_rollouts(http, agent, {"done": 1})
                await client.wait_finished(http, agent, expect=1)
                await client.start_rollouts(http, agent, {"slow": 1000})
                await anyio.sleep(0.2)  # inside its first 1.5 s turn
                body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + 30}
                async with anyio.create_task_group() as tg:

                    async def prepare() -> None:
                        reply = await http.post(
                            agent + route(AGENT, "prepare").full_path, json=body, headers=headers
                        )
                        assert reply.status_code == 200, reply.text  # ready once `done` is released

                    tg.start_soon(prepare)
                    await anyio.sleep(0.3)
                    caps = (await http.get(agent + CAPABILITIES_PATH)).json()
                    assert (caps["phase"], caps["active_checkpoint_id"]) == ("preparing", checkpoint_id)
                    async with Coordinator.open(load_config(config_path)) as coord:
                        assert await coord.acknowledge_completed("simple_agent", [("done", 0)]) == [
                            ("done", 0)
                        ]
                resumed = await http.post(
                    agent + route(AGENT, "resume").full_path,
                    json={**body, "deadline_ts": time.time() + 30},
                    headers=headers,
                )
                assert resumed.status_code == 200, resumed.text

        anyio.run(run)
        events = anyio.run(read_events, ledger_url)
    reads = [
        ev.data["body"]["query"]
        for ev in events
        if ev.kind == "call.sent" and ev.data["path"].endswith("/agent-checkpoint/status")
    ]
    assert reads == [{"checkpoint_id": checkpoint_id}]
