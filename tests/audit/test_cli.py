"""The audit commands end to end (in-process `quiesce` main): show, check, export, verify-bundle,
replay --verify; tampered bundles fail naming the seq."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from quiesce.ledger import Ledger
from quiesce.tools.cli.main import main
from tests.audit.handmade import AGENT_1, POLICY, Script


async def _write_two_attempts(url: str) -> None:
    """`ck-good` obeys the protocol; `ck-bad` forgets to resume an agent it touched."""
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.good_save("ck-good")
        await s.attempt("ck-bad")
        await s.phase("ck-bad", "prepare")
        await s.call("ck-bad", POLICY, "prepare", "pause")
        await s.call("ck-bad", AGENT_1, "prepare", "prepare", status=409)
        await s.phase_failed("ck-bad", "prepare", AGENT_1, "agent_prepare_incomplete")
        await s.phase("ck-bad", "rollback")
        await s.call("ck-bad", POLICY, "rollback", "resume")
        await s.phase_done("ck-bad", "rollback")
        await s.aborted("ck-bad", "prepare failed", resumed=[POLICY])


async def _write_one_good(url: str) -> None:
    async with Ledger.open(url) as ledger:
        s = Script(ledger)
        await s.start()
        await s.good_save("ck-1")


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, object]]:
    capsys.readouterr()
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_show_json_and_text(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_write_two_attempts, ledger_url)
    code, doc = _json(capsys, ["show", "ck-bad", "--ledger", ledger_url, "--json"])
    assert code == 0
    assert doc["outcome"] == "aborted"
    calls = doc["calls"]
    assert isinstance(calls, list)
    assert [(c["phase"], c["server"], c["outcome"]) for c in calls] == [
        ("prepare", POLICY, "acknowledged"),
        ("prepare", AGENT_1, "failed"),
        ("rollback", POLICY, "acknowledged"),
    ]
    assert all(c["outcome_seq"] == c["sent_seq"] + 1 for c in calls)
    matrix = doc["matrix"]
    assert isinstance(matrix, dict)
    assert matrix[AGENT_1]["rollback"] == {
        "intended": True,
        "sent": 0,
        "acknowledged": 0,
        "failed": 0,
        "unknown": 0,
        "compensated": 0,
        "state": "not sent",
    }
    assert matrix[POLICY]["rollback"]["state"] == "compensated"
    check = doc["check"]
    assert isinstance(check, dict)
    assert [v["rule"] for v in check["violations"]] == ["unsettled"]

    assert main(["show", "ck-good", "--ledger", ledger_url]) == 0
    out = capsys.readouterr().out
    assert "POST /agent-checkpoint/commit" in out
    assert "participant × phase" in out
    assert "\x1b[" not in out  # no colour codes when stdout is not a terminal

    assert main(["show", "missing", "--ledger", ledger_url]) == 1
    assert "no attempt 'missing'" in capsys.readouterr().err


def test_check_exit_codes(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_write_two_attempts, ledger_url)
    code, doc = _json(capsys, ["check", "ck-good", "--ledger", ledger_url, "--json"])
    assert (code, doc["ok"], doc["violations"]) == (0, True, [])
    code, doc = _json(capsys, ["check", "ck-bad", "--ledger", ledger_url, "--json"])
    assert code == 1
    violations = doc["violations"]
    assert isinstance(violations, list)
    assert [(v["rule"], v["server"]) for v in violations] == [("unsettled", AGENT_1)]
    code, doc = _json(capsys, ["check", "--ledger", ledger_url, "--json"])
    assert code == 1
    assert doc["attempts"] == {"ck-bad": "judged", "ck-good": "judged"}
    assert main(["check", "--ledger", ledger_url]) == 1
    assert "unsettled" in capsys.readouterr().out


def test_replay_verify_includes_protocol(ledger_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_write_one_good, ledger_url)
    code, doc = _json(capsys, ["replay", "--verify", "--ledger", ledger_url, "--json"])
    assert code == 0
    protocol = doc["protocol"]
    assert isinstance(protocol, dict)
    assert protocol["ok"] is True
    anyio.run(_write_two_attempts, ledger_url)
    code, doc = _json(capsys, ["replay", "--verify", "--ledger", ledger_url, "--json"])
    assert code == 1
    assert doc["chain"] == {"ok": True, "first_bad_seq": None, "problem": None}
    protocol = doc["protocol"]
    assert isinstance(protocol, dict)
    assert [v["rule"] for v in protocol["violations"]] == ["unsettled"]
    # without --verify the protocol check is not run and does not change the exit code
    code, doc = _json(capsys, ["replay", "--ledger", ledger_url, "--json"])
    assert code == 0
    assert "protocol" not in doc


# -- bundles ------------------------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write(path: Path, lines: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_whole_ledger_bundle_round_trip(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_write_two_attempts, ledger_url)
    out = tmp_path / "all.jsonl"
    code, doc = _json(capsys, ["export", "--ledger", ledger_url, "--out", str(out), "--json"])
    assert code == 0
    lines = _lines(out)
    header = lines[0]
    assert header["format"] == "quiesce-audit-bundle"
    assert header["checkpoint"] is None
    events = [line for line in lines if line.get("type") == "event"]
    source = header["source"]
    assert isinstance(source, dict)
    assert doc["runs"] == [[1, source["head_seq"]]]
    assert events[-1]["hash"] == source["head_hash"]
    code, result = _json(capsys, ["verify-bundle", str(out), "--json"])
    assert (code, result["ok"], result["complete"]) == (0, True, True)
    assert main(["verify-bundle", str(out)]) == 0
    assert "complete chain" in capsys.readouterr().out


def test_one_attempt_bundle_carries_anchors(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_write_two_attempts, ledger_url)
    out = tmp_path / "one.jsonl"
    assert main(["export", "--ledger", ledger_url, "--checkpoint", "ck-bad", "--out", str(out)]) == 0
    lines = _lines(out)
    assert lines[0]["checkpoint"] == "ck-bad"
    events = [line for line in lines if line.get("type") == "event"]
    assert {e["checkpoint_id"] for e in events} == {None, "ck-bad"}
    # context: the coordinator's start, and the discovery the attempt ran on (which servers are
    # drain-only, and in which stage each is)
    assert [e["kind"] for e in events if e["checkpoint_id"] is None] == [
        "coordinator.started",
        "discovery.completed",
    ]
    anchors = [(i, line) for i, line in enumerate(lines) if line.get("type") == "anchor"]
    assert len(anchors) == 2  # seq 1 (coordinator.started, then the discovery), then the attempt's run
    for index, anchor in anchors:
        nxt = lines[index + 1]
        assert nxt["seq"] == anchor["seq"] + 1
        assert nxt["prev_hash"] == anchor["hash"]
    code, result = _json(capsys, ["verify-bundle", str(out), "--json"])
    assert (code, result["ok"], result["complete"]) == (0, True, False)
    assert main(["export", "--ledger", ledger_url, "--checkpoint", "nope", "--out", str(out)]) == 1


def test_tampered_bundles_name_the_seq(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_write_two_attempts, ledger_url)
    good = tmp_path / "b.jsonl"
    assert main(["export", "--ledger", ledger_url, "--checkpoint", "ck-good", "--out", str(good)]) == 0
    lines = _lines(good)
    event_at = {line["seq"]: i for i, line in enumerate(lines) if line.get("type") == "event"}
    target = sorted(event_at)[6]

    def verify(name: str, edited: list[dict[str, object]]) -> dict[str, object]:
        path = tmp_path / name
        _write(path, edited)
        capsys.readouterr()
        code = main(["verify-bundle", str(path), "--json"])
        doc: dict[str, object] = json.loads(capsys.readouterr().out)
        assert code == 1
        assert doc["ok"] is False
        return doc

    def seqs(doc: dict[str, object]) -> list[object]:
        problems = doc["problems"]
        assert isinstance(problems, list)
        return [p["seq"] for p in problems]

    # an altered payload: the event's own hash no longer matches
    edited = [dict(line) for line in lines]
    data = dict(edited[event_at[target]]["data"])
    data["phase"] = "forged"
    edited[event_at[target]]["data"] = data
    assert seqs(verify("altered.jsonl", edited)) == [target]

    # an altered payload with a recomputed hash: the next event's link breaks
    from quiesce.tools.audit.bundle import event_hash

    edited[event_at[target]]["hash"] = event_hash(edited[event_at[target]])
    doc = verify("rehashed.jsonl", edited)
    assert seqs(doc)[0] == target + 1

    # a removed event inside a run
    edited = [line for i, line in enumerate(lines) if i != event_at[target]]
    assert target + 1 in seqs(verify("removed.jsonl", edited))

    # a forged anchor (in a bundle of ck-bad, whose events are not next to the ledger's start)
    bad = tmp_path / "bad.jsonl"
    assert main(["export", "--ledger", ledger_url, "--checkpoint", "ck-bad", "--out", str(bad)]) == 0
    edited = [dict(line) for line in _lines(bad)]
    anchor_index = next(
        i for i, line in enumerate(edited) if line.get("type") == "anchor" and line["seq"] != 0
    )
    edited[anchor_index]["hash"] = "f" * 64
    assert seqs(verify("anchor.jsonl", edited))[0] == edited[anchor_index + 1]["seq"]

    # truncated: no end line
    doc = verify("truncated.jsonl", lines[:-3])
    assert any("truncated" in p["message"] for p in doc["problems"])  # type: ignore[attr-defined]

    # the human output names the seq too
    path = tmp_path / "altered.jsonl"
    assert main(["verify-bundle", str(path)]) == 1
    assert f"BAD seq {target}: hash does not match" in capsys.readouterr().out

    # not a bundle at all
    (tmp_path / "junk.jsonl").write_text("hello\n", encoding="utf-8")
    assert main(["verify-bundle", str(tmp_path / "junk.jsonl")]) == 1
    assert main(["verify-bundle", str(tmp_path / "absent.jsonl")]) == 2


def test_whole_bundle_missing_tail_detected(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dropping the last events and rewriting the end line still fails: the header's head is unmet."""
    anyio.run(_write_two_attempts, ledger_url)
    out = tmp_path / "all.jsonl"
    assert main(["export", "--ledger", ledger_url, "--out", str(out)]) == 0
    lines = _lines(out)
    kept = lines[:-3]
    last = kept[-1]
    kept.append(
        {"type": "end", "events": len(kept) - 2, "runs": [[1, last["seq"]]], "last_hash": last["hash"]}
    )
    _write(out, kept)
    capsys.readouterr()
    assert main(["verify-bundle", str(out), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert any("whole-ledger bundle must hold" in p["message"] for p in doc["problems"])


def test_verify_bundle_against_a_ledger(
    ledger_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--ledger` ties a subset bundle's events and anchors to a live chain."""
    anyio.run(_write_two_attempts, ledger_url)
    out = tmp_path / "one.jsonl"
    assert main(["export", "--ledger", ledger_url, "--checkpoint", "ck-bad", "--out", str(out)]) == 0
    code, doc = _json(capsys, ["verify-bundle", str(out), "--ledger", ledger_url, "--json"])
    assert (code, doc["ok"], doc["ledger_problems"]) == (0, True, [])

    other = f"sqlite+aiosqlite:///{tmp_path / 'other.db'}"  # same shape, different times: other hashes
    anyio.run(_write_two_attempts, other)
    code, doc = _json(capsys, ["verify-bundle", str(out), "--ledger", other, "--json"])
    assert code == 1
    assert doc["problems"] == []  # the bundle itself is intact
    problems = doc["ledger_problems"]
    assert isinstance(problems, list)
    events = [line for line in _lines(out) if line.get("type") == "event"]
    anchors = [line for line in _lines(out) if line.get("type") == "anchor" and line["seq"] != 0]
    assert sorted(p["seq"] for p in problems) == sorted(
        [e["seq"] for e in events] + [a["seq"] for a in anchors]
    )
    assert main(["verify-bundle", str(out), "--ledger", other]) == 1
    assert "differs from the ledger's" in capsys.readouterr().out
