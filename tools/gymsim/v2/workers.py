"""The v2 environment with several workers behind one coordinator (spec `workers: N`, N > 1, with
`worker_mode: coordinator`), shaped after Gym's `_checkpoint/participant_workers.py`
(`CoordinatedServerParticipant`) and `_checkpoint/workers.py` (`CoordinatedParticipant`).

Behaviour kept from the single-process environment: N worker tables, each closed and reporting on
its own; one records file and one manifest for the whole server; restored records stay with the
coordinator until the one worker that runs the replacement's `/run` claims it (exactly one claim
succeeds).

What goes on the wire, as Gym's coordinator sends it:
- Status adds `workers: int` (workers connected: every one, here), `expected_workers: int` (the
  configured N), `restored_pending: list[str]` (sorted claim keys, the replacements' capture keys),
  `session_aliases: int` and `session_placements: int` (sizes of the routing tables, not the tables).
- The merged report: `ready` iff every worker is; `blockers` the sorted union of the workers'
  blockers; `counts` the per-key sum of the workers' counts plus `workers`; `restarts` the sorted
  union of the workers' restarts. Gym's `merge()` in `participant_workers.py` keeps `restarts` (an
  earlier version of that file dropped it); this follows the file as it stands.
- The manifest adds `session_owners: list[str]` (sorted owners the exported records name) and
  `placed_sessions: list[str]` (sorted session ids placed without an owner).

An environment's records are Gym's `EpisodeRecord` (`_checkpoint/environment.py`): `episode_id`,
`task_digest`, `boundary`, and no `owner` — episodes are claimed by key, never routed by owner as
resources and agent sessions are — so both manifest lists are empty and the routing tables stay
empty: both counts are 0.
"""

from __future__ import annotations

from typing import Any

from quiesce.coordinator.protocol_v2 import EpisodeId, PrepareReport
from quiesce.tools.gymsim.v2.environment import EnvironmentParticipant
from quiesce.tools.gymsim.v2.plane import report


class CoordinatedEnvironment(EnvironmentParticipant):
    """The coordinator of a multi-worker environment: the server's one participant."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        #: Owners the records of the last export name (Gym: `_exported_owners`).
        self.exported_owners: set[str] = set()
        #: Pre-crash session owner → the worker holding its sessions; session id → its worker.
        #: Filled only by session records, which an environment never exports.
        self.aliases: dict[str, str] = {}
        self.placements: dict[str, str] = {}

    def readiness(self) -> PrepareReport:
        parts = [self._worker_report(w) for w in range(self.workers)]
        counts: dict[str, int] = {}
        for part in parts:
            for key, value in part.counts.items():
                counts[key] = counts.get(key, 0) + value
        counts["workers"] = self.workers
        blockers = [ep.key for ep in self.live.values() if (ep.mid_turn or ep.retired) and not ep.restart]
        return report(blockers, counts, [key for part in parts for key in part.restarts])

    def export(self, scope: list[EpisodeId] | None) -> list[dict[str, Any]]:
        records = super().export(scope)
        self.exported_owners = {owner for r in records if isinstance(owner := r.get("owner"), str) and owner}
        return records

    def manifest_extra(self) -> dict[str, Any]:
        return {"session_owners": sorted(self.exported_owners), "placed_sessions": sorted(self.placements)}

    def status_extra(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "expected_workers": self.workers,
            "restored_pending": sorted(self.restored),
            "session_aliases": len(self.aliases),
            "session_placements": len(self.placements),
        }

    def worker_reports(self) -> list[dict[str, Any]]:
        """Each worker's own table (gymsim's admin view; Gym keeps these inside the coordinator)."""
        return [
            {
                "worker": w,
                "closed": self.closed[w],
                "episodes": self._load(w),
                "report": self._worker_report(w).model_dump(mode="json"),
            }
            for w in range(self.workers)
        ]
