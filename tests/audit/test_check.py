"""The protocol check and the attempt reconstruction, on hand-made ledgers written through the real
`Ledger` API: a plausible attempt passes; each kind of violation is reported with its seq."""

from __future__ import annotations

import time

import anyio
import pytest

from quiesce.ledger import Event, Ledger
from quiesce.tools.audit.attempts import build_attempt
from quiesce.tools.audit.check import CheckReport, check_events
from quiesce.tools.audit.source import attempt_events, open_readonly
from tests.audit.handmade import AGENT_1, AGENT_2, PARTICIPANTS, POLICY, TOOLS, Script, forge_stale_event

pytestmark = pytest.mark.anyio


async def _all_events(url: str) -> list[Event]:
    async with open_readonly(url) as ledger:
        return [e async for e in ledger.read()]


async def _check(url: str) -> CheckReport:
    return check_events(await _all_events(url))


def _seq_of(events: list[Event], kind: str, *, server: str | None = None, operation: str = "") -> list[int]:
    return [
        e.seq
        for e in events
        if e.kind == kind
        and (server is None or e.server == server)
        and str(e.data.get("path", "")).endswith(operation)
    ]


async def test_good_attempts_pass(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        script = Script(ledger)
        await script.start()
        await script.good_save("ck-1")
        await script.good_save("ck-2")
    report = await _check(ledger_url)
    assert report.violations == []
    assert report.warnings == []
    assert report.attempts == {"ck-1": "judged", "ck-2": "judged"}

    async with open_readonly(ledger_url) as ledger:
        events = await attempt_events(ledger, "ck-2")
    view = build_attempt("ck-2", events)
    assert view.kind == "save"
    assert view.outcome == "published"
    assert len(view.calls) == 13  # pause, 2 prepares, tools prepare, status, 4 commits, 4 resumes
    assert all(c.outcome == "acknowledged" for c in view.calls)
    assert [c.operation for c in view.calls[:5]] == ["pause", "prepare", "prepare", "prepare", "status"]
    matrix = view.matrix()
    assert list(matrix) == list(PARTICIPANTS)
    assert list(matrix[POLICY]) == ["prepare", "commit", "resume"]
    assert matrix[POLICY]["prepare"].sent == 2
    assert matrix[TOOLS]["commit"].state == "acknowledged"
    assert all(cell.intended for row in matrix.values() for cell in row.values())
    # the attempt's events (plus every coordinator.started) check clean on their own
    assert check_events(events).violations == []


async def test_order_violation_later_step_first(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck")
        await s.prepare("ck")
        await s.phase("ck", "commit")
        await s.call("ck", POLICY, "commit", "commit")  # the model before the agents
        await s.call("ck", AGENT_1, "commit", "commit")
        await s.call("ck", AGENT_2, "commit", "commit")
        await s.call("ck", TOOLS, "commit", "commit")
        await s.phase_done("ck", "commit")
        await s.publish("ck")
        await s.resume("ck")
        await s.completed("ck")
    events = await _all_events(ledger_url)
    report = check_events(events)
    bad = _seq_of(events, "call.sent", operation="/agent-checkpoint/commit")
    assert [(v.rule, v.seq) for v in report.violations] == [("order", bad[0]), ("order", bad[1])]
    assert {v.server for v in report.violations} == {AGENT_1, AGENT_2}
    assert "after a later step" in report.violations[0].message


async def test_order_violation_step_before_previous_answered(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck")
        await s.phase("ck", "prepare")
        pause = await s.send("ck", POLICY, "prepare", "pause")
        prep = await s.send("ck", AGENT_1, "prepare", "prepare")  # before the pause was answered
        await s.reply("ck", POLICY, pause)
        await s.reply("ck", AGENT_1, prep)
        await s.call("ck", AGENT_2, "prepare", "prepare")
        await s.call("ck", TOOLS, "prepare", "prepare")
        await s.call("ck", POLICY, "prepare", "status")
        await s.phase_done("ck", "prepare")
        await s.commit("ck")
        await s.publish("ck")
        await s.resume("ck")
        await s.completed("ck")
    events = await _all_events(ledger_url)
    report = check_events(events)
    bad = _seq_of(events, "call.sent", server=AGENT_1, operation="/prepare")
    assert [(v.rule, v.seq) for v in report.violations] == [("order", bad[0])]
    assert "had no outcome" in report.violations[0].message


async def test_order_violation_operation_not_in_phase(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY,))
        await s.prepare("ck", (POLICY,))
        await s.phase("ck", "commit")
        await s.call("ck", POLICY, "commit", "commit")
        await s.call("ck", POLICY, "commit", "resume")  # a resume is not a commit step
        await s.phase_done("ck", "commit")
        await s.completed("ck")
    events = await _all_events(ledger_url)
    report = check_events(events)
    bad = _seq_of(events, "call.sent", operation="/model-admission/resume")
    assert [(v.rule, v.seq) for v in report.violations] == [("order", bad[0])]
    assert "not a step of phase 'commit'" in report.violations[0].message


async def test_rollback_resumes_in_resume_order_pass(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck")
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.call("ck", AGENT_1, "prepare", "prepare")
        lost = await s.send("ck", AGENT_2, "prepare", "prepare")
        await s.fail("ck", AGENT_2, lost, error="timeout", status=None, code="timeout")
        await s.phase_failed("ck", "prepare", AGENT_2, "timeout")
        # rollback: every touched server, even the one whose reply was lost; resume order
        await s.phase("ck", "rollback")
        await s.call("ck", POLICY, "rollback", "resume")
        await s.call("ck", AGENT_1, "rollback", "resume")
        await s.call("ck", AGENT_2, "rollback", "resume")
        await s.phase_done("ck", "rollback")
        await s.aborted("ck", "agent prepare timed out", resumed=[POLICY, AGENT_1, AGENT_2])
    report = await _check(ledger_url)
    assert report.violations == []
    async with open_readonly(ledger_url) as ledger:
        view = build_attempt("ck", await attempt_events(ledger, "ck"))
    matrix = view.matrix()
    assert matrix[AGENT_2]["prepare"].state == "failed"
    assert matrix[AGENT_2]["rollback"].state == "compensated"
    assert matrix[TOOLS]["prepare"].state == "not sent"
    assert not matrix[TOOLS]["rollback"].intended
    assert view.outcome == "aborted"


async def test_unsettled_touched_server_never_resumed(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck")
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.call("ck", AGENT_1, "prepare", "prepare", status=409)
        await s.phase_failed("ck", "prepare", AGENT_1, "agent_prepare_incomplete")
        await s.phase("ck", "rollback")
        await s.call("ck", POLICY, "rollback", "resume")  # forgets the agent it touched
        await s.phase_done("ck", "rollback")
        await s.aborted("ck", "prepare failed", resumed=[POLICY])
    events = await _all_events(ledger_url)
    report = check_events(events)
    terminal = _seq_of(events, "attempt.aborted")
    assert [(v.rule, v.seq, v.server) for v in report.violations] == [("unsettled", terminal[0], AGENT_1)]


async def test_unsettled_resumed_without_commit(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck")
        await s.prepare("ck")
        await s.phase("ck", "commit")
        await s.call("ck", AGENT_1, "commit", "commit")
        await s.call("ck", AGENT_2, "commit", "commit", status=409)  # failed commit ...
        await s.phase_failed("ck", "commit", AGENT_2, "commit failed")
        await s.resume("ck")  # ... yet resumed as if published, not rolled back
        await s.completed("ck")
    events = await _all_events(ledger_url)
    report = check_events(events)
    rules = {(v.rule, v.server) for v in report.violations}
    assert rules == {("unsettled", POLICY), ("unsettled", AGENT_2), ("unsettled", TOOLS)}
    resume_of_agent_2 = _seq_of(events, "call.sent", server=AGENT_2, operation="/resume")
    assert resume_of_agent_2[0] in {v.seq for v in report.violations}


async def test_left_paused_is_a_warning(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY,))
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.call("ck", POLICY, "prepare", "status", status=503)
        await s.phase_failed("ck", "prepare", POLICY, "status failed")
        await s.phase("ck", "rollback")
        await s.call("ck", POLICY, "rollback", "resume", status=503)
        await s.phase_done("ck", "rollback")
        await s.aborted("ck", "prepare failed", left=[POLICY])
    report = await _check(ledger_url)
    assert report.violations == []
    assert [(w.rule, w.server) for w in report.warnings] == [("unsettled", POLICY)]
    assert report.ok


async def test_deadline_violation_but_rollback_resumes_exempt(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", deadline_ts=time.time() + 3600, participants=(POLICY, AGENT_1))
        await s.attempt("late", deadline_ts=time.time() - 5.0, participants=(POLICY, AGENT_1))
        await s.phase("late", "prepare")
        await s.call("late", POLICY, "prepare", "pause")
        await s.phase_failed("late", "prepare", POLICY, "deadline")
        await s.phase("late", "rollback")
        await s.call("late", POLICY, "rollback", "resume")  # allowed after the deadline
        await s.phase_done("late", "rollback")
        await s.aborted("late", "deadline", resumed=[POLICY])
    events = await _all_events(ledger_url)
    report = check_events(events)
    pause = _seq_of(events, "call.sent", operation="/pause")
    assert [(v.rule, v.seq, v.checkpoint_id) for v in report.violations] == [("deadline", pause[0], "late")]
    assert report.attempts["ck"] == "open"


async def test_recovery_settles_a_dead_coordinators_attempt(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY, AGENT_1))
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.send("ck", AGENT_1, "prepare", "prepare")  # the coordinator dies here
    assert (await _check(ledger_url)).attempts == {"ck": "open"}
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await ledger.append("recovery.started", data={"attempts": ["ck"]})
        for server in (POLICY, AGENT_1):
            await ledger.append(
                "recovery.settled",
                checkpoint_id="ck",
                server=server,
                data={
                    "reported_phase": "prepared",
                    "active_checkpoint_id": "ck",
                    "action": "resume",
                    "result": "ok",
                },
            )
        await s.call("ck", POLICY, "recovery", "resume")
        await s.call("ck", AGENT_1, "recovery", "resume")
        await s.aborted("ck", "recovered", resumed=[POLICY, AGENT_1])
        await ledger.append("recovery.completed", data={"outcomes": {"ck": "aborted"}})
    report = await _check(ledger_url)
    assert report.violations == []
    assert report.attempts == {"ck": "judged"}
    async with open_readonly(ledger_url) as ledger:
        view = build_attempt("ck", await attempt_events(ledger, "ck"))
    assert [r.server for r in view.recovery] == [POLICY, AGENT_1]
    assert view.calls[1].outcome == "unknown"
    assert view.matrix()[AGENT_1]["prepare"].state == "unknown"
    assert view.matrix()[AGENT_1]["recovery"].state == "compensated"


async def test_recovery_resumes_out_of_order(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY, TOOLS))
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.call("ck", TOOLS, "prepare", "prepare")
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.call("ck", POLICY, "recovery", "resume")
        await s.call("ck", TOOLS, "recovery", "resume")  # resources resume before the model
        await s.aborted("ck", "recovered", resumed=[POLICY, TOOLS])
    events = await _all_events(ledger_url)
    report = check_events(events)
    bad = _seq_of(events, "call.sent", server=TOOLS, operation="/resume")
    assert [(v.rule, v.seq) for v in report.violations] == [("order", bad[0])]


async def test_stale_epoch_event(tmp_path_factory: pytest.TempPathFactory) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('stale') / 'l.db'}"
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.good_save("ck-1")
    async with Ledger.open(url) as ledger:
        await Script(ledger).start()  # epoch 2
    seq = forge_stale_event(
        url, epoch=1, checkpoint_id="ck-1", kind="phase.started", data={"phase": "resume"}
    )
    report = await _check(url)
    assert [(v.rule, v.seq, v.checkpoint_id) for v in report.violations] == [("epoch", seq, "ck-1")]
    # the per-attempt read carries every coordinator.started, so `check ID` sees it too
    async with open_readonly(url) as ledger:
        events = await attempt_events(ledger, "ck-1")
    assert [v.seq for v in check_events(events).violations] == [seq]


async def test_pairing_violation(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY,))
        await s.phase("ck", "prepare")
        call_id = await s.call("ck", POLICY, "prepare", "pause")
        await s.reply("ck", POLICY, call_id)  # a second outcome
        await s.reply("ck", POLICY, "never-sent")
    events = await _all_events(ledger_url)
    report = check_events(events)
    replies = _seq_of(events, "call.replied")
    assert [(v.rule, v.seq) for v in report.violations] == [("pairing", replies[1]), ("pairing", replies[2])]
    view = build_attempt("ck", events)
    assert [seq for seq, _ in view.pairing_errors] == replies[1:]


async def test_deadline_allows_a_late_resume_of_a_restore(ledger_url: str) -> None:
    """The restore's calls come before the deadline; its resume, asked for later, may come after."""
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("rs", kind="restore", deadline_ts=time.time() + 0.3, participants=(POLICY, AGENT_1))
        await s.phase("rs", "restore")
        await s.call("rs", POLICY, "restore", "restore")
        await s.call("rs", AGENT_1, "restore", "restore")
        await s.phase_done("rs", "restore")
        await anyio.sleep(0.4)  # the caller resumes after the deadline
        await s.resume("rs", (POLICY, AGENT_1))
        late_commit = await s.send("rs", POLICY, "resume", "commit")  # but nothing else may be sent
        await s.reply("rs", POLICY, late_commit)
        await s.completed("rs", outcome="resumed")
    events = await _all_events(ledger_url)
    report = check_events(events)
    commit = _seq_of(events, "call.sent", operation="/model-checkpoint/commit")
    terminal = _seq_of(events, "attempt.completed")
    # the late commit: after the deadline, not a resume step, and it leaves the model paused again
    assert {(v.rule, v.seq) for v in report.violations} == {
        ("deadline", commit[0]),
        ("order", commit[0]),
        ("unsettled", terminal[0]),
    }


@pytest.mark.parametrize("by_a_later_epoch", [True, False])
async def test_a_publication_recovered_from_disk_settles_a_resume_without_commit_records(
    ledger_url: str, by_a_later_epoch: bool
) -> None:
    """A power failure took every write-behind record after the attempt's first call; the next
    coordinator found the snapshot renamed into place and recorded `attempt.published`, then resumed
    everyone in the resume phase: no violation. The same resume after an `attempt.published` of
    the attempt's own epoch, with no commit recorded, is still a violation for the paused model."""

    async def publish_and_resume(s: Script) -> None:
        await s.ledger.append(
            "attempt.published",
            checkpoint_id="ck",
            data={"final_dir": "/snap/ck", "manifest_sha256": "0" * 64},
        )
        await s.resume("ck")
        await s.completed("ck")

    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck")
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        if not by_a_later_epoch:
            await publish_and_resume(s)
    if by_a_later_epoch:
        async with Ledger.open(ledger_url) as ledger:
            s = Script(ledger)
            await s.start()
            await publish_and_resume(s)
    report = await _check(ledger_url)
    if by_a_later_epoch:
        assert report.violations == []
    else:
        assert [(v.rule, v.server) for v in report.violations] == [("unsettled", POLICY)]


async def test_rollback_left_paused_then_resumed_later(ledger_url: str) -> None:
    """A rollback that left a server paused, resumed later by `quiesce resume` (phase `resume`)."""
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY, AGENT_1))
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.call("ck", AGENT_1, "prepare", "prepare", status=409)
        await s.phase("ck", "rollback")
        await s.call("ck", POLICY, "rollback", "resume", status=503)
        await s.call("ck", AGENT_1, "rollback", "resume")
        await s.aborted("ck", "prepare failed", resumed=[AGENT_1], left=[POLICY])
    assert [(w.rule, w.server) for w in (await _check(ledger_url)).warnings] == [("unsettled", POLICY)]
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.resume("ck", (POLICY,))
        await s.completed("ck", outcome="resumed")
    report = await _check(ledger_url)
    assert report.violations == []
    assert report.warnings == []


async def test_restore_then_resume(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("rs", kind="restore", participants=(POLICY, AGENT_1, TOOLS))
        await s.phase("rs", "restore")
        for server in (POLICY, AGENT_1, TOOLS):
            await s.call("rs", server, "restore", "restore")
        await s.phase_done("rs", "restore")
        await s.completed("rs", outcome="restored")
    report = await _check(ledger_url)
    assert (report.violations, report.warnings) == ([], [])  # paused by design until resumed
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.resume("rs", (POLICY, TOOLS))  # forgets the agent
        await s.completed("rs", outcome="resumed")
    events = await _all_events(ledger_url)
    report = check_events(events)
    terminal = _seq_of(events, "attempt.completed")[-1]
    assert [(v.rule, v.seq, v.server) for v in report.violations] == [("unsettled", terminal, AGENT_1)]


async def test_recovery_redriving_a_restore_after_the_deadline_is_not_late(ledger_url: str) -> None:
    """A later epoch re-drives an interrupted restore on its own budget: not a deadline violation,
    while the same call from the attempt's own epoch after its deadline is one."""
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("r1", kind="restore", deadline_ts=time.time() - 5.0, participants=(POLICY, AGENT_1))
        await s.phase("r1", "restore")
        late = await s.send("r1", POLICY, "restore", "restore")  # own epoch, past the deadline
        await s.reply("r1", POLICY, late)
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.phase("r1", "restore")
        await s.call("r1", POLICY, "restore", "restore")
        await s.call("r1", AGENT_1, "restore", "restore")
        await s.completed("r1", outcome="restored")
    events = await _all_events(ledger_url)
    report = check_events(events)
    first = _seq_of(events, "call.sent", operation="/restore")[0]
    assert [(v.rule, v.seq) for v in report.violations] == [("deadline", first)]


async def test_server_held_by_another_checkpoint_is_a_warning(ledger_url: str) -> None:
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.attempt("ck", participants=(POLICY, AGENT_1))
        await s.phase("ck", "prepare")
        await s.call("ck", POLICY, "prepare", "pause")
        await s.call("ck", AGENT_1, "prepare", "prepare")
    async with Ledger.open(ledger_url) as ledger:
        s = Script(ledger)
        await s.start()
        await ledger.append("recovery.started", data={"attempts": ["ck"]})
        for server, result in ((POLICY, "resumed"), (AGENT_1, "other_checkpoint")):
            await ledger.append(
                "recovery.settled",
                checkpoint_id="ck",
                server=server,
                data={
                    "reported_phase": "prepared",
                    "active_checkpoint_id": "other",
                    "action": "none",
                    "result": result,
                },
            )
        await s.call("ck", POLICY, "recovery", "resume")
        await s.aborted("ck", "recovered", resumed=[POLICY])
    report = check_events(await _all_events(ledger_url))
    assert report.violations == []
    assert [(w.rule, w.server) for w in report.warnings] == [("unsettled", AGENT_1)]
    assert "another checkpoint" in report.warnings[0].message
