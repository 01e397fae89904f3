"""The rollout lineage fold (`quiesce.ledger.lineage`) on hand-written event sequences: each rule
fires on the sequence that breaks it, and stays quiet on the one that does not. The same rules are
shown against real gymsim clusters in `tests/coordinator/test_lineage_clusters.py`."""

from __future__ import annotations

from typing import Any

from quiesce.ledger import Event
from quiesce.ledger.lineage import LineageFold, LineageReport, expect_difference


class Log:
    """Builds events in seq order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, event_kind: str, cid: str | None = None, server: str | None = None, **data: Any) -> Log:
        seq = len(self.events) + 1
        self.events.append(
            Event(seq, "2026-01-01T00:00:00.000000Z", event_kind, cid, server, None, 1, data, "", "")
        )
        return self

    def discovered(self, **servers: str | tuple[str, list[str]]) -> Log:
        participants = []
        for name, spec in servers.items():
            component, features = spec if isinstance(spec, tuple) else (spec, None)
            p: dict[str, Any] = {"name": name, "component": component, "mode": "export_restore", "url": "u"}
            if features is not None:
                p["features"] = features
            participants.append(p)
        return self.add("discovery.completed", participants=participants)

    def save_v2(self, cid: str, scope: list[str], exported: dict[str, list[str]], **extra: Any) -> Log:
        participants = list(exported)
        self.add("attempt.started", cid, kind="save", plane="v2", participants=participants, deadline_ts=1.0)
        self.add("episodes.scoped", cid, scope=scope, source="given", restarts=extra.get("restarts", {}))
        self.add("episodes.exported", cid, exported=exported)
        if extra.get("aborted"):
            return self.add("attempt.aborted", cid, reason="x")
        return self.add("attempt.published", cid, final_dir="/f")

    def save_v1(self, cid: str, captured: dict[str, list[tuple[str, int]]]) -> Log:
        self.add("attempt.started", cid, kind="save", participants=list(captured), deadline_ts=1.0)
        self.add(
            "rollouts.captured",
            cid,
            captured={
                a: [{"rollout_id": r, "attempt": n} for r, n in pairs] for a, pairs in captured.items()
            },
        )
        return self.add("attempt.published", cid, final_dir="/f")

    def restore_v2(self, cid: str, source: str, restored: dict[str, list[str]]) -> Log:
        self.add(
            "attempt.started", cid, kind="restore", plane="v2", participants=list(restored), deadline_ts=1.0
        )
        return self.add("episodes.restored", cid, source_checkpoint_id=source, scope=[], restored=restored)

    def restore_v1(
        self, cid: str, source: str, continued: dict[str, list[tuple[str, int]]], **extra: Any
    ) -> Log:
        def pairs(groups: dict[str, list[tuple[str, int]]]) -> dict[str, list[dict[str, Any]]]:
            return {a: [{"rollout_id": r, "attempt": n} for r, n in p] for a, p in groups.items()}

        self.add("attempt.started", cid, kind="restore", participants=list(continued), deadline_ts=1.0)
        return self.add(
            "rollouts.continued",
            cid,
            source_checkpoint_id=source,
            continued=pairs(continued),
            discarded=pairs(extra.get("discarded", {})),
        )

    def fold(self) -> LineageReport:
        return LineageFold(steps=True).feed_all(self.events).finish()


V2 = {"env": "environment", "model": "model"}


def rules(report: LineageReport) -> list[tuple[str, str]]:
    return [(v.rule, v.rollout_id) for v in report.violations]


def test_a_clean_v2_run_accounts_for_every_rollout() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1", "r2"], {"env": ["r1", "r2"], "model": ["r1", "r2"]})
    log.restore_v2("c2", "c1", {"env": ["r1-a1", "r2-a1"], "model": ["r1-a1", "r2-a1"]})
    log.add("rollouts.forgotten", rollout_ids=["r2"], servers=["env"])  # r2 finished
    log.save_v2("c3", ["r1-a1", "r3"], {"env": ["r1-a1", "r3"], "model": ["r1-a1"]})
    report = log.fold()
    assert report.violations == []
    assert report.warnings == []
    assert {r: (x.state, x.attempt) for r, x in report.rollouts.items()} == {
        "r1": ("live", 1),
        "r2": ("finished", 1),
        "r3": ("live", 0),
    }
    assert [s.what for s in report.rollouts["r1"].steps] == ["captured", "continued", "captured"]
    assert report.counts() == {"live": 2, "restarted": 0, "retired": 0, "finished": 1, "lost": 0}


def test_a_continued_attempt_the_next_save_does_not_capture_is_lost() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1", "r2"], {"env": ["r1", "r2"]})
    log.restore_v2("c2", "c1", {"env": ["r1-a1", "r2-a1"]})
    log.save_v2("c3", ["r1-a1"], {"env": ["r1-a1"]})  # the trainer dropped r2's restored attempt
    report = log.fold()
    assert rules(report) == [("lost", "r2")]
    assert report.violations[0].checkpoint_id == "c3"
    assert "restore c2" in report.violations[0].message
    assert report.rollouts["r2"].state == "lost"


def test_a_continued_attempt_is_live_until_a_save_and_excused_by_retire_forget_or_restart() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["a", "b", "c", "d"], {"env": ["a", "b", "c", "d"]})
    log.restore_v2("c2", "c1", {"env": ["a-a1", "b-a1", "c-a1", "d-a1"]})
    assert log.fold().counts()["live"] == 4  # no later save yet: nothing is lost
    log.add("episodes.retired", episodes=["a-a1"], servers=["env"], reason="by request")
    log.add("rollouts.forgotten", rollout_ids=["b"], servers=["env"])
    log.save_v2("c3", ["d-a1"], {"env": ["d-a1"]}, restarts={"env": ["c-a1"]})
    report = log.fold()
    assert report.violations == []
    assert {r: x.state for r, x in report.rollouts.items()} == {
        "a": "retired",
        "b": "finished",
        "c": "restarted",
        "d": "live",
    }


def test_an_aborted_save_captures_nothing() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1"], {"env": ["r1"]})
    log.restore_v2("c2", "c1", {"env": ["r1-a1"]})
    log.save_v2("c3", [], {"env": []}, aborted=True)
    assert log.fold().violations == []  # the aborted save shows nothing missing
    log.save_v2("c4", [], {"env": []})
    assert rules(log.fold()) == [("lost", "r1")]


def test_two_attempts_of_one_rollout_live_at_once() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1", "r1-a1"], {"env": ["r1", "r1-a1"]})
    assert rules(log.fold()) == [("twice", "r1")]
    # an old attempt captured after a restore continued its next one
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1"], {"env": ["r1"]})
    log.restore_v2("c2", "c1", {"env": ["r1-a1"]})
    log.save_v2("c3", ["r1"], {"env": ["r1"]})
    assert rules(log.fold()) == [("twice", "r1")]


def test_a_retired_attempt_in_a_later_save_and_forget_lifts_the_mark() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1-a1"], {"env": ["r1-a1"]})
    log.add("episodes.retired", episodes=["r1-a1"], servers=["env"], reason="by request")
    log.save_v2("c2", ["r1"], {"env": ["r1"]})  # attempt 0 <= the mark
    report = log.fold()
    assert rules(report) == [("retired", "r1")]
    log.add("rollouts.forgotten", rollout_ids=["r1"], servers=["env"])
    log.save_v2("c3", ["r1"], {"env": ["r1"]})
    assert rules(log.fold()) == [("retired", "r1")]  # nothing new after the forget


def test_inventory_a_scoped_episode_no_environment_exported() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1", "r2"], {"env": ["r1"], "model": ["r1", "r2"]})
    report = log.fold()
    assert rules(report) == [("inventory", "r2")]
    # without an environment server, any participant's export holds it
    log = Log().discovered(model="model", agent="agent")
    log.save_v2("c1", ["r1", "r2"], {"model": ["r1"], "agent": ["r2"]})
    assert log.fold().violations == []
    log.save_v2("c2", ["r3"], {"model": [], "agent": []})
    assert rules(log.fold()) == [("inventory", "r3")]


def test_v1_continued_acknowledged_discarded_and_lost() -> None:
    acking = ("agent", ["completed_result_acknowledgement"])
    log = Log().discovered(a1=acking, model="model")
    log.save_v1("c1", {"a1": [("p1", 0), ("p2", 0), ("p3", 0), ("p4", 0)]})
    log.restore_v1("c2", "c1", {"a1": [("p1", 1), ("p2", 1), ("p3", 1)]}, discarded={"a1": [("p4", 1)]})
    log.add("rollouts.acknowledged", server="a1", executions=[{"rollout_id": "p2", "attempt": 1}])
    log.save_v1("c3", {"a1": [("p1", 1)]})
    report = log.fold()
    assert rules(report) == [("lost", "p3")]
    assert {r: x.state for r, x in report.rollouts.items()} == {
        "p1": "live",
        "p2": "finished",
        "p3": "lost",
        "p4": "restarted",
    }


def test_v1_an_agent_without_acknowledgement_gives_a_warning_not_a_violation() -> None:
    log = Log().discovered(a1="agent", model="model")  # no features recorded
    log.save_v1("c1", {"a1": [("p1", 0)]})
    log.restore_v1("c2", "c1", {"a1": [("p1", 1)]})
    log.save_v1("c3", {"a1": []})
    report = log.fold()
    assert report.violations == []
    assert [(w.rule, w.rollout_id) for w in report.warnings] == [("lost", "p1")]
    assert "--expect" in report.warnings[0].message


def test_a_rollout_that_leaves_between_saves_finished_and_a_restore_replaces_the_run() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1", "r2"], {"env": ["r1", "r2"]})
    log.save_v2("c2", ["r1", "r3"], {"env": ["r1", "r3"]})  # r2 finished in between
    log.restore_v2("c3", "c1", {"env": ["r1-a1"]})  # back at c1: r3 was live in the replaced run
    report = log.fold()
    assert report.violations == []
    assert {r: x.state for r, x in report.rollouts.items()} == {
        "r1": "live",
        "r2": "finished",
        "r3": "restarted",
    }
    assert report.rollouts["r2"].steps[-1].what == "ended"


def test_expect_names_every_difference() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1", "r2", "r3"], {"env": ["r1", "r2", "r3"]})
    log.add("episodes.retired", episodes=["r2"], servers=["env"], reason="by request")
    report = log.fold()
    found = expect_difference(report, [("r1", 0), ("r2", 0), ("r4", 0), ("r1", 1)])
    messages = sorted((v.rollout_id, v.message) for v in found)
    assert [r for r, _ in messages] == ["r1", "r1", "r2", "r3", "r4"]
    text = " | ".join(m for _, m in messages)
    assert "the ledger has attempt 0 live" in text  # r1: the trainer holds attempt 1 too
    assert "at once" in text
    assert "retired" in text  # r2
    assert "does not hold it" in text  # r3: live in the ledger, unknown to the trainer
    assert "never saw" in text  # r4
    assert expect_difference(report, [("r1", 0), ("r3", 0)]) == []


def test_a_retried_restore_continues_what_the_failed_one_retired() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1"], {"env": ["r1"]})
    log.restore_v2("c2", "c1", {"env": ["r1-a1"]})
    log.add("episodes.retired", "c2", episodes=["r1-a1"], servers=["env"], reason="the restore failed")
    assert log.fold().rollouts["r1"].state == "retired"
    log.restore_v2("c3", "c1", {"env": ["r1-a1"]})  # into fresh servers: no marks there
    log.save_v2("c4", ["r1-a1"], {"env": ["r1-a1"]})
    report = log.fold()
    assert report.violations == []
    assert (report.rollouts["r1"].state, report.rollouts["r1"].attempt) == ("live", 1)


def test_a_save_published_without_its_inventory_recorded_shows_nothing() -> None:
    log = Log().discovered(**V2)
    log.save_v2("c1", ["r1"], {"env": ["r1"]})
    log.restore_v2("c2", "c1", {"env": ["r1-a1"]})
    # recovery found c3's snapshot after a power loss took its scope and exports
    log.add("attempt.started", "c3", kind="save", plane="v2", participants=["env"], deadline_ts=1.0)
    log.add("attempt.published", "c3", final_dir="/f")
    log.add("attempt.started", "c4", kind="save", participants=["a1"], deadline_ts=1.0)  # v1, old ledger
    log.add("attempt.published", "c4", final_dir="/f")
    # a crash took c6's staged exports, not its scope (committed with the commit requests); its
    # manifest, written before anything else was committed, made it published
    log.add("attempt.started", "c6", kind="save", plane="v2", participants=["env"], deadline_ts=1.0)
    log.add("episodes.scoped", "c6", scope=["r1-a1", "r9"], source="given", restarts={})
    log.add("attempt.published", "c6", final_dir="/f")
    report = log.fold()
    assert report.violations == []
    assert (report.rollouts["r1"].state, report.rollouts["r1"].attempt) == ("live", 1)
    log.save_v2("c5", [], {"env": []})  # a save with its inventory: r1-a1 is missing from it
    assert rules(log.fold()) == [("lost", "r1")]
