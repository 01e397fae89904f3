"""Fixtures of the v2 gymsim tests: real reference servers on loopback, driven by raw HTTP calls.

`V2` wraps one cluster: `op(name, operation, id, ...)` POSTs a control call with a fresh deadline,
`status(name)` the status GET, `admin(...)` the token-free admin routes; `control` is the stage-ordered
raw driver of `tools/gymsim/v2/drive.py`, `trainer(...)` a `Trainer` on the cluster's environment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from quiesce.tools.gymsim.spec import ClusterSpec, default_v2_spec
from quiesce.tools.gymsim.v2.drive import Control
from quiesce.tools.gymsim.v2.trainer import Trainer

TOKEN = "gymsim-v2-test-token-91c2"


def auth(token: str | None = TOKEN) -> dict[str, str]:
    return {} if token is None else {"authorization": f"Bearer {token}"}


def v2_spec(**changes: dict[str, Any]) -> dict[str, Any]:
    """The default v2 spec as a dict, with per-server field changes (`agent={"checkpoint_mode": ...}`)."""
    document = default_v2_spec().model_dump(mode="json")
    for server in document["servers"]:
        server.update(changes.get(server["name"], {}))
    return document


class V2:
    """Raw control-plane calls against the servers of one cluster."""

    def __init__(self, urls: Mapping[str, str], http: httpx.AsyncClient) -> None:
        self.urls = dict(urls)
        self.http = http
        self.control = Control(urls, token=TOKEN, http=http)

    async def op(
        self,
        name: str,
        operation: str,
        checkpoint_id: str = "c1",
        *,
        deadline_s: float = 30.0,
        token: str | None = TOKEN,
        body: Any = None,
        **fields: Any,
    ) -> httpx.Response:
        document = (
            body
            if body is not None
            else {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + deadline_s, **fields}
        )
        return await self.http.post(
            f"{self.urls[name]}{PREFIX}/{operation}", json=document, headers=auth(token), timeout=120
        )

    async def status(self, name: str, *, token: str | None = TOKEN) -> httpx.Response:
        return await self.http.get(f"{self.urls[name]}{PREFIX}/status", headers=auth(token))

    async def state(self, name: str) -> dict[str, Any]:
        reply = await self.status(name)
        assert reply.status_code == 200, reply.text
        document: dict[str, Any] = reply.json()
        return document

    async def admin(self, name: str, method: str, path: str, **kwargs: Any) -> Any:
        reply = await self.http.request(method, f"{self.urls[name]}/gymsim/admin/{path}", **kwargs)
        assert reply.status_code == 200, reply.text
        return reply.json()

    async def faults(self, name: str, *faults: dict[str, Any]) -> None:
        await self.admin(name, "POST", "faults", json={"faults": list(faults)})

    def trainer(self, env: str = "environment") -> Trainer:
        return Trainer(self.urls[env], http=self.http)


def code(reply: httpx.Response) -> str | None:
    body = reply.json()
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 60.0, what: str = ""
) -> None:
    """Poll `check` until it holds (a guard against hanging, not a timing assertion)."""
    give_up = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"never happened: {what or check}")
        await asyncio.sleep(0.02)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=1000)  # every episode's /run holds a connection
    async with httpx.AsyncClient(
        trust_env=False, timeout=httpx.Timeout(60.0, read=None), limits=limits
    ) as client:
        yield client


@pytest.fixture
def cluster() -> Iterator[RunningCluster]:
    with start_cluster(default_v2_spec(), token=TOKEN) as running:
        yield running


@pytest.fixture
async def gym(cluster: RunningCluster, http: httpx.AsyncClient) -> V2:
    return V2(cluster.urls, http)


def running(spec: ClusterSpec | dict[str, Any] | None = None) -> Any:
    """`start_cluster` of `spec` (default: the default v2 cluster) with the test token."""
    return start_cluster(spec if spec is not None else default_v2_spec(), token=TOKEN)
