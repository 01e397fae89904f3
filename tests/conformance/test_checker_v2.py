"""The v2 checker against `FakeGymV2`: all green on a correct participant of every kind, one clear
red row per broken rule, and the server left idle with no mark whatever broke."""

from __future__ import annotations

import json
import socket

import anyio
import pytest

from quiesce.tools import conformance_v2
from quiesce.tools.conformance_report import ConformanceReport, ServerUnreachable
from quiesce.tools.conformance_v2 import check_server, detect_plane, run_conformance_v2
from tests.conformance.conftest import TOKEN, StartFake, StartFakeV2

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

KINDS = ("environment", "model", "agent", "resources")


def statuses(report: ConformanceReport) -> dict[str, str]:
    names = [r.name for r in report.results]
    assert len(names) == len(set(names)), f"duplicate rows: {names}"
    return {r.name: r.status for r in report.results}


@pytest.mark.parametrize("kind", KINDS)
async def test_a_correct_participant_passes_every_row(start_fake_v2: StartFakeV2, kind: str) -> None:
    fake, url = start_fake_v2(kind, grace_s=1.0)
    report = await check_server(url, TOKEN, timeout_s=10, lease_check=True)
    rows = statuses(report)
    assert set(rows) == set(conformance_v2.CHECKS)  # every documented row, once
    not_passed = {name: status for name, status in rows.items() if status != "pass"}
    assert not_passed == ({} if kind == "model" else {"commit.scope_required": "skip"})
    assert (report.plane, report.component, report.name) == ("v2", kind, "fake")
    assert report.passed
    assert (fake.phase, fake.checkpoint_id, fake.lease, fake.marks) == ("idle", None, None, {})


async def test_the_lease_row_is_skipped_without_the_flag_or_with_a_long_grace(
    start_fake_v2: StartFakeV2,
) -> None:
    _, url = start_fake_v2("agent")
    without = await run_conformance_v2(url, TOKEN, timeout_s=10)
    detail = {r.name: r.detail for r in without.results}["lease.expiry"]
    assert statuses(without)["lease.expiry"] == "skip"
    assert "--lease-check" in detail
    long_grace = await run_conformance_v2(url, TOKEN, timeout_s=10, lease_check=True)
    detail = {r.name: r.detail for r in long_grace.results}["lease.expiry"]
    assert statuses(long_grace)["lease.expiry"] == "skip"
    assert "lease grace is 600s" in detail


@pytest.mark.parametrize(
    ("kind", "fault", "row", "words"),
    [
        ("environment", "no_auth", "auth.missing_token", "POST prepare: HTTP 200"),
        ("model", "no_auth", "auth.wrong_token", "GET status: HTTP 200"),
        ("agent", "accept_extra", "validation.extra_field", "extra field: HTTP 200"),
        ("resources", "accept_extra", "validation.schema_version", "schema_version 1"),
        ("environment", "loose_episodes", "validation.episode_ids", "rollout id ending in -a1: HTTP 409"),
        ("model", "no_replay", "fence.replay_prepare", "invalid_phase"),
        ("agent", "no_conflict", "fence.conflict", "expected 409 checkpoint_conflict"),
        ("resources", "never_fence", "fence.stale_after_resume", "expected 409 stale_checkpoint"),
        ("environment", "never_fence", "fence.resume_at_idle", "expected 409 stale_checkpoint"),
        ("agent", "wrong_digest", "storage.records", "sha256 differs from records_sha256"),
        ("resources", "unsorted_manifest", "storage.manifest", "not written with sorted keys"),
        ("environment", "capture_key_records", "storage.records", "is not an object"),
        ("model", "no_staging_keys", "cycle.commit", "must carry staging_keys"),
        ("agent", "lease_shrinks", "lease.renew", "shrank the lease"),
        ("resources", "ignore_deadline", "deadline.retire", "expected 409 deadline_exceeded"),
        ("environment", "ignore_deadline", "deadline.commit", "expected 409 deadline_exceeded"),
        ("model", "keeps_marks", "retire.round_trip", "a mark was left behind"),
        ("agent", "missing_extras", "status.shape", "an agent status must carry accepting"),
        ("model", "null_scope_ok", "commit.scope_required", "expected 409 checkpoint_error"),
        ("resources", "retire_anywhere", "phase.retire_while_prepared", "expected 409 invalid_phase"),
        ("environment", "second_write", "fence.commit_other_dir", "wrote a second manifest"),
    ],
)
async def test_a_broken_participant_fails_the_row_of_its_rule(
    start_fake_v2: StartFakeV2, kind: str, fault: str, row: str, words: str
) -> None:
    fake, url = start_fake_v2(kind, faults=frozenset({fault}))
    report = await run_conformance_v2(url, TOKEN, timeout_s=10)
    result = next(r for r in report.results if r.name == row)
    assert result.status == "fail", result
    assert words in result.detail
    assert not report.passed
    assert TOKEN not in json.dumps(report.to_json())
    # Whatever broke, the checker resumed what it touched (a fake that keeps marks keeps them).
    assert (fake.phase, fake.checkpoint_id) == ("idle", None)
    if fault != "keeps_marks":
        assert fake.marks == {}
        assert statuses(report)["cleanup.idle"] == "pass"
    else:
        assert statuses(report)["cleanup.idle"] == "fail"


async def test_a_lease_that_never_expires_fails_the_lease_row(start_fake_v2: StartFakeV2) -> None:
    fake, url = start_fake_v2("resources", faults=frozenset({"no_lease_expiry"}), grace_s=0.5)
    report = await run_conformance_v2(url, TOKEN, timeout_s=10, lease_check=True)
    result = next(r for r in report.results if r.name == "lease.expiry")
    assert result.status == "fail", result
    assert "the lease had not resumed it" in result.detail
    assert statuses(report)["cleanup.idle"] == "pass"  # the checker resumed it itself
    assert fake.phase == "idle"


async def test_a_non_finite_deadline_answered_500_is_a_warning_and_the_checker_reconnects(
    start_fake_v2: StartFakeV2,
) -> None:
    # The fake raises, so uvicorn answers 500 and closes the connection, as real Gym does.
    fake, url = start_fake_v2("environment", faults=frozenset({"nan_500"}))
    report = await run_conformance_v2(url, TOKEN, timeout_s=10)
    result = next(r for r in report.results if r.name == "validation.deadline_ts")
    assert result.status == "warn", result
    assert "NaN, Infinity, 1e999 answered 500 instead of 422" in result.detail
    assert report.passed  # every later row still ran over a fresh connection
    assert report.counts() == {"pass": 39, "fail": 0, "skip": 2, "warn": 1}
    assert fake.phase == "idle"


async def test_a_wrong_token_fails_the_cycle_and_leaves_the_server_idle(start_fake_v2: StartFakeV2) -> None:
    fake, url = start_fake_v2("agent")
    report = await run_conformance_v2(url, "not-the-token", timeout_s=10)
    rows = statuses(report)
    assert rows["status.shape"] == "fail"
    assert set(rows.values()) - {"fail"} == {"pass", "skip"}
    assert rows["cleanup.idle"] == "skip"
    assert "not-the-token" not in json.dumps(report.to_json())
    assert fake.phase == "idle"


async def test_a_server_busy_at_start_is_left_as_found(start_fake_v2: StartFakeV2) -> None:
    fake, url = start_fake_v2("model")
    fake.phase, fake.checkpoint_id = "prepared", "someone-else"
    report = await run_conformance_v2(url, TOKEN, timeout_s=10)
    rows = statuses(report)
    assert rows["status.idle_at_start"] == "fail"
    assert rows["auth.missing_token"] == "pass"  # auth probes are harmless and still run
    assert rows["cycle.prepare"] == "skip"
    assert rows["cleanup.idle"] == "pass"
    assert (fake.phase, fake.checkpoint_id) == ("prepared", "someone-else")


async def test_a_cancelled_checker_still_resumes_what_it_prepared(start_fake_v2: StartFakeV2) -> None:
    fake, url = start_fake_v2("resources", faults=frozenset({"slow_commit"}))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_conformance_v2, url, TOKEN)
            # Cancel while the cycle's commit is outstanding: the cycle id is active on the server.
            assert await anyio.to_thread.run_sync(fake.commit_waiting.wait, 30)
            assert fake.phase == "prepared"
            assert (fake.checkpoint_id or "").endswith("-cycle")
            tg.cancel_scope.cancel()
    finally:
        fake.released.set()
    assert (fake.phase, fake.checkpoint_id, fake.marks) == ("idle", None, {})


async def test_the_plane_is_detected(start_fake: StartFake, start_fake_v2: StartFakeV2) -> None:
    _, v1 = start_fake("resources_servers")
    _, v2 = start_fake_v2("environment")
    assert (await detect_plane(v1, TOKEN))[0] == "v1"
    plane, why = await detect_plane(v2, TOKEN)
    assert (plane, why) == (
        "v2",
        "GET /ng-control/v1/capabilities 404; GET /ng-control/v1/checkpoint/status answered an environment"
        " status",
    )
    # A wrong token: the status does not validate, so the server is checked as v1 (and fails there).
    assert (await detect_plane(v2, "not-the-token"))[0] == "v1"
    assert (await check_server(v1, TOKEN, timeout_s=10)).plane == "v1"
    forced = await check_server(v2, TOKEN, plane="v2", timeout_s=10)
    assert {r.name: r.detail for r in forced.results}["plane.detected"] == "unified plane: --plane v2 given"


async def test_an_unreachable_url_raises_a_usage_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        await check_server(f"http://127.0.0.1:{port}", TOKEN, timeout_s=5)
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        await run_conformance_v2(f"http://127.0.0.1:{port}", TOKEN, timeout_s=5)
