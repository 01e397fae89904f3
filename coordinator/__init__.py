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

from coordinator.attempt import Attempt, Outcome, Progress, ProgressCallback
from coordinator.config import ClusterConfig, ServerConfig, load_config, parse_config, resolve_token
from coordinator.coordinator import Coordinator, read_history
from coordinator.discovery import Discovery, Member
from coordinator.errors import (
    ConfigError,
    DeadlineExceeded,
    DiscoveryError,
    FencedError,
    LedgerError,
    PhaseError,
    QuiesceError,
    SnapshotError,
)
from coordinator.publish import Snapshot, load_snapshot, read_latest, verify_snapshot

__all__ = [
    "Attempt",
    "ClusterConfig",
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
    "ServerConfig",
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
