"""Test helpers: admin routes of the reference servers, ledger reads, state checks, raw loopback servers."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
from anyio.streams.tls import TLSListener

from quiesce.coordinator import Attempt
from quiesce.coordinator.protocol import CAPABILITIES_PATH
from quiesce.ledger import Event, Ledger
from quiesce.tools.audit.cli import check_ledger
from quiesce.tools.gymsim.cluster import RunningCluster


async def control_log(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    reply = await http.get(f"{url}/gymsim/admin/control-log")
    reply.raise_for_status()
    entries: list[dict[str, Any]] = reply.json()
    return entries


async def control_logs(http: httpx.AsyncClient, running: RunningCluster) -> dict[str, list[dict[str, Any]]]:
    return {name: await control_log(http, url) for name, url in running.urls.items()}


async def reset_logs(http: httpx.AsyncClient, running: RunningCluster) -> None:
    for url in running.urls.values():
        (await http.post(f"{url}/gymsim/admin/reset-log")).raise_for_status()


async def set_faults(http: httpx.AsyncClient, url: str, faults: list[dict[str, Any]]) -> None:
    (await http.post(f"{url}/gymsim/admin/faults", json={"faults": faults})).raise_for_status()


async def clear_faults(http: httpx.AsyncClient, running: RunningCluster) -> None:
    for url in running.urls.values():
        (await http.delete(f"{url}/gymsim/admin/faults")).raise_for_status()


async def server_states(http: httpx.AsyncClient, running: RunningCluster) -> dict[str, tuple[str, str]]:
    """name → (fence phase from capabilities, data-plane admission state)."""
    out: dict[str, tuple[str, str]] = {}
    for name, url in running.urls.items():
        caps = (await http.get(url + CAPABILITIES_PATH)).json()
        state = (await http.get(f"{url}/gymsim/admin/state")).json()
        out[name] = (caps["phase"], state["admission_state"])
    return out


async def assert_all_accepting(http: httpx.AsyncClient, running: RunningCluster) -> None:
    states = await server_states(http, running)
    assert states == {name: ("idle", "accepting") for name in running.urls}, states


def assert_staging_made(attempt: Attempt) -> Path:
    """The attempt's staging folder is there, a real folder, and the very one it made (its identity
    recorded: `coordinator/staging.py`); returns it."""
    staging = attempt.staging_dir
    assert staging is not None
    assert staging.is_dir()
    assert not staging.is_symlink()
    found = os.lstat(staging)
    assert attempt.staging_identity == (found.st_dev, found.st_ino)
    return staging


async def read_events(ledger_url: str, checkpoint_id: str | None = None) -> list[Event]:
    async with Ledger.open(ledger_url, readonly=True) as ledger:
        return [ev async for ev in ledger.read(checkpoint_id=checkpoint_id)]


def routes_by_server(log: list[dict[str, Any]], checkpoint_id: str | None = None) -> list[str]:
    """`METHOD /path` of each logged control request (optionally of one checkpoint id)."""
    return [
        f"{e['method']} {e['path'].removeprefix('/ng-control/v1')}"
        for e in log
        if checkpoint_id is None or e["checkpoint_id"] == checkpoint_id
    ]


async def assert_protocol_ok(ledger_url: str) -> None:
    """The audit's independent protocol check (order, settlement, deadline, epochs, pairing) passes,
    over the whole ledger and for each attempt alone (`quiesce check ID`, which reads only that
    attempt's events and their context), and the projection matches the events either way."""
    from quiesce.tools.cli.commands.check import check_one

    report = await check_ledger(ledger_url)
    assert report.violations == [], report.violations
    assert all(state == "judged" for state in report.attempts.values()), report.attempts
    assert report.projection.ok, report.projection.differences
    for checkpoint_id in report.attempts:
        alone = await check_one(ledger_url, checkpoint_id)
        assert alone.violations == [], (checkpoint_id, alone.violations)
        assert alone.projection.ok, (checkpoint_id, alone.projection.differences)


@asynccontextmanager
async def loopback(
    handle: Callable[[anyio.abc.ByteStream], Awaitable[None]], *, tls: ssl.SSLContext | None = None
) -> AsyncIterator[str]:
    """A server on a free loopback port that runs `handle` for each connection (over TLS with
    `tls`); yields its base URL (`http://127.0.0.1:<port>`, or `https://`), stopped on exit."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        if tls is None:
            tg.start_soon(listener.serve, handle)
        else:
            tg.start_soon(TLSListener(listener, tls, standard_compatible=False).serve, handle)
        try:
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()
