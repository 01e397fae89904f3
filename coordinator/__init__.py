"""quiesce's coordinator: RL's side of NeMo Gym's checkpoint control planes (v1 and unified), recorded.

Public API::

    from quiesce import Coordinator, load_config
    async with Coordinator.open("cluster.yaml") as coord:
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:
            ...  # write the trainer's half into attempt.staging_dir

See `quiesce.coordinator.coordinator.Coordinator` for the step-wise methods and the invariants.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiesce.coordinator.attempt import (
        Attempt,
        Outcome,
        Progress,
        ProgressCallback,
        Resubmission,
        UnknownResubmissions,
    )
    from quiesce.coordinator.config import (
        ClusterConfig,
        ServerConfig,
        load_config,
        parse_config,
        resolve_token,
    )
    from quiesce.coordinator.coordinator import Coordinator, read_history
    from quiesce.coordinator.discovery import Discovery, Member
    from quiesce.coordinator.errors import (
        AcknowledgementError,
        ConfigError,
        DeadlineExceeded,
        DiscoveryError,
        FencedError,
        LedgerError,
        MissingExtra,
        PhaseError,
        QuiesceError,
        ServersHeld,
        SnapshotError,
    )
    from quiesce.coordinator.protocol_v2 import EpisodeId
    from quiesce.coordinator.publish import Snapshot, load_snapshot, read_latest, verify_snapshot
    from quiesce.coordinator.retire import RetireOutcome
    from quiesce.coordinator.status import ClusterStatus
    from quiesce.ledger.lineage import Rollout, Step

#: Public names and the module each lives in. Imported on first use, so that importing
#: `quiesce.coordinator.errors` (the CLI does, at start) does not load httpx, the ledger and pydantic models.
_EXPORTS: dict[str, str] = {
    "AcknowledgementError": "quiesce.coordinator.errors",
    "Attempt": "quiesce.coordinator.attempt",
    "ClusterConfig": "quiesce.coordinator.config",
    "ConfigError": "quiesce.coordinator.errors",
    "Coordinator": "quiesce.coordinator.coordinator",
    "DeadlineExceeded": "quiesce.coordinator.errors",
    "Discovery": "quiesce.coordinator.discovery",
    "EpisodeId": "quiesce.coordinator.protocol_v2",
    "RetireOutcome": "quiesce.coordinator.retire",
    "DiscoveryError": "quiesce.coordinator.errors",
    "FencedError": "quiesce.coordinator.errors",
    "LedgerError": "quiesce.coordinator.errors",
    "Member": "quiesce.coordinator.discovery",
    "MissingExtra": "quiesce.coordinator.errors",
    "Outcome": "quiesce.coordinator.attempt",
    "PhaseError": "quiesce.coordinator.errors",
    "Progress": "quiesce.coordinator.attempt",
    "ProgressCallback": "quiesce.coordinator.attempt",
    "QuiesceError": "quiesce.coordinator.errors",
    "Resubmission": "quiesce.coordinator.attempt",
    "UnknownResubmissions": "quiesce.coordinator.attempt",
    "Rollout": "quiesce.ledger.lineage",
    "Step": "quiesce.ledger.lineage",
    "ServerConfig": "quiesce.coordinator.config",
    "ServersHeld": "quiesce.coordinator.errors",
    "ClusterStatus": "quiesce.coordinator.status",
    "Snapshot": "quiesce.coordinator.publish",
    "SnapshotError": "quiesce.coordinator.errors",
    "load_config": "quiesce.coordinator.config",
    "load_snapshot": "quiesce.coordinator.publish",
    "parse_config": "quiesce.coordinator.config",
    "read_history": "quiesce.coordinator.coordinator",
    "read_latest": "quiesce.coordinator.publish",
    "resolve_token": "quiesce.coordinator.config",
    "verify_snapshot": "quiesce.coordinator.publish",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AcknowledgementError",
    "Attempt",
    "ClusterConfig",
    "ClusterStatus",
    "ConfigError",
    "Coordinator",
    "DeadlineExceeded",
    "Discovery",
    "DiscoveryError",
    "EpisodeId",
    "FencedError",
    "LedgerError",
    "Member",
    "MissingExtra",
    "Outcome",
    "PhaseError",
    "Progress",
    "ProgressCallback",
    "QuiesceError",
    "Resubmission",
    "RetireOutcome",
    "Rollout",
    "ServerConfig",
    "ServersHeld",
    "Snapshot",
    "SnapshotError",
    "Step",
    "UnknownResubmissions",
    "load_config",
    "load_snapshot",
    "parse_config",
    "read_history",
    "read_latest",
    "resolve_token",
    "verify_snapshot",
]
