"""Fixtures of the coordinator's unified-plane (v2) tests: real v2 reference servers on loopback
(`tools/gymsim/v2`), a real SQLite ledger, and the trainer client that runs their episodes.

`v2_cluster(**changes)` starts the default v2 spec (environment, agent, policy model, resources)
with per-server changes; `config_of(running, ledger_url, **overrides)` writes its cluster config
with snapshots under the test's folder.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ClusterConfig, parse_config
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.spec import default_v2_spec


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "qz2-" + secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, value)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)
    return value


def v2_spec(**changes: dict[str, Any]) -> dict[str, Any]:
    """The default v2 spec as a dict, with per-server field changes (`agent={"lease_grace_s": 1}`)."""
    document = default_v2_spec().model_dump(mode="json")
    for server in document["servers"]:
        server.update(changes.get(server["name"], {}))
    return document


@pytest.fixture
def v2_cluster(token: str) -> Callable[..., AbstractContextManager[RunningCluster]]:
    def make(
        spec: dict[str, Any] | None = None, **changes: dict[str, Any]
    ) -> AbstractContextManager[RunningCluster]:
        return start_cluster(spec if spec is not None else v2_spec(**changes), token=token)

    return make


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def config_of(tmp_path: Path) -> Callable[..., ClusterConfig]:
    def build(running: RunningCluster, ledger_url: str, **overrides: Any) -> ClusterConfig:
        document = running.config(ledger_url, tmp_path / "snapshots", **overrides)
        return parse_config(document, base_dir=tmp_path)

    return build


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        yield client
