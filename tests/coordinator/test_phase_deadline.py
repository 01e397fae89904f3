"""`run_phase` at the attempt's deadline, on a real SQLite ledger: when the deadline cancels a phase
while a participant was being asked again (`Attempt.waiting_on`), the failure is that
participant's last refusal — its code and what it named — not a bare "deadline passed".

The real-server view of the same rule is in `test_real_gym.py` (a prepare retry cut short).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from quiesce.coordinator.attempt import Attempt, Context, PhaseFailure, each_member, run_phase
from quiesce.coordinator.config import parse_config
from quiesce.coordinator.discovery import Member
from quiesce.ledger import Ledger

pytestmark = pytest.mark.anyio

AGENT = Member("simple_agent", "responses_api_agents", "export_restore", None, "agent", "http://127.0.0.1:9")
OTHER = Member("second_agent", "responses_api_agents", "export_restore", None, "agent", "http://127.0.0.1:8")


async def _deadline_failure(
    tmp_path: Path, waiting: PhaseFailure | None, *more: PhaseFailure
) -> PhaseFailure:
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    members = (AGENT, OTHER) if more else (AGENT,)
    config = parse_config(
        {"ledger": url, "servers": [{"name": m.name, "url": m.url} for m in members]}, base_dir=tmp_path
    )
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
        ctx = Context(config, ledger, cast(Any, None))
        attempt = Attempt("q-test-1", "save", time.time() + 0.3, members)

        async def body() -> dict[str, Any]:
            for refusal in (waiting, *more):
                if refusal is not None and refusal.server is not None:
                    attempt.waiting_on[refusal.server] = refusal
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        with pytest.raises(PhaseFailure) as caught:
            await run_phase(ctx, attempt, "prepare", body)
    return caught.value


async def test_the_deadline_reports_the_last_refusal_of_a_server_being_asked_again(tmp_path: Path) -> None:
    refusal = PhaseFailure("prepare", AGENT.name, "holds done:0 — acknowledge it", "agent_prepare_incomplete")
    failed = await _deadline_failure(tmp_path, refusal)
    assert (failed.phase, failed.server, failed.code) == ("prepare", AGENT.name, "agent_prepare_incomplete")
    assert failed.reason == "holds done:0 — acknowledge it"
    assert failed.deadline


async def test_without_a_refusal_to_report_the_deadline_is_bare(tmp_path: Path) -> None:
    failed = await _deadline_failure(tmp_path, None)
    assert failed.code is None
    assert failed.reason == "the attempt's deadline passed"
    assert failed.deadline


async def test_a_refusal_seen_in_another_phase_is_not_reported(tmp_path: Path) -> None:
    failed = await _deadline_failure(tmp_path, PhaseFailure("restore", AGENT.name, "other", "some_code"))
    assert failed.code is None
    assert failed.reason == "the attempt's deadline passed"


async def test_every_server_still_being_asked_is_named_the_first_in_config_order_reported(
    tmp_path: Path,
) -> None:
    other = PhaseFailure("prepare", OTHER.name, "holds done:3 — acknowledge it", "agent_prepare_incomplete")
    mine = PhaseFailure("prepare", AGENT.name, "holds done:0 — acknowledge it", "agent_prepare_incomplete")
    failed = await _deadline_failure(tmp_path, other, mine)  # recorded in the other order
    assert (failed.server, failed.code, failed.deadline) == (AGENT.name, "agent_prepare_incomplete", True)
    assert (
        failed.reason == "holds done:0 — acknowledge it (also: second_agent: holds done:3 — acknowledge it)"
    )


async def test_a_parallel_failure_already_settled_is_reported_when_the_deadline_ends_the_wait(
    tmp_path: Path,
) -> None:
    # fan-out parallel: the first agent has failed (its last refusal, raised), the other fails
    # only once the deadline has passed — so the deadline cancels the wait at the group's end.
    # What is reported is the first agent's failure, the other named too; not a bare deadline.
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    config = parse_config(
        {
            "ledger": url,
            "fanout": "parallel",
            "servers": [{"name": m.name, "url": m.url} for m in (AGENT, OTHER)],
        },
        base_dir=tmp_path,
    )
    async with Ledger.open(url) as ledger:
        await ledger.start_epoch({"coordinator": {"host": "h", "pid": 1, "uuid": "u"}, "version": "t"})
        ctx = Context(config, ledger, cast(Any, None))
        attempt = Attempt("q-test-1", "save", time.time() + 0.3, (AGENT, OTHER))

        async def fail(m: Member) -> None:
            if m is OTHER:
                with anyio.CancelScope(shield=True):  # ends after the deadline, uncancelled
                    await anyio.sleep(max(0.0, attempt.deadline_ts - time.time()) + 0.1)
            raise PhaseFailure(
                "prepare", m.name, f"{m.name} refused", "agent_prepare_incomplete", deadline=True
            )

        async def body() -> dict[str, Any]:
            await each_member(ctx, attempt, (AGENT, OTHER), fail)
            return {}

        with pytest.raises(PhaseFailure) as caught:
            await run_phase(ctx, attempt, "prepare", body)
    failed = caught.value
    assert (failed.server, failed.code, failed.deadline) == (AGENT.name, "agent_prepare_incomplete", True)
    assert failed.reason == "simple_agent refused (also: second_agent: second_agent refused)"
