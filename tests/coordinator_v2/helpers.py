"""What the coordinator's v2 tests read back: the ledger's events, the calls sent to one route, and
every server's phase as its own status reports it."""

from __future__ import annotations

from typing import Any

import httpx

from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.ledger import Ledger


async def events(url: str, kind: str | None = None) -> list[Any]:
    """The ledger's events (of `kind`, when given), in seq order."""
    async with Ledger.open(url, readonly=True) as ledger:
        return [ev async for ev in ledger.read() if kind is None or ev.kind == kind]


async def sent(url: str, operation: str) -> list[Any]:
    """The `call.sent` events of one unified-plane route, in the order they left."""
    return [ev for ev in await events(url, "call.sent") if ev.data["path"] == f"{PREFIX}/{operation}"]


async def phases(http: httpx.AsyncClient, urls: dict[str, str], token: str) -> dict[str, str]:
    """Each server's phase, read from its own status."""
    out = {}
    for name, url in urls.items():
        reply = await http.get(f"{url}{PREFIX}/status", headers={"authorization": f"Bearer {token}"})
        out[name] = reply.json()["phase"]
    return out
