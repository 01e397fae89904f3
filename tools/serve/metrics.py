"""The service's Prometheus metrics (`/metrics`), folded from the events its coordinator commits.

`Metrics.observe(events)` runs in the coordinator's `observe` hook (committed events, seq order),
so every figure is what the ledger says happened, not what a request handler believed. It only
keeps the events; `fold` counts them, on the event loop but off the operations' path: the service
folds every `service.WATCHDOG_S` and before each scrape (`unresolved` and `resolve` fold first),
so a scrape shows every event committed before it. `scrape` itself only renders (it may run in a
worker thread):

- `quiesce_attempts_total{kind,outcome}` — an attempt's terminal event: `attempt.completed` (its
  outcome), `attempt.aborted` (aborted), `recovery.completed` (abandoned);
- `quiesce_phase_duration_seconds{phase,outcome}` — `phase.started` → `phase.completed` /
  `phase.failed` (event times); phase `rollback`: `attempt.aborting` → `attempt.aborted`;
- `quiesce_control_call_seconds{route,outcome}` — `elapsed_s` of `call.replied` / `call.failed`;
  route = method and path of its `call.sent`; outcome `replied` or the failure (`timeout`,
  `connect`, `http`, `protocol`);
- `quiesce_rollbacks_total` — `attempt.aborted` of a save;
- `quiesce_recoveries_total` — `recovery.completed`;
- `quiesce_fenced_appends_total` — an operation that ended in `FencedError` (`Metrics.fenced`);
- `quiesce_lease_held` — 1 while this service is the active, writable coordinator;
- `quiesce_ledger_commit_seconds` — each ledger transaction (`Ledger.on_commit`);
- `quiesce_seconds_since_last_published` — now − the last `attempt.published` (seeded from the
  ledger at start; NaN before any);
- `quiesce_rollouts_captured_total`, `quiesce_rollouts_restarted_total`,
  `quiesce_rollouts_retired_total`, `quiesce_rollouts_lost_total` — the rollout lineage's steps
  (`quiesce.ledger.lineage`), one per rollout attempt: captured by a published save; left out of
  one as a restart, discarded by a restore or replaced by one (the trainer starts it over);
  retired; shown lost by a published save. A lineage fold (`tools.audit.lineage.StepFold`, no
  steps kept) is fed the observed events; it is seeded at each term's start with the ledger's
  lineage events before the first event this process observed, which are not counted (as every
  counter here, they count from the process's start), so a restore before the start still
  shows a later loss.

State kept between events is bounded by what is in flight (and the lineage fold: a few hundred
bytes per rollout): open calls (by call id) and open
phases and attempts (by checkpoint id), each dropped at its end. An attempt this process did not
see start (one a dead coordinator left, ended by recovery or by `resume`) is resolved later from
the `attempts` projection (`unresolved`, `resolve`): its kind is not in its terminal event.
Label values come from fixed vocabularies or the route table, never from free ledger text.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from quiesce.ledger import AttemptRow, Event
from quiesce.ledger.lineage import LINEAGE_KINDS, Rollout, Step
from quiesce.tools.audit.lineage import StepFold

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
_CONTROL_PREFIX: Final = "/ng-control/v1"
_CALL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)
_PHASE_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60, 300)
_COMMIT_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25)
_OUTCOMES: Final = frozenset({"published", "restored", "resumed", "aborted", "abandoned"})
_FAILURES: Final = frozenset({"timeout", "connect", "http", "protocol"})
_ENDED_KEPT: Final = 1024
_LINEAGE_KINDS: Final = frozenset(LINEAGE_KINDS)


#: no `*_created` series: they double what a scrape carries and say nothing a counter's reset does not
disable_created_metrics()  # type: ignore[no-untyped-call]  # the library leaves it unannotated


def event_ts(at: str) -> float:
    """Unix seconds of an `Event.at` (`...Z`)."""
    return datetime.fromisoformat(at).timestamp()


class Metrics:
    """One registry per service process (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        #: the two gauges read at each scrape (a clock, the lease): never cached
        self.live = live = CollectorRegistry(auto_describe=True)
        self._version = 0  # bumped by every change to `registry`
        self._rendered: tuple[int, bytes] = (-1, b"")
        self.attempts = Counter(
            "quiesce_attempts", "Attempts ended, by kind and outcome", ["kind", "outcome"], registry=registry
        )
        self.phases = Histogram(
            "quiesce_phase_duration_seconds",
            "Duration of each phase of an attempt, from its events",
            ["phase", "outcome"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        self.calls = Histogram(
            "quiesce_control_call_seconds",
            "Control-call latency by route and outcome",
            ["route", "outcome"],
            buckets=_CALL_BUCKETS,
            registry=registry,
        )
        self.rollbacks = Counter("quiesce_rollbacks", "Save attempts rolled back", registry=registry)
        self.recoveries = Counter("quiesce_recoveries", "Recovery runs completed", registry=registry)
        self.fenced_appends = Counter(
            "quiesce_fenced_appends", "Operations refused because a newer coordinator owns the ledger",
            registry=registry,
        )  # fmt: skip
        self.lease_held = Gauge(
            "quiesce_lease_held", "1 while this service is the active coordinator", registry=live
        )
        self.commits = Histogram(
            "quiesce_ledger_commit_seconds",
            "Ledger append latency: one transaction",
            buckets=_COMMIT_BUCKETS,
            registry=registry,
        )
        self.since_published = Gauge(
            "quiesce_seconds_since_last_published",
            "Seconds since the last published snapshot (NaN before any)",
            registry=live,
        )
        self.rollouts_captured = Counter(
            "quiesce_rollouts_captured", "Rollout attempts captured by published saves", registry=registry
        )
        self.rollouts_restarted = Counter(
            "quiesce_rollouts_restarted",
            "Rollout attempts the trainer starts over: left out of a save as restarts, discarded or"
            " replaced by a restore",
            registry=registry,
        )
        self.rollouts_retired = Counter(
            "quiesce_rollouts_retired", "Rollout attempts retired", registry=registry
        )
        self.rollouts_lost = Counter(
            "quiesce_rollouts_lost",
            "Restored rollout attempts a published save showed lost (not captured, finished, retired or"
            " restarted)",
            registry=registry,
        )
        self._step_counters: dict[str, Counter] = {
            "captured": self.rollouts_captured,
            "restart": self.rollouts_restarted,
            "discarded": self.rollouts_restarted,
            "retired": self.rollouts_retired,
            "lost": self.rollouts_lost,
        }
        #: the lineage as of the last folded event; None until seeded this term (`lineage_seed`)
        self._lineage: StepFold | None = None
        self._lineage_held: list[Event] = []  # lineage events folded before the seed, in order
        self._term_first: int | None = None  # the seq of the first event observed this term
        self.last_published_ts: float | None = None
        self.since_published.set_function(self._since_published)
        self._lease: Callable[[], bool] = lambda: False
        self.lease_held.set_function(lambda: 1.0 if self._lease() else 0.0)
        self._calls: dict[str, tuple[str, float]] = {}  # call id → (route, sent ts)
        self._phases: dict[tuple[str, str], float] = {}  # (checkpoint id, phase) → start ts
        self._aborting: dict[str, float] = {}  # checkpoint id → attempt.aborting ts
        self._kinds: dict[str, str] = {}  # open attempts seen starting: checkpoint id → kind
        #: checkpoint ids that ended without this process seeing them start: kind from the projection
        self._unresolved: dict[str, str] = {}
        self._pending: list[Event] = []  # observed, not yet folded
        #: the last attempts that ended: a restore's later resume ends it again, counted once (as the
        #: projection keeps its first outcome)
        self._ended_ids: OrderedDict[str, None] = OrderedDict()

    def lease_from(self, held: Callable[[], bool]) -> None:
        self._lease = held

    def _since_published(self) -> float:
        if self.last_published_ts is None:
            return math.nan
        return max(0.0, time.time() - self.last_published_ts)

    @property
    def stale(self) -> bool:
        """Whether the next `scrape` renders the counters and histograms again."""
        return self._rendered[0] != self._version

    def scrape(self) -> bytes:
        """The exposition text. The counters and histograms are rendered again only after they
        changed (the library's renderer costs tens of microseconds per line here); the two live
        gauges are read every time."""
        version, text = self._rendered
        if version != self._version:
            version = self._version
            text = generate_latest(self.registry)
            self._rendered = (version, text)
        return text + generate_latest(self.live)

    # -- from the ledger -------------------------------------------------------------------------

    def seed(self, last_published: AttemptRow | None) -> None:
        """Start `since_published` from the newest published attempt in the ledger."""
        if last_published is not None and last_published.ended_at is not None:
            self.last_published_ts = max(self.last_published_ts or 0.0, event_ts(last_published.ended_at))

    def commit(self, seconds: float, rows: int) -> None:
        """`Ledger.on_commit`."""
        self._version += 1
        self.commits.observe(seconds)

    def fenced(self) -> None:
        self._version += 1
        self.fenced_appends.inc()

    def observe(self, events: Sequence[Event]) -> None:
        """Keep committed events for `fold` (the coordinator's `observe` hook): never raises into
        the ledger, and costs a save nothing but the keeping."""
        if self._term_first is None and events:
            self._term_first = events[0].seq
        self._pending.extend(events)
        self._version += 1

    # -- the rollout lineage ---------------------------------------------------------------------

    def new_term(self) -> None:
        """A coordinator term begins (before its ledger is opened): what this process observed so
        far is folded; the lineage waits for its seed again (another coordinator may have written
        the ledger since)."""
        self.fold()
        self._lineage, self._lineage_held, self._term_first = None, [], None

    def lineage_seed(self) -> tuple[StepFold, int | None]:
        """A fold to feed the ledger's lineage events with, in seq order, up to (not including) the
        seq returned — the first event observed this term (None: none observed yet, feed them
        all) — then hand to `seeded`. What it is fed is not counted."""
        return StepFold(), self._term_first

    def seeded(self, fold: StepFold) -> None:
        """Take the fed `fold` as the lineage; the lineage events folded before it are fed now."""
        fold.on_step = self._counted
        self._lineage = fold
        held, self._lineage_held = self._lineage_held, []
        for event in held:
            fold.feed(event)
        self._version += 1

    def _counted(self, rollout: Rollout, step: Step) -> None:
        counter = self._step_counters.get(step.what)
        if counter is not None:
            counter.inc()

    def fold(self) -> None:
        """Count the events observed since the last fold, in their order."""
        pending, self._pending = self._pending, []
        for event in pending:
            self._one(event)

    @property
    def unresolved(self) -> dict[str, str]:
        """Checkpoint ids (→ outcome) that ended without this process seeing them start: their
        kind is read from the `attempts` projection and handed to `resolve`."""
        self.fold()
        return self._unresolved

    def _one(self, event: Event) -> None:
        kind = event.kind
        cid = event.checkpoint_id
        if kind in _LINEAGE_KINDS:
            if self._lineage is None:
                self._lineage_held.append(event)
            else:
                self._lineage.feed(event)
        if kind == "call.sent":
            if event.call_id is not None:
                path = str(event.data.get("path", "")).removeprefix(_CONTROL_PREFIX)
                route = f"{event.data.get('method', '?')} {path.split('?', 1)[0]}"
                self._calls[event.call_id] = (route, event_ts(event.at))
        elif kind in ("call.replied", "call.failed"):
            sent = self._calls.pop(event.call_id or "", None)
            if sent is not None:
                outcome = "replied" if kind == "call.replied" else str(event.data.get("error"))
                elapsed = event.data.get("elapsed_s")
                seconds = float(elapsed) if isinstance(elapsed, int | float) else event_ts(event.at) - sent[1]
                self.calls.labels(
                    sent[0], outcome if outcome in _FAILURES | {"replied"} else "other"
                ).observe(max(0.0, seconds))
        elif cid is None:
            if kind == "recovery.completed":
                self.recoveries.inc()
                outcomes = event.data.get("outcomes")
                if isinstance(outcomes, dict):
                    for key, value in outcomes.items():
                        if value == "abandoned" and isinstance(key, str):
                            self._ended(key, "abandoned", event)
        elif kind == "attempt.started":
            self._kinds[cid] = str(event.data.get("kind", "save"))
        elif kind == "phase.started":
            self._phases[(cid, str(event.data.get("phase")))] = event_ts(event.at)
        elif kind in ("phase.completed", "phase.failed"):
            phase = str(event.data.get("phase"))
            began = self._phases.pop((cid, phase), None)
            if began is not None:
                outcome = "completed" if kind == "phase.completed" else "failed"
                self.phases.labels(_phase_label(phase), outcome).observe(max(0.0, event_ts(event.at) - began))
        elif kind == "attempt.published":
            self.last_published_ts = event_ts(event.at)
        elif kind == "attempt.aborting":
            self._aborting[cid] = event_ts(event.at)
        elif kind == "attempt.aborted":
            began = self._aborting.pop(cid, None)
            if began is not None:
                self.phases.labels("rollback", "completed").observe(max(0.0, event_ts(event.at) - began))
            self._ended(cid, "aborted", event)
        elif kind == "attempt.completed":
            outcome = str(event.data.get("outcome"))
            self._ended(cid, outcome if outcome in _OUTCOMES else "completed", event)

    def _ended(self, cid: str, outcome: str, event: Event) -> None:
        if cid in self._ended_ids:
            return
        self._ended_ids[cid] = None
        if len(self._ended_ids) > _ENDED_KEPT:
            self._ended_ids.popitem(last=False)
        for key in [k for k in self._phases if k[0] == cid]:
            del self._phases[key]
        self._aborting.pop(cid, None)
        kind = self._kinds.pop(cid, None)
        if kind is None:
            self._unresolved[cid] = outcome
            return
        self.count(kind, outcome)

    def count(self, kind: str, outcome: str) -> None:
        self.attempts.labels(kind if kind in ("save", "restore") else "other", outcome).inc()
        if outcome == "aborted" and kind == "save":
            self.rollbacks.inc()

    def resolve(self, rows: dict[str, AttemptRow | None]) -> None:
        """Count the `unresolved` attempts whose projection rows were read (kind from the row)."""
        self.fold()
        self._version += 1
        for cid, row in rows.items():
            outcome = self._unresolved.pop(cid, None)
            if outcome is not None:
                self.count(row.kind if row is not None else "other", outcome)


def _phase_label(phase: str) -> str:
    return phase if phase in ("prepare", "commit", "publish", "resume", "restore", "rollback") else "other"
