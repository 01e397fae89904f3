"""The event loops the embedded coordinator runs on.

Inside a uvloop host (uvicorn[standard], Ray Serve): uvloop's transports implement asyncio's
methods without subclassing `asyncio.Transport`, and the coordinator's HTTP client once refused
them — every call failed as "connection lost". A checkpoint mid-rollout, a restore into a fresh
cluster and its resume, all on uvloop, against real gymsim servers. Under trio it refuses at once
with a clear error."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from quiesce.coordinator import Coordinator
from quiesce.tools.gymsim import client
from tests.coordinator.helpers import assert_all_accepting, assert_protocol_ok
from tests.coordinator.test_restore import _checkpoint_mid_rollout, _uninterrupted

uvloop = pytest.importorskip("uvloop")  # a dev dependency: present wherever the tests are installed

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"use_uvloop": True})


async def test_save_restore_and_resume_on_uvloop(make_cluster: Any, sqlite_url: str, configure: Any) -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    expected = await _uninterrupted(make_cluster)
    with make_cluster(None) as first:
        snapshot = await _checkpoint_mid_rollout(first, configure(first, sqlite_url))
    with make_cluster(None) as second:
        async with httpx.AsyncClient() as http, Coordinator.open(configure(second, sqlite_url)) as coord:
            await coord.discover()
            attempt = await coord.restore(snapshot, resume=True)
            assert attempt.resume_outcome is not None
            assert attempt.resume_outcome.outcome == "resumed"
            await assert_all_accepting(http, second)
            agent = second.urls["simple_agent"]
            await client.resubmit(http, agent, attempt.resubmit)
            rollouts = await client.wait_finished(http, agent, timeout_s=60)
    assert client.final_results(rollouts) == expected
    await assert_protocol_ok(sqlite_url)


def test_another_event_loop_is_refused_with_a_clear_error() -> None:
    """Under trio nothing of the coordinator can work (asyncio's HTTP client and PostgreSQL driver):
    `Coordinator.open` says so before it opens anything, instead of failing deep inside."""
    trio = pytest.importorskip("trio")
    from quiesce.coordinator import QuiesceError

    async def main() -> None:
        async with Coordinator.open("no-such-config.yaml", token="t"):  # refused before it is read
            raise AssertionError("opened under trio")

    with pytest.raises(QuiesceError, match="runs on asyncio"):
        trio.run(main)
