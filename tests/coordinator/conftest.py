"""Fixtures for the coordinator tests: a reference Gym cluster on loopback and a config for it.

`cluster` runs the seed's example (policy_model, judge auxiliary, simple_agent, math_agent
stateless, tools) in-process on real uvicorn servers; `make_cluster(spec)` runs another spec.
Every test gets its own random control token (`token`), set in the environment too.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from quiesce.coordinator import ClusterConfig, parse_config
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.spec import SpecLike


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "qz-" + secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, value)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)
    return value


@pytest.fixture
def make_cluster(token: str) -> Callable[[SpecLike], AbstractContextManager[RunningCluster]]:
    def make(spec: SpecLike = None) -> AbstractContextManager[RunningCluster]:
        return start_cluster(spec, token=token)

    return make


@pytest.fixture
def cluster(
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]],
) -> Iterator[RunningCluster]:
    with make_cluster(None) as running:
        yield running


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def configure(tmp_path: Path) -> Callable[..., ClusterConfig]:
    """`configure(cluster, ledger_url, **overrides)` → a validated config with snapshots under tmp_path."""

    def build(running: RunningCluster, ledger_url: str, **overrides: Any) -> ClusterConfig:
        document = running.config(ledger_url, tmp_path / "snapshots", **overrides)
        return parse_config(document, base_dir=tmp_path)

    return build
