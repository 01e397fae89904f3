"""A coordinator opened without a control token (`require_token=False`), against real gymsim servers.

It may read capabilities (discovery, `status()`), which Gym serves without a token, and sends no
Authorization header; every step that needs the token raises a `ConfigError` naming the variable
to set, before anything is recorded or sent. Recovery does not run without a token.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from quiesce.coordinator import ConfigError, Coordinator
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.tools.gymsim.cluster import RunningCluster
from tests.coordinator.helpers import control_logs, read_events

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_without_a_token_it_discovers_and_reads_status_and_refuses_the_rest(
    cluster: RunningCluster, ledger_url: str, configure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV_FALLBACK, raising=False)
    config = configure(cluster, ledger_url)
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        async with Coordinator.open(config):  # the token is required by default
            pass
    async with Coordinator.open(config, require_token=False) as coord:
        assert coord.last_recovery is None  # recovery resumes servers: it needs the token
        found = await coord.discover()
        assert {m.name for m in found.participants} == {"policy_model", "simple_agent", "tools"}
        status = await coord.status()
        assert status.idle
        assert {s.name for s in status.servers} == set(cluster.urls)
        async with httpx.AsyncClient() as http:
            before = await control_logs(http, cluster)
            refusals = {
                "checkpoint": coord.checkpoint(deadline_s=30),
                "acknowledge": coord.acknowledge_completed("simple_agent", [("r", 0)]),
                "resume": coord.resume(),
                "abort": coord.abort(),
                "restore": coord.restore(),
                "recover": coord.recover(),
            }
            for what, step in refusals.items():
                with pytest.raises(ConfigError) as refused:
                    await step
                assert TOKEN_ENV in str(refused.value), what
            assert await control_logs(http, cluster) == before  # nothing was sent
    seen = [entry for entries in before.values() for entry in entries]
    assert {(e["path"], e["authorized"]) for e in seen} == {("/ng-control/v1/capabilities", False)}
    events = await read_events(ledger_url)
    assert not [ev for ev in events if ev.kind.startswith(("attempt.", "recovery.", "phase."))]
    assert {ev.data["path"] for ev in events if ev.kind == "call.sent"} == {"/ng-control/v1/capabilities"}


@pytest.mark.parametrize("bad", ["two words", "caf\u00e9", ""])
async def test_a_given_token_that_cannot_be_a_bearer_token_is_refused_before_the_ledger_opens(
    cluster: RunningCluster, configure: Any, tmp_path: Any, bad: str
) -> None:
    ledger = tmp_path / "never.db"
    config = configure(cluster, f"sqlite+aiosqlite:///{ledger}")
    with pytest.raises(ConfigError) as refused:
        async with Coordinator.open(config, token=bad, require_token=False):
            pass
    assert not bad or bad not in str(refused.value)
    assert not ledger.exists()
