"""quiesce's coordinator: RL's side of NeMo Gym's checkpoint control plane v1, recorded in the ledger.

Public API::

    from coordinator import Coordinator, load_config
    async with Coordinator.open("cluster.yaml") as coord:
        await coord.discover()
        async with coord.save(deadline_s=60) as attempt:
            ...  # write the trainer's half into attempt.staging_dir

See `coordinator.coordinator.Coordinator` for the step-wise methods and the invariants.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.attempt import Attempt, Outcome, Progress, ProgressCallback, Resubmission
    from coordinator.config import ClusterConfig, ServerConfig, load_config, parse_config, resolve_token
    from coordinator.coordinator import Coordinator, read_history
    from coordinator.discovery import Discovery, Member
    from coordinator.errors import (
        AcknowledgementError,
        ConfigError,
        DeadlineExceeded,
        DiscoveryError,
        FencedError,
        LedgerError,
        PhaseError,
        QuiesceError,
        ServersHeld,
        SnapshotError,
    )
    from coordinator.publish import Snapshot, load_snapshot, read_latest, verify_snapshot
    from coordinator.status import ClusterStatus

#: Public names and the module each lives in. Imported on first use, so that importing
#: `coordinator.errors` (the CLI does, at start) does not load httpx, the ledger and pydantic models.
_EXPORTS: dict[str, str] = {
    "AcknowledgementError": "coordinator.errors",
    "Attempt": "coordinator.attempt",
    "ClusterConfig": "coordinator.config",
    "ConfigError": "coordinator.errors",
    "Coordinator": "coordinator.coordinator",
    "DeadlineExceeded": "coordinator.errors",
    "Discovery": "coordinator.discovery",
    "DiscoveryError": "coordinator.errors",
    "FencedError": "coordinator.errors",
    "LedgerError": "coordinator.errors",
    "Member": "coordinator.discovery",
    "Outcome": "coordinator.attempt",
    "PhaseError": "coordinator.errors",
    "Progress": "coordinator.attempt",
    "ProgressCallback": "coordinator.attempt",
    "QuiesceError": "coordinator.errors",
    "Resubmission": "coordinator.attempt",
    "ServerConfig": "coordinator.config",
    "ServersHeld": "coordinator.errors",
    "ClusterStatus": "coordinator.status",
    "Snapshot": "coordinator.publish",
    "SnapshotError": "coordinator.errors",
    "load_config": "coordinator.config",
    "load_snapshot": "coordinator.publish",
    "parse_config": "coordinator.config",
    "read_history": "coordinator.coordinator",
    "read_latest": "coordinator.publish",
    "resolve_token": "coordinator.config",
    "verify_snapshot": "coordinator.publish",
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
    "FencedError",
    "LedgerError",
    "Member",
    "Outcome",
    "PhaseError",
    "Progress",
    "ProgressCallback",
    "QuiesceError",
    "Resubmission",
    "ServerConfig",
    "ServersHeld",
    "Snapshot",
    "SnapshotError",
    "load_config",
    "load_snapshot",
    "parse_config",
    "read_history",
    "read_latest",
    "resolve_token",
    "verify_snapshot",
]
