"""The coordinator against reference servers that behave as real NeMo Gym does (issue 18).

Each test drives real uvicorn gymsim servers and checks the ledger, the servers' control logs and
the snapshot: a drain of several seconds whose status replies name no rollout and `plane: null`;
a finished rollout nobody acknowledged, named, acknowledged, then saved; a restored storage
reference index that differs from the committed one; `restart_only` servers left alone; Gym's
multi-worker coordinator; a drain-only policy model; replies naming another checkpoint; a later
Gym that always returns the index; and the honest words of a rollback.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator import Coordinator, PhaseError, load_snapshot
from quiesce.coordinator.errors import AcknowledgementError, ConfigError, DeadlineExceeded, SnapshotError
from quiesce.coordinator.protocol import sha256_hex
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.agent import AgentServer
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import SpecLike
from tests.coordinator.helpers import (
    assert_all_accepting,
    assert_protocol_ok,
    clear_faults,
    control_log,
    control_logs,
    read_events,
    routes_by_server,
    server_states,
    set_faults,
)
from tests.hostile.helpers import run_cli

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

MakeCluster = Callable[[SpecLike], AbstractContextManager[RunningCluster]]


def spec(model: dict[str, Any] | None = None, *extra: dict[str, Any]) -> dict[str, Any]:
    """The seed's example with its policy model changed by `model`, plus `extra` servers."""
    return {
        "servers": [
            {"kind": "model", "name": "policy_model", **(model or {})},
            {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
            {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
            {"kind": "resources", "name": "tools", "judge": "judge"},
            *extra,
        ]
    }


async def latency(http: httpx.AsyncClient, url: str, seconds: float) -> None:
    (await http.post(f"{url}/gymsim/admin/options", json={"latency_s": seconds})).raise_for_status()


async def outcome(ledger_url: str, checkpoint_id: str) -> str | None:
    events = await read_events(ledger_url, checkpoint_id)
    ends = [ev for ev in events if ev.kind in ("attempt.completed", "attempt.aborted")]
    return str(ends[-1].data.get("outcome", "aborted")) if ends else None


# -- draining -----------------------------------------------------------------------------------


async def test_a_drain_of_several_seconds_with_anonymous_calls_publishes(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    with make_cluster(spec()) as running:
        model = running.urls["policy_model"]
        config = configure(running, ledger_url)
        async with (
            httpx.AsyncClient(timeout=60) as http,
            Coordinator.open(config) as coord,
            anyio.create_task_group() as tg,
        ):
            await coord.discover()
            await latency(http, model, 3.0)
            answers: list[int] = []

            async def anonymous() -> None:  # no rollout headers, no x-nemo-gym-plane: real Gym says null
                answers.append((await http.post(model + "/v1/responses", json={"input": "hi"})).status_code)

            for _ in range(3):
                tg.start_soon(anonymous)
            while (await http.get(model + "/gymsim/admin/state")).json()["inflight_total"] != 3:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            attempt = await coord.checkpoint(deadline_s=60)
        assert answers == [200, 200, 200]
        assert attempt.snapshot is not None
        assert await outcome(ledger_url, attempt.checkpoint_id) == "published"
        events = await read_events(ledger_url, attempt.checkpoint_id)
        sent = {ev.call_id: ev for ev in events if ev.kind == "call.sent"}
        polls = [
            ev
            for ev in events
            if ev.kind == "call.replied" and sent[ev.call_id].data["path"].endswith("/model-admission/status")
        ]
        anonymous_polls = [p for p in polls if p.data["body"]["inflight"]]
        assert len(anonymous_polls) >= 2  # the drain outlasted more than one poll, each accepted
        for poll in anonymous_polls:
            assert {
                (e["rollout_id"], e["attempt_index"], e["plane"]) for e in poll.data["body"]["inflight"]
            } == {(None, None, None)}
        assert polls[-1].data["body"]["state"] == "paused"
    await assert_protocol_ok(ledger_url)


# -- completed results --------------------------------------------------------------------------


def _calls(events: list[Any], path: str) -> list[Any]:
    """The `call.sent` events of `events` whose path ends with `path`."""
    return [ev for ev in events if ev.kind == "call.sent" and ev.data["path"].endswith(path)]


async def _hang_model_call(http: httpx.AsyncClient, running: RunningCluster, rollout_id: str) -> None:
    """Start `rollout_id` with its first model call hanging (in flight) until the faults are cleared:
    the agent cannot park it, so its prepare has work in flight besides any finished result."""
    model, agent = running.urls["policy_model"], running.urls["simple_agent"]
    await set_faults(http, model, [{"kind": "hang", "path": "/v1/responses", "rollout_id": rollout_id}])
    await client.start_rollouts(http, agent, {rollout_id: 100_000})
    while (await http.get(f"{model}/gymsim/admin/state")).json()["inflight_total"] != 1:  # noqa: ASYNC110
        await anyio.sleep(0.01)


async def test_a_prepare_blocked_only_by_unacknowledged_results_fails_at_once_then_saves_once_acknowledged(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # 23 finished results nobody acknowledged, and a long rollout the prepare parks: nothing but
    # those results keeps the agent from being ready, so the save fails at its first refusal — one
    # failed call, one status read, far before its deadline — naming the first 20 and the count,
    # and saying how to acknowledge them. Acknowledged, the next save publishes.
    done = {f"d{i:02d}": 1 for i in range(23)}
    with make_cluster(spec({"latency_s": 0.01})) as running:
        agent = running.urls["simple_agent"]
        config = configure(running, ledger_url)
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {**done, "long": 100_000})
            await client.wait_until(http, agent, lambda rs: all(rs[r]["status"] == "completed" for r in done))
            async with Coordinator.open(config) as coord:
                await coord.discover()
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=120)
                failed = caught.value
                await assert_all_accepting(http, running)  # rolled back as usual
                assert await coord.acknowledge_completed("simple_agent", [(r, 0) for r in done]) == [
                    (r, 0) for r in done
                ]
                attempt = await coord.checkpoint(deadline_s=30)
            views = await client.get_rollouts(http, agent)
        assert not isinstance(failed, DeadlineExceeded), str(failed)
        assert (failed.phase, failed.server, failed.code) == (
            "prepare",
            "simple_agent",
            "agent_prepare_incomplete",
        )
        text = " ".join(str(failed).split())
        first = " ".join(f"{r}:0" for r in sorted(done)[:20])
        assert f"23 finished rollout results nobody has acknowledged: {first} and 3 more" in text
        assert "no retry can succeed until they are" in text
        assert "await coord.acknowledge_completed('simple_agent', [('d00', 0)," in text
        assert f"quiesce acknowledge --config CONFIG simple_agent {first}" in text
        assert "d20:0" not in text  # past the first 20: counted, not named
        events = await read_events(ledger_url, failed.checkpoint_id)
        assert len(_calls(events, "/agent-checkpoint/prepare")) == 1
        assert len(_calls(events, "/agent-checkpoint/status")) == 1  # the read that named them
        assert [(ev.server, ev.data["code"]) for ev in events if ev.kind == "call.failed"] == [
            ("simple_agent", "agent_prepare_incomplete")
        ]
        [phase_failed] = [ev for ev in events if ev.kind == "phase.failed"]
        assert phase_failed.data["reason"] == failed.reason
        assert await outcome(ledger_url, failed.checkpoint_id or "") == "aborted"
        assert all(views[r]["acknowledged"] for r in done)
        assert await outcome(ledger_url, attempt.checkpoint_id) == "published"
        acks = [ev for ev in await read_events(ledger_url) if ev.call_id and "-acknowledge/" in ev.call_id]
        assert [ev.kind for ev in acks] == ["call.sent", "call.replied"]  # recorded before and after
        assert acks[0].data["body"] == {
            "schema_version": 1,
            "executions": [{"rollout_id": r, "attempt_index": 0} for r in done],
        }
        assert acks[0].data["path"] == "/ng-control/v1/agent-checkpoint/acknowledge-completed"
        snapshot = load_snapshot(attempt.snapshot or Path())
        records = snapshot.participant("simple_agent")
        assert records is not None
        assert records["reply"]["records"] == 1  # only "long": an acknowledged result is not saved
    await assert_protocol_ok(ledger_url)


async def test_a_prepare_blocked_also_by_work_in_flight_waits_and_reads_the_held_results_once(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # A finished result nobody acknowledged, and a rollout whose model call hangs: the agent may
    # still become ready once that call ends, so the prepare keeps asking until the deadline —
    # but the held result, the same at every refusal, is read once and counted once.
    with make_cluster(spec({"latency_s": 0.01})) as running:
        agent = running.urls["simple_agent"]
        config = configure(running, ledger_url)
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"done": 1})
            await client.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            await _hang_model_call(http, running, "stuck")
            async with Coordinator.open(config) as coord:
                await coord.discover()
                with pytest.raises(DeadlineExceeded) as caught:
                    await coord.checkpoint(deadline_s=3)
            await clear_faults(http, running)
            await assert_all_accepting(http, running)
        failed = caught.value
        assert (failed.phase, failed.server, failed.code) == (
            "prepare",
            "simple_agent",
            "agent_prepare_incomplete",
        )
        text = " ".join(str(failed).split())
        assert "running=1" in text  # the work in flight, from the agent's last refusal
        assert "1 finished rollout result nobody has acknowledged: done:0" in text
        assert "quiesce acknowledge --config CONFIG simple_agent done:0" in text
        events = await read_events(ledger_url, failed.checkpoint_id)
        prepares = _calls(events, "/agent-checkpoint/prepare")
        failures = [ev for ev in events if ev.kind == "call.failed"]
        # the agent's own prepare waits within the budget for its rollouts to park: a few refusals
        assert 1 <= len(prepares) <= 3, len(prepares)
        assert len(failures) <= len(prepares)
        assert len(_calls(events, "/agent-checkpoint/status")) == 1  # the same blocker, read once
    await assert_protocol_ok(ledger_url)


async def test_a_parallel_prepare_names_every_agent_that_holds_an_unacknowledged_result(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # Two agents, fan-out parallel, each holding a finished result nobody acknowledged: the error
    # names the first (its code) and the other one with what it holds, so one acknowledgement
    # round fixes both instead of one failed checkpoint per agent.
    second = {"kind": "agent", "name": "second_agent", "policy": "policy_model", "resources": "tools"}
    with make_cluster(spec({"latency_s": 0.01}, second)) as running:
        config = configure(running, ledger_url, fanout="parallel")
        async with httpx.AsyncClient(timeout=60) as http:
            for name in ("simple_agent", "second_agent"):
                url = running.urls[name]
                await client.start_rollouts(http, url, {"done": 1, "long": 100_000})
                await client.wait_until(http, url, lambda rs: rs["done"]["status"] == "completed")
            async with Coordinator.open(config) as coord:
                await coord.discover()
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=3)
            await assert_all_accepting(http, running)
        failed = caught.value
        assert (failed.phase, failed.server, failed.code) == (
            "prepare",
            "simple_agent",
            "agent_prepare_incomplete",
        ), str(failed)
        text = str(failed)
        assert "quiesce acknowledge --config CONFIG simple_agent done:0" in text
        assert "also: second_agent:" in text
        assert "quiesce acknowledge --config CONFIG second_agent done:0" in text
        phase_failed = [
            ev for ev in await read_events(ledger_url, failed.checkpoint_id) if ev.kind == "phase.failed"
        ]
        [recorded] = phase_failed
        assert "second_agent" in recorded.data["reason"]
    await assert_protocol_ok(ledger_url)


async def test_a_retry_cut_short_by_the_deadline_still_names_the_unacknowledged_result(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # The agent's first refusal says nothing readable (an injected 409); its status shows a finished
    # result nobody acknowledged and a rollout still running, so the prepare asks again — and that
    # retry hangs until the deadline ends the phase in the middle of it. The error is still the
    # agent's last refusal, with the result its status named. The long rollout is held inside a
    # model call (a hang on its next `/v1/responses`, fired before the save starts) until the end,
    # so every status read finds it running, however slow the machine: a read that found it
    # blocked by the paused model would show nothing running, and the prepare would rightly fail
    # at once without a retry (it did, once, under CI load, when a model latency kept it there).
    with make_cluster(spec({"latency_s": 0.05})) as running:
        agent = running.urls["simple_agent"]
        model = running.urls["policy_model"]
        config = configure(running, ledger_url)
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"done": 1, "long": 100_000})
            await client.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            hang = {"kind": "hang", "path": "/v1/responses", "rollout_id": "long", "times": 1}
            await set_faults(http, model, [hang])

            async def held() -> bool:
                faults = (await http.get(f"{model}/gymsim/admin/faults")).json()["faults"]
                return bool(faults[0]["left"] == 0)

            give_up = time.monotonic() + 60
            while not await held():
                assert time.monotonic() < give_up, "the long rollout never made its next model call"
                await anyio.sleep(0.02)
            prepare = {"path": "/agent-checkpoint/prepare", "method": "POST"}
            await set_faults(
                http,
                agent,
                [
                    {
                        "kind": "fail",
                        **prepare,
                        "status": 409,
                        "code": "agent_prepare_incomplete",
                        "times": 1,
                    },
                    {"kind": "hang", **prepare},
                ],
            )
            async with Coordinator.open(config) as coord:
                await coord.discover()
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=8)
            await set_faults(http, agent, [])  # releases the hung prepare
            await set_faults(http, model, [])  # and the long rollout's model call
            await assert_all_accepting(http, running)
        failed = caught.value
        assert (failed.phase, failed.server, failed.code) == (
            "prepare",
            "simple_agent",
            "agent_prepare_incomplete",
        )
        text = str(failed)
        assert "1 finished rollout result nobody has acknowledged: done:0" in text
        assert "await coord.acknowledge_completed('simple_agent', [('done', 0)])" in text
        assert "quiesce acknowledge --config CONFIG simple_agent done:0" in text
        events = await read_events(ledger_url, failed.checkpoint_id)
        prepares = {ev.call_id for ev in _calls(events, "/agent-checkpoint/prepare")}
        assert len(prepares) == 2  # the refused one and the one the deadline cut
        outcomes = [ev for ev in events if ev.call_id in prepares and ev.kind != "call.sent"]
        # the last prepare was cut by the deadline (its outcome: a timeout), or has no outcome at all
        cut = len(outcomes) < len(prepares) or outcomes[-1].data.get("error") == "timeout"
        assert cut, [(ev.kind, ev.data.get("status"), ev.data.get("error")) for ev in outcomes]
        phase_failed = [ev for ev in events if ev.kind == "phase.failed"]
        assert [(ev.server, ev.data["code"]) for ev in phase_failed] == [
            ("simple_agent", "agent_prepare_incomplete")
        ]
    await assert_protocol_ok(ledger_url)


async def test_an_acknowledgement_while_other_work_drains_lets_the_prepare_succeed(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # A finished result nobody acknowledged, and a rollout whose model call hangs: the prepare waits
    # for that rollout (it may still park). The trainer acknowledges the result meanwhile, the call
    # ends, the rollout parks: the same save publishes, without a refusal counted for the result.
    with make_cluster(spec({"latency_s": 0.01})) as running:
        agent, model = running.urls["simple_agent"], running.urls["policy_model"]
        config = configure(running, ledger_url)
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"done": 1})
            await client.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            await _hang_model_call(http, running, "stuck")
            async with Coordinator.open(config) as coord:
                await coord.discover()
                results: list[Any] = []

                async def save() -> None:
                    results.append(await coord.checkpoint(deadline_s=60))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(save)
                    while (await http.get(f"{model}/gymsim/admin/state")).json()["phase"] == "idle":  # noqa: ASYNC110
                        await anyio.sleep(0.02)  # the model is paused: the agent's prepare comes next
                    await coord.acknowledge_completed("simple_agent", [("done", 0)])  # as the trainer would
                    await clear_faults(http, running)  # the hung call ends; its rollout parks
            await assert_all_accepting(http, running)
        assert await outcome(ledger_url, results[0].checkpoint_id) == "published"
        events = await read_events(ledger_url, results[0].checkpoint_id)
        refused = [(ev.server, ev.data.get("code")) for ev in events if ev.kind == "call.failed"]
        assert refused == []  # the prepare waited for the rollout, and found the result released
    await assert_protocol_ok(ledger_url)


async def test_acknowledging_is_refused_before_anything_is_sent_when_it_cannot_apply(
    cluster: RunningCluster, ledger_url: str, configure: Any
) -> None:
    config = configure(cluster, ledger_url)
    async with Coordinator.open(config) as coord:
        await coord.discover()
        with pytest.raises(ConfigError, match="no server 'nobody' in the config"):
            await coord.acknowledge_completed("nobody", [("r", 0)])
        with pytest.raises(ConfigError, match="does not declare the completed_result_acknowledgement"):
            await coord.acknowledge_completed("math_agent", [("r", 0)])  # stateless: holds nothing
        with pytest.raises(ConfigError, match="executions"):
            await coord.acknowledge_completed("simple_agent", [])
        with pytest.raises(ConfigError, match="unique"):
            await coord.acknowledge_completed("simple_agent", [("r", 0), ("r", 0)])
        with pytest.raises(ConfigError, match="rollout_id"):
            await coord.acknowledge_completed("simple_agent", [("-r", 0)])
        # sent and refused: the agent holds no such result
        with pytest.raises(AcknowledgementError, match="completed_execution_acknowledgement_error") as caught:
            await coord.acknowledge_completed("simple_agent", [("never", 0)])
        assert (caught.value.status, caught.value.code) == (409, "completed_execution_acknowledgement_error")
    async with httpx.AsyncClient() as http:
        acks = [
            e for e in await control_log(http, cluster.urls["simple_agent"]) if "acknowledge" in e["path"]
        ]
        assert [(e["status"], e["authorized"]) for e in acks] == [
            (409, True)
        ]  # only the one that could apply


async def test_a_reply_that_acknowledges_another_set_is_a_failed_call(
    make_cluster: MakeCluster, ledger_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = AgentServer._acknowledge

    async def partial(self: AgentServer, body: Any) -> dict[str, Any]:
        reply = await original(self, body)
        return {"acknowledged": reply["acknowledged"][:1]}  # drops the second execution

    monkeypatch.setattr(AgentServer, "_acknowledge", partial)
    with make_cluster(spec({"latency_s": 0.001})) as running:
        agent = running.urls["simple_agent"]
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"a": 1, "b": 1})
            await client.wait_finished(http, agent, expect=2)
        async with Coordinator.open(configure(running, ledger_url)) as coord:
            with pytest.raises(AcknowledgementError, match="not exactly the requested a:0, b:0"):
                await coord.acknowledge_completed("simple_agent", [("a", 0), ("b", 0)])
    failed = [ev for ev in await read_events(ledger_url) if ev.kind == "call.failed"]
    assert [ev.data["error"] for ev in failed] == ["protocol"]  # recorded as a failed call


def _receipt_agent() -> dict[str, Any]:
    """The seed's example whose agent is later Gym's: it acknowledges by completion receipt."""
    document = spec({"latency_s": 0.01})
    for server in document["servers"]:
        if server["name"] == "simple_agent":
            server["acknowledgement"] = "receipt"
    return document


async def test_a_later_gym_agent_is_acknowledged_by_the_receipts_of_its_results(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # later Gym answers the bare pairs with 422 (nothing released): the coordinator reads each
    # result's completion receipt (recorded GETs), acknowledges with them, and from then on sends
    # that agent receipts directly
    with make_cluster(_receipt_agent()) as running:
        agent = running.urls["simple_agent"]
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"done": 1, "long": 100_000})
            await client.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            async with Coordinator.open(configure(running, ledger_url)) as coord:
                await coord.discover()
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=2)
                assert "quiesce acknowledge --config CONFIG simple_agent done:0" in str(caught.value)
                assert await coord.acknowledge_completed("simple_agent", [("done", 0)]) == [("done", 0)]
                await client.start_rollouts(http, agent, {"next": 1})
                await client.wait_until(http, agent, lambda rs: rs["next"]["status"] == "completed")
                assert await coord.acknowledge_completed("simple_agent", [("next", 0)]) == [("next", 0)]
                attempt = await coord.checkpoint(deadline_s=30)
            views = await client.get_rollouts(http, agent)
            assert (views["done"]["acknowledged"], views["next"]["acknowledged"]) == (True, True)
            await assert_all_accepting(http, running)
        assert await outcome(ledger_url, attempt.checkpoint_id) == "published"
    events = [ev for ev in await read_events(ledger_url) if ev.call_id and "-acknowledge/" in ev.call_id]
    sent = [ev for ev in events if ev.kind == "call.sent"]
    outcomes = {ev.call_id: ev for ev in events if ev.kind != "call.sent"}
    steps = [
        (ev.data["method"], ev.data["path"].rsplit("/", 1)[-1], outcomes[ev.call_id].kind) for ev in sent
    ]
    assert steps == [
        ("POST", "acknowledge-completed", "call.failed"),  # the pair: 422
        ("GET", "completion-receipt", "call.replied"),
        ("POST", "acknowledge-completed", "call.replied"),  # the receipt
        ("GET", "completion-receipt", "call.replied"),  # the next one: receipts at once
        ("POST", "acknowledge-completed", "call.replied"),
    ]
    assert outcomes[sent[0].call_id].data["status"] == 422
    assert sent[0].data["body"]["executions"] == [{"rollout_id": "done", "attempt_index": 0}]
    served = outcomes[sent[1].call_id].data["body"]
    assert sent[2].data["body"]["executions"] == [served]  # exactly the receipt the agent gave
    assert (served["rollout_id"], served["attempt_index"]) == ("done", 0)
    await assert_protocol_ok(ledger_url)


async def test_a_receipt_that_names_another_result_is_never_sent(
    make_cluster: MakeCluster, ledger_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hostile agent answers the receipt of another held result: acknowledging with it would
    # release what the trainer never received, so the coordinator refuses it and sends nothing
    original = AgentServer._receipt

    async def swapped(self: AgentServer, q: Any) -> dict[str, Any]:
        return await original(self, q.model_copy(update={"rollout_id": "other"}))

    monkeypatch.setattr(AgentServer, "_receipt", swapped)
    with make_cluster(_receipt_agent()) as running:
        agent = running.urls["simple_agent"]
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"done": 1, "other": 1})
            await client.wait_finished(http, agent, expect=2)
            async with Coordinator.open(configure(running, ledger_url)) as coord:
                await coord.discover()
                with pytest.raises(AcknowledgementError, match="the receipt of other:0, not of done:0"):
                    await coord.acknowledge_completed("simple_agent", [("done", 0)])
            views = await client.get_rollouts(http, agent)
            assert (views["done"]["acknowledged"], views["other"]["acknowledged"]) == (False, False)
    acks = [
        ev
        for ev in await read_events(ledger_url)
        if ev.kind == "call.sent" and ev.call_id and ev.data["path"].endswith("/acknowledge-completed")
    ]
    assert [ev.data["body"]["executions"] for ev in acks] == [[{"rollout_id": "done", "attempt_index": 0}]]
    await assert_protocol_ok(ledger_url)


async def test_a_refused_pair_without_a_receipt_route_reports_the_refusal(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # the anchor's agent has no receipt route and shows no receipt in its status: a 422 to the
    # pairs stays the error (nothing released)
    with make_cluster(spec({"latency_s": 0.001})) as running:
        agent = running.urls["simple_agent"]
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {"done": 1})
            await client.wait_until(http, agent, lambda rs: rs["done"]["status"] == "completed")
            await set_faults(
                http,
                agent,
                [{"kind": "fail", "path": "/agent-checkpoint/acknowledge-completed", "status": 422}],
            )
            async with Coordinator.open(configure(running, ledger_url)) as coord:
                with pytest.raises(
                    AcknowledgementError, match="did not acknowledge done:0: http 422"
                ) as caught:
                    await coord.acknowledge_completed("simple_agent", [("done", 0)])
            assert caught.value.status == 422
            views = await client.get_rollouts(http, agent)
            assert views["done"]["acknowledged"] is False
    paths = [
        (ev.data["method"], ev.data["path"].rsplit("/", 1)[-1])
        for ev in await read_events(ledger_url)
        if ev.kind == "call.sent" and ev.call_id and "-acknowledge/" in ev.call_id
    ]
    # no discovery ran: the agent's features are read first (a recorded GET too)
    assert paths == [
        ("GET", "capabilities"),
        ("POST", "acknowledge-completed"),
        ("GET", "completion-receipt"),  # 404: no route
        ("GET", "capabilities"),  # the status read names the active checkpoint id, if any
        ("GET", "status"),  # no completion_receipt in any entry
    ]
    await assert_protocol_ok(ledger_url)


# -- restore ------------------------------------------------------------------------------------


def _retamper_index(snapshot: Path) -> None:
    """Swap in a model folder that is consistent on its own — its storage index file, the index
    named in its manifest, the snapshot's file list and the model's manifest digest all agree —
    but whose index is not the one committed: the restored index will differ from the committed."""
    folder = snapshot / "model-ledger" / "policy_model"
    index_file = folder / "storage-references.jsonl"
    lines = index_file.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 2
    index_file.write_bytes(b"".join(lines[:-1]))
    data = index_file.read_bytes()
    model_manifest = json.loads((folder / "manifest.json").read_bytes())
    model_manifest["storage_reference_index"].update(
        sha256=sha256_hex(data), bytes=len(data), records=len(lines) - 1
    )
    (folder / "manifest.json").write_text(json.dumps(model_manifest, sort_keys=True) + "\n")
    manifest_file = snapshot / "manifest.json"
    manifest = json.loads(manifest_file.read_bytes())
    for entry in manifest["files"]:
        path = snapshot / entry["path"]
        if entry["path"].startswith("model-ledger/"):
            entry.update(bytes=path.stat().st_size, sha256=sha256_hex(path.read_bytes()))
    model = next(p for p in manifest["participants"] if p["name"] == "policy_model")
    model["manifest_digest"] = sha256_hex((folder / "manifest.json").read_bytes())
    manifest_file.write_text(json.dumps(manifest, sort_keys=True, indent=1))


async def _saved_mid_rollout(running: RunningCluster, config: Any) -> Path:
    agent = running.urls["simple_agent"]
    async with httpx.AsyncClient(timeout=60) as http:
        await latency(http, running.urls["policy_model"], 0.01)
        await client.start_rollouts(http, agent, {f"r{i}": 100_000 for i in range(3)})
        await client.wait_turns(http, agent, 2)
    async with Coordinator.open(config) as coord:
        await coord.discover()
        attempt = await coord.checkpoint(deadline_s=30)
    assert attempt.snapshot is not None
    return attempt.snapshot


def _another_ledger(ledger_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A second, empty ledger on the same backend as `ledger_url`."""
    if ledger_url.startswith("sqlite"):
        return f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"
    return str(request.getfixturevalue("postgres").create_database(f"t_{uuid.uuid4().hex[:20]}"))


async def test_a_restored_storage_index_that_differs_fails_the_restore_with_nothing_resumed(
    make_cluster: MakeCluster, ledger_url: str, configure: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    with make_cluster(spec()) as first:
        snapshot = await _saved_mid_rollout(first, configure(first, ledger_url))
    committed = load_snapshot(snapshot).participant("policy_model")
    assert committed is not None
    index = committed["storage_reference_index"]  # recorded in the snapshot manifest...
    assert index["relative_path"] == "model-ledger/policy_model/storage-references.jsonl"
    assert index["records"] >= 3  # each parked rollout's staging rows
    summary = next(
        ev.data["summary"]
        for ev in await read_events(ledger_url, snapshot.name)
        if ev.kind == "phase.completed" and ev.data["phase"] == "commit"
    )
    assert summary["policy"]["policy_model"]["storage_reference_index"] == index  # ...and in the ledger
    _retamper_index(snapshot)
    with make_cluster(spec()) as fresh:
        # the ledger that published it knows the manifest's digest: refused before any server is asked
        async with Coordinator.open(configure(fresh, ledger_url)) as coord:
            with pytest.raises(SnapshotError, match="not the one the ledger recorded"):
                await coord.restore(snapshot)
        # a ledger that never saw it can only warn; then the restored index gives the forgery away
        ledger_url = _another_ledger(ledger_url, request, tmp_path)
        async with Coordinator.open(configure(fresh, ledger_url)) as coord:
            await coord.discover()
            with pytest.raises(PhaseError) as caught:
                await coord.restore(snapshot)
        error = caught.value
        assert (error.phase, error.server) == ("restore", "policy_model")
        assert "its restored storage_reference_index differs from the one committed in the snapshot" in str(
            error
        )
        assert error.resumed == []
        async with httpx.AsyncClient() as http:
            logs = await control_logs(http, fresh)
            states = await server_states(http, fresh)
        assert not any(e["path"].endswith("/resume") for log in logs.values() for e in log)  # nothing resumed
        assert states["policy_model"] == ("restored_paused", "paused")  # left paused: must not run
        assert routes_by_server(logs["simple_agent"]) == ["GET /capabilities"]  # never reached
        events = await read_events(ledger_url, error.checkpoint_id)
        aborted = next(ev for ev in events if ev.kind == "attempt.aborted")
        assert (aborted.data["resumed"], aborted.data["left_paused"]) == ([], ["policy_model"])
        restore_sent = [ev for ev in events if ev.kind == "call.sent" and ev.server == "policy_model"]
        assert restore_sent[0].data["body"]["include_storage_reference_index"] is True  # the anchor's opt-in


async def test_a_later_gym_that_refuses_the_opt_in_is_restored_without_it(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    later = spec({"restore_index": "always"})
    with make_cluster(later) as first:
        snapshot = await _saved_mid_rollout(first, configure(first, ledger_url))
    with make_cluster(later) as fresh:
        async with Coordinator.open(configure(fresh, ledger_url)) as coord:
            await coord.discover()
            restored = await coord.restore(snapshot)
            await coord.resume()
        events = await read_events(ledger_url, restored.checkpoint_id)
        model_calls = [ev for ev in events if ev.server == "policy_model" and ev.kind.startswith("call.")]
        first_call, retry = model_calls[0], model_calls[2]
        assert first_call.data["body"]["include_storage_reference_index"] is True
        assert model_calls[1].kind == "call.failed"
        assert model_calls[1].data["status"] == 422
        assert "include_storage_reference_index" not in retry.data["body"]
        assert model_calls[3].kind == "call.replied"
        committed = load_snapshot(snapshot).participant("policy_model")
        assert committed is not None
        assert model_calls[3].data["body"]["storage_reference_index"] == committed["storage_reference_index"]
        async with httpx.AsyncClient() as http:
            await assert_all_accepting(http, fresh)
    await assert_protocol_ok(ledger_url)


async def test_a_policy_model_paused_by_a_generation_cut_fails_the_prepare_at_once(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    # later Gym with a generation-cut backend: the pause cuts the call in flight and holds its
    # response until resume — the model never drains, so the prepare fails at once (not at the
    # deadline), saying why, and the rollback's resume releases the held response
    with make_cluster(spec({"generation_cut": True, "latency_s": 0.01})) as running:
        agent, model = running.urls["simple_agent"], running.urls["policy_model"]
        async with httpx.AsyncClient(timeout=60) as http:
            await set_faults(http, model, [{"kind": "hang", "path": "/v1/responses", "rollout_id": "cut"}])
            await client.start_rollouts(http, agent, {"cut": 3, "free": 100_000})
            while (await http.get(f"{model}/gymsim/admin/state")).json()["inflight_total"] == 0:  # noqa: ASYNC110
                await anyio.sleep(0.01)  # the hung call of "cut" is in flight
            async with Coordinator.open(configure(running, ledger_url)) as coord:
                await coord.discover()
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=60)
            failed = caught.value
            assert (failed.phase, failed.server) == ("prepare", "policy_model")
            assert not isinstance(failed, DeadlineExceeded)  # at once, not at the deadline
            assert "paused by a generation cut" in str(failed)
            assert "without a generation-cut backend" in str(failed)
            await assert_all_accepting(http, running)
            before = (await client.get_rollouts(http, agent))["free"]["turns_done"]
            await http.delete(f"{model}/gymsim/admin/faults")
            await client.wait_until(http, agent, lambda rs: rs["cut"]["status"] == "completed")
            await client.wait_until(http, agent, lambda rs: rs["free"]["turns_done"] > before)
    events = await read_events(ledger_url, failed.checkpoint_id)
    [pause] = [ev for ev in events if ev.kind == "call.replied" and ev.data.get("status") == 200][:1]
    assert pause.server == "policy_model"
    assert pause.data["body"]["generation_pending_total"] == 0
    assert pause.data["body"]["generation_cut_proof"] is not None
    assert [ev.server for ev in events if ev.kind == "call.sent" and ev.data["phase"] == "prepare"] == [
        "policy_model"
    ]  # nothing after the pause
    assert await outcome(ledger_url, failed.checkpoint_id or "") == "aborted"
    await assert_protocol_ok(ledger_url)


# -- discovery and participation ----------------------------------------------------------------


async def test_restart_only_servers_get_no_post(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    cluster_spec = spec(
        None,
        {
            "kind": "agent",
            "name": "restart_agent",
            "checkpoint_mode": "restart_only",
            "policy": "policy_model",
        },
        {"kind": "resources", "name": "restart_tools", "checkpoint_mode": "restart_only"},
    )
    with make_cluster(cluster_spec) as running:
        async with Coordinator.open(configure(running, ledger_url)) as coord:
            found = await coord.discover()
            attempt = await coord.checkpoint(deadline_s=30)
        skipped = dict(found.skipped)
        for name in ("restart_agent", "restart_tools"):
            assert "restart_only" in skipped[name]
            assert "takes part in no phase" in skipped[name]
        assert found.refused == ()
        assert await outcome(ledger_url, attempt.checkpoint_id) == "published"
        async with httpx.AsyncClient() as http:
            for name in ("restart_agent", "restart_tools"):
                assert routes_by_server(await control_log(http, running.urls[name])) == ["GET /capabilities"]


async def test_a_restart_only_policy_model_is_skipped_without_refusing_the_setup(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    with make_cluster(spec({"checkpoint_mode": "restart_only"})) as running:
        async with Coordinator.open(configure(running, ledger_url)) as coord:
            found = await coord.discover()
            attempt = await coord.checkpoint(deadline_s=30)
        assert "policy_model" not in found.names
        assert found.refused == ()
        assert await outcome(ledger_url, attempt.checkpoint_id) == "published"
        async with httpx.AsyncClient() as http:
            assert routes_by_server(await control_log(http, running.urls["policy_model"])) == [
                "GET /capabilities"
            ]


async def test_a_two_worker_coordinator_mode_policy_model_drains_and_publishes(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    with make_cluster(spec({"workers": 2, "worker_mode": "coordinator", "latency_s": 0.3})) as running:
        agent = running.urls["simple_agent"]
        async with httpx.AsyncClient(timeout=60) as http:
            await client.start_rollouts(http, agent, {f"r{i}": 100_000 for i in range(4)})
            await client.wait_turns(http, agent, 1)
            async with Coordinator.open(configure(running, ledger_url)) as coord:
                found = await coord.discover()
                assert found.refused == ()
                attempt = await coord.checkpoint(deadline_s=60)
                assert await outcome(ledger_url, attempt.checkpoint_id) == "published"
                events = await read_events(ledger_url, attempt.checkpoint_id)
                sent = {ev.call_id: ev for ev in events if ev.kind == "call.sent"}
                polls = [
                    ev.data["body"]
                    for ev in events
                    if ev.kind == "call.replied"
                    and sent[ev.call_id].data["path"].endswith("/model-admission/status")
                ]
                assert polls[-1]["state"] == "paused"
                assert polls[-1]["workers"] == {"acknowledged": 2, "expected": 2, "live": 2}
                assert "checkpoint_id" not in polls[-1]  # Gym's coordinator names none
                # a lost worker: the pause is refused, naming the missing worker
                await http.post(running.urls["policy_model"] + "/gymsim/admin/workers", json={"connected": 1})
                with pytest.raises(PhaseError) as caught:
                    await coord.checkpoint(deadline_s=30)
            assert caught.value.code == "missing_workers"
            assert "not every worker is connected" in str(caught.value)
            assert "missing: 1" in str(caught.value)
            await assert_all_accepting(http, running)
    await assert_protocol_ok(ledger_url)


async def test_a_drain_only_policy_model_is_paused_and_resumed_but_never_committed(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    drain_only = spec({"checkpoint_mode": "stateless"})
    with make_cluster(drain_only) as first:
        snapshot = await _saved_mid_rollout(first, configure(first, ledger_url))
        async with httpx.AsyncClient() as http:
            model_log = routes_by_server(await control_log(http, first.urls["policy_model"]))
            await assert_all_accepting(http, first)
    assert model_log[:2] == ["GET /capabilities", "POST /model-admission/pause"]
    assert "POST /model-admission/resume" in model_log
    assert not any("model-checkpoint" in r for r in model_log)
    saved = load_snapshot(snapshot)
    assert saved.participant("policy_model") is None
    assert not (snapshot / "model-ledger").exists()
    with make_cluster(drain_only) as fresh:
        async with Coordinator.open(configure(fresh, ledger_url)) as coord:
            await coord.discover()
            restored = await coord.restore(snapshot)
            await coord.resume()
        assert "policy_model" not in restored.names
        async with httpx.AsyncClient() as http:
            assert routes_by_server(await control_log(http, fresh.urls["policy_model"])) == [
                "GET /capabilities"
            ]
            await assert_all_accepting(http, fresh)
    await assert_protocol_ok(ledger_url)  # each attempt alone too: the model's resume is by design
    shown = await anyio.to_thread.run_sync(
        lambda: run_cli("show", snapshot.name, "--ledger", ledger_url, "--json")
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["check"]["violations"] == []


# -- replies about another checkpoint, and honest rollbacks --------------------------------------


async def test_a_status_reply_naming_another_checkpoint_is_a_failed_call(
    cluster: RunningCluster, ledger_url: str, configure: Any
) -> None:
    async with httpx.AsyncClient() as http:
        await set_faults(
            http, cluster.urls["policy_model"], [{"kind": "foreign_id", "path": "/model-admission/status"}]
        )
        async with Coordinator.open(configure(cluster, ledger_url)) as coord:
            await coord.discover()
            with pytest.raises(PhaseError) as caught:
                await coord.checkpoint(deadline_s=30)
        assert (caught.value.phase, caught.value.server) == ("prepare", "policy_model")
        assert "the reply names checkpoint 'foreign-checkpoint'" in str(caught.value)
        await assert_all_accepting(http, cluster)
    failed = [
        ev for ev in await read_events(ledger_url, caught.value.checkpoint_id) if ev.kind == "call.failed"
    ]
    assert [(ev.server, ev.data["error"]) for ev in failed] == [("policy_model", "protocol")]
    assert await outcome(ledger_url, caught.value.checkpoint_id or "") == "aborted"


async def test_a_restore_reply_naming_another_checkpoint_fails_the_restore(
    make_cluster: MakeCluster, ledger_url: str, configure: Any
) -> None:
    with make_cluster(spec()) as first:
        snapshot = await _saved_mid_rollout(first, configure(first, ledger_url))
    with make_cluster(spec()) as fresh:
        async with httpx.AsyncClient() as http:
            await set_faults(
                http,
                fresh.urls["simple_agent"],
                [{"kind": "foreign_id", "path": "/agent-checkpoint/restore"}],
            )
            async with Coordinator.open(configure(fresh, ledger_url)) as coord:
                await coord.discover()
                with pytest.raises(PhaseError) as caught:
                    await coord.restore(snapshot)
        assert (caught.value.phase, caught.value.server) == ("restore", "simple_agent")
        assert "the reply names checkpoint 'foreign-checkpoint'" in str(caught.value)


async def test_a_rollback_names_the_servers_whose_state_it_did_not_see(
    cluster: RunningCluster, ledger_url: str, configure: Any
) -> None:
    async with httpx.AsyncClient() as http:
        # the agent's prepare fails with a 500 that ran nothing: the model paused before it is resumed
        # (its reply says accepting); the agent's fence stayed idle — a resume from idle answers
        # accepting too (the agent allows it), so the message names every server as confirmed
        await set_faults(
            http, cluster.urls["simple_agent"], [{"kind": "fail", "path": "/agent-checkpoint/prepare"}]
        )
        async with Coordinator.open(configure(cluster, ledger_url)) as coord:
            await coord.discover()
            with pytest.raises(PhaseError) as confirmed:
                await coord.checkpoint(deadline_s=30)
            assert "Every server is accepting again." in str(confirmed.value)
            # the model's pause fails the same way: its fence never left idle, so its resume is
            # refused (invalid_phase) — the reply shows no accepting admission: it is named
            await set_faults(http, cluster.urls["simple_agent"], [])
            await set_faults(
                http, cluster.urls["policy_model"], [{"kind": "fail", "path": "/model-admission/pause"}]
            )
            with pytest.raises(PhaseError) as unconfirmed:
                await coord.checkpoint(deadline_s=30)
        text = str(unconfirmed.value)
        assert "Every server is accepting again" not in text
        assert "Not confirmed accepting: policy_model" in text
        assert "check it with `quiesce status`" in text
