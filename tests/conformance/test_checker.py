"""The checker against `FakeGym`: all green on a correct server, one clear red row per broken rule.

Each fault of the fake breaks exactly one spec rule; the checker must name it in
the matching row, and must still leave the server idle afterwards.
"""

from __future__ import annotations

import json
import socket

import anyio
import pytest

from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES
from quiesce.tools.conformance import ConformanceReport, ServerUnreachable, run_conformance
from tests.conformance.conftest import TOKEN, StartFake

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def statuses(report: ConformanceReport) -> dict[str, str]:
    names = [r.name for r in report.results]
    assert len(names) == len(set(names)), f"duplicate rows: {names}"
    return {r.name: r.status for r in report.results}


ACK_ROWS = ("acknowledge.auth", "acknowledge.validation", "acknowledge.unknown_execution")

CYCLE_ROWS = (
    "cycle.prepare",
    "capabilities.fence_state_prepared",
    "fence.replay_prepare",
    "fence.conflict",
    "cycle.status",
    "cycle.commit",
    "artifacts.manifest_digest",
    "capabilities.fence_state_committed",
    "fence.replay_commit",
    "cycle.resume",
    "fence.replay_resume",
    "fence.stale_after_resume",
)


@pytest.mark.parametrize(
    ("component", "role", "index_status"),
    [(MODEL, "policy", "skip"), (AGENT, None, "pass"), (RESOURCES, None, "skip")],
)
async def test_correct_server_passes(
    start_fake: StartFake, component: str, role: str | None, index_status: str
) -> None:
    fake, url = start_fake(component, role=role)
    report = await run_conformance(url, TOKEN, timeout_s=10)
    rows = statuses(report)
    # skipped where the spec makes a row inapplicable: no index, workers of a model only, no ack feature
    inapplicable = {"artifacts.index", "status.workers", *ACK_ROWS}
    failed = [r for r in report.results if r.status != "pass" and r.name not in inapplicable]
    assert failed == []
    assert rows["artifacts.index"] == index_status
    assert rows["status.workers"] == ("pass" if component == MODEL else "skip")
    assert {rows[name] for name in ACK_ROWS} == {"skip"}
    for name in (*CYCLE_ROWS, "auth.post_wrong_token", "validation.deadline_ts", "phase.resume_at_idle"):
        assert rows[name] == "pass"
    assert report.passed
    assert (report.component, report.name) == (component, "fake")
    assert (fake.phase, fake.active) == ("idle", None)


async def test_auxiliary_model_gets_its_own_rows(start_fake: StartFake) -> None:
    _, url = start_fake(MODEL, name="judge", role="auxiliary")
    report = await run_conformance(url, TOKEN, timeout_s=10)
    rows = statuses(report)
    assert report.passed
    assert rows["auxiliary.not_a_policy_instance"] == "pass"
    assert rows["auxiliary.status_allowed"] == "pass"
    assert rows["auth.post_missing_token"] == "pass"
    assert all(rows[name] == "skip" for name in CYCLE_ROWS)
    skipped = {r.detail for r in report.results if r.name == "cycle.prepare"}
    assert skipped == {"auxiliary model: never paused by the coordinator"}
    assert rows["cleanup.idle"] == "pass"


async def test_policy_model_answering_not_a_policy_instance_fails(start_fake: StartFake) -> None:
    # Declares itself policy, behaves as auxiliary: the cycle must fail, not be skipped.
    fake, url = start_fake(MODEL, role="policy")
    fake.role = "auxiliary"  # its control routes refuse, while capabilities still say policy
    report = await run_conformance(url, TOKEN, timeout_s=10)
    bad = {r.name: r.detail for r in report.results if r.status == "fail"}
    assert "cycle.prepare" in bad
    assert "not_a_policy_instance" in bad["cycle.prepare"]
    assert not report.passed


@pytest.mark.parametrize(
    ("component", "fault", "row", "words"),
    [
        (RESOURCES, "no_auth", "auth.post_missing_token", "expected 401, got HTTP 200"),
        (MODEL, "no_auth", "auth.status_wrong_token", "expected 401"),
        (AGENT, "accept_extra", "validation.extra_field", "extra field: HTTP 200"),
        (RESOURCES, "wrong_digest", "artifacts.manifest_digest", "reply says"),
        (MODEL, "no_replay", "fence.replay_prepare", "invalid_phase"),
        (AGENT, "never_retire", "fence.stale_after_resume", "expected 409 stale_checkpoint"),
        (RESOURCES, "bad_caps", "capabilities.shape", "fence fields missing"),
        (AGENT, "index_bytes", "artifacts.index", "bytes"),
        (MODEL, "no_conflict", "fence.conflict", "checkpoint_conflict, got HTTP 409 invalid_phase"),
        (
            RESOURCES,
            "phase_as_state",
            "cycle.status",
            "status state 'prepared' after prepare, expected 'paused'",
        ),
        (AGENT, "ack_any", "acknowledge.unknown_execution", "expected 409 completed_execution"),
        (MODEL, "missing_worker", "cycle.status", "not paused within"),
    ],
)
async def test_broken_server_fails_with_a_clear_row(
    start_fake: StartFake, component: str, fault: str, row: str, words: str
) -> None:
    role = "policy" if component == MODEL else None
    options = {"ack": fault == "ack_any", "coordinator": fault == "missing_worker"}
    fake, url = start_fake(component, role=role, faults=frozenset({fault}), **options)
    report = await run_conformance(url, TOKEN, timeout_s=10)
    result = next(r for r in report.results if r.name == row)
    assert result.status == "fail", result
    assert words in result.detail
    assert not report.passed
    assert TOKEN not in json.dumps(report.to_json())
    # Whatever broke, the checker resumed what it touched.
    assert (fake.phase, fake.active) == ("idle", None)
    if fault != "bad_caps":
        assert statuses(report)["cleanup.idle"] == "pass"


async def test_a_non_finite_deadline_answered_500_is_a_warning_not_a_failure(start_fake: StartFake) -> None:
    fake, url = start_fake(AGENT, faults=frozenset({"nan_500"}))
    report = await run_conformance(url, TOKEN, timeout_s=10)
    result = next(r for r in report.results if r.name == "validation.deadline_ts")
    assert result.status == "warn", result
    assert "NaN, Infinity, 1e999 answered 500 instead of 422" in result.detail
    assert report.passed  # still conformant: the deadline was refused
    assert report.counts()["warn"] == 1
    assert (fake.phase, fake.active) == ("idle", None)


async def test_an_agent_with_acknowledgement_passes_its_rows(start_fake: StartFake) -> None:
    _, url = start_fake(AGENT, ack=True)
    report = await run_conformance(url, TOKEN, timeout_s=10)
    rows = statuses(report)
    assert {name: rows[name] for name in ACK_ROWS} == dict.fromkeys(ACK_ROWS, "pass")
    assert report.passed


@pytest.mark.parametrize("receipts", [False, True])
@pytest.mark.parametrize("body_first", [False, True])
async def test_an_agent_is_probed_in_its_own_acknowledgement_form(
    start_fake: StartFake, receipts: bool, body_first: bool
) -> None:
    # a later agent takes completion receipts and refuses the pairs (422); Gym's routes validate
    # the body before the token: a malformed batch without a token gets 422, a well-formed one 401
    _, url = start_fake(AGENT, ack=True, receipts=receipts, body_first=body_first)
    report = await run_conformance(url, TOKEN, timeout_s=10)
    rows = {r.name: r for r in report.results}
    assert {name: rows[name].status for name in ACK_ROWS} == dict.fromkeys(ACK_ROWS, "pass"), [
        rows[name] for name in ACK_ROWS
    ]
    assert report.passed, [r for r in report.results if r.status == "fail"]
    form = "a completion receipt" if receipts else "a {rollout_id, attempt_index} pair"
    assert rows["acknowledge.unknown_execution"].detail.startswith(
        f"{form} of an execution it never finished"
    )
    before = "a malformed batch without a token → 422 (the body is validated before the token"
    assert (before in rows["acknowledge.auth"].detail) is body_first, rows["acknowledge.auth"].detail


async def test_an_agent_that_takes_a_well_formed_batch_without_a_token_still_fails(
    start_fake: StartFake,
) -> None:
    # validating the body first is Gym's way; accepting a well-formed batch without the token is not
    _, url = start_fake(AGENT, ack=True, receipts=True, body_first=True, faults=frozenset({"no_auth"}))
    report = await run_conformance(url, TOKEN, timeout_s=10)
    result = next(r for r in report.results if r.name == "acknowledge.auth")
    assert result.status == "fail"
    assert result.detail.startswith(
        "POST acknowledge-completed (a completion receipt) without a token: expected 401, got HTTP 409"
    ), result.detail


async def test_a_coordinator_mode_model_is_checked_in_its_own_shape(start_fake: StartFake) -> None:
    _, url = start_fake(MODEL, role="policy", coordinator=True)
    report = await run_conformance(url, TOKEN, timeout_s=10)
    result = next(r for r in report.results if r.name == "status.workers")
    assert (result.status, result.detail) == (
        "pass",
        "coordinator shape: 2 workers acknowledged, live, none missing",
    )
    assert report.passed


async def test_wrong_token_given_to_checker_fails_the_cycle_and_leaves_server_idle(
    start_fake: StartFake,
) -> None:
    fake, url = start_fake(RESOURCES)
    report = await run_conformance(url, "not-the-token", timeout_s=10)
    rows = statuses(report)
    assert rows["cycle.prepare"] == "fail"
    assert rows["cycle.resume"] == "skip"
    assert not report.passed
    assert fake.phase == "idle"


async def test_server_busy_at_start_is_not_touched(start_fake: StartFake) -> None:
    fake, url = start_fake(RESOURCES)
    fake.phase, fake.active, fake.deadline_ts = "prepared", "someone-else", 1.0e10
    report = await run_conformance(url, TOKEN, timeout_s=10)
    rows = statuses(report)
    assert rows["capabilities.idle_at_start"] == "fail"
    assert rows["cycle.prepare"] == "skip"
    assert rows["cleanup.idle"] == "pass"
    assert (fake.phase, fake.active) == ("prepared", "someone-else")


async def test_unreachable_url_raises_usage_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        await run_conformance(f"http://127.0.0.1:{port}", TOKEN, timeout_s=5)


def test_every_documented_check_can_be_emitted() -> None:
    # Every row name the checker may emit is documented in CHECKS, and nothing documented is dead.
    from quiesce.tools import conformance

    emitted = set(conformance._ALL_AFTER_CAPABILITIES) | {
        "capabilities.shape",
        "auxiliary.not_a_policy_instance",
        "auxiliary.status_allowed",
    }
    assert emitted == set(conformance.CHECKS)


async def test_cancelled_checker_still_resumes_what_it_paused(start_fake: StartFake) -> None:
    fake, url = start_fake(RESOURCES, faults=frozenset({"slow_commit"}))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_conformance, url, TOKEN)
            # Cancel while the cycle's commit is outstanding: the cycle id is active on the server.
            assert await anyio.to_thread.run_sync(fake.commit_waiting.wait, 30)
            assert fake.phase == "prepared"
            assert (fake.active or "").endswith("-cycle")
            tg.cancel_scope.cancel()
    finally:
        fake.released.set()
    assert (fake.phase, fake.active) == ("idle", None)


async def test_a_url_that_is_no_gym_server_fails_capabilities_and_skips_the_rest(
    start_fake: StartFake,
) -> None:
    _, url = start_fake(RESOURCES)
    report = await run_conformance(url + "/not-here", TOKEN, timeout_s=10)
    rows = statuses(report)
    assert rows.pop("capabilities.shape") == "fail"
    assert set(rows.values()) == {"skip"}
    assert report.results[0].detail.startswith("capabilities: expected 200, got HTTP 404")
    assert not report.passed
