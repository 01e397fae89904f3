"""Fixtures of the command-line tests: the reference-cluster fixtures of the coordinator tests
(`token`, `make_cluster`, `cluster`), `config_file`, a config for `cluster` with its ledger `q.db`
and snapshots `snaps/` beside it (relative: the config's folder is theirs), and the service tests'
`spawn_service` (a real `quiesce serve` child process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.conftest import cluster, make_cluster, token
from tests.serve.conftest import spawn_service

__all__ = ["cluster", "config_file", "make_cluster", "spawn_service", "token"]


@pytest.fixture
def config_file(cluster: RunningCluster, tmp_path: Path, token: str) -> Path:
    path: Path = cluster.write_config(tmp_path / "cluster.yaml", "sqlite+aiosqlite:///q.db", "snaps")
    return path
