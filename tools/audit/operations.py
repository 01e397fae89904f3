"""Retire and forget on Gym's unified plane, as the ledger records them: `EpisodeOperation`.

`episodes.retired` records a retire (the capture keys asked, the servers called in order, who
failed and why, and the reason: by request, or to clean up a failed restore — then under the
restore's checkpoint id); `rollouts.forgotten` a forget (it names no attempt). Only the event
module is imported here: `quiesce history` lists operations without loading the wire models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quiesce.ledger.events import Event


@dataclass(frozen=True, slots=True)
class EpisodeOperation:
    """One retire or forget (`episodes.retired` / `rollouts.forgotten`): what was asked (capture
    keys, or rollout ids), of whom (in call order), who failed and why. `checkpoint_id` is the
    attempt it was recorded under (a failed restore's cleanup, or a retire while restored), None
    for an operation of its own."""

    seq: int
    at: str
    epoch: int
    operation: str
    checkpoint_id: str | None
    items: tuple[str, ...]
    servers: tuple[str, ...]
    failed: dict[str, str]
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "at": self.at,
            "epoch": self.epoch,
            "operation": self.operation,
            "checkpoint_id": self.checkpoint_id,
            "items": list(self.items),
            "servers": list(self.servers),
            "failed": dict(self.failed),
            "reason": self.reason,
        }


def episode_operation(event: Event) -> EpisodeOperation | None:
    """The `EpisodeOperation` an `episodes.retired` or `rollouts.forgotten` event records."""
    data = event.data
    if event.kind == "episodes.retired":
        operation, items = "retire", data.get("episodes")
    elif event.kind == "rollouts.forgotten":
        operation, items = "forget", data.get("rollout_ids")
    else:
        return None
    failed = data.get("failed")
    return EpisodeOperation(
        seq=event.seq,
        at=event.at,
        epoch=event.epoch,
        operation=operation,
        checkpoint_id=event.checkpoint_id,
        items=tuple(str(i) for i in items) if isinstance(items, list) else (),
        servers=tuple(str(s) for s in data.get("servers") or ()),
        failed={str(k): str(v) for k, v in failed.items()} if isinstance(failed, dict) else {},
        reason=reason if isinstance(reason := data.get("reason"), str) else None,
    )
