"""Fixtures of the gymsim tests: real reference servers on loopback, driven over HTTP.

`Gym` wraps one cluster: `op(name, operation, ...)` sends a POST control call by
the route table of `quiesce.coordinator.protocol`, `status(...)` the status GET,
`caps(name)` the capabilities, `admin(...)` the control-free admin routes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import CAPABILITIES_PATH, route
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster

TOKEN = "gymsim-test-token-7f3a"

#: The seed's example with a small model latency, so rollouts stay in flight a little.
SPEC: dict[str, Any] = {
    "servers": [
        {"kind": "model", "name": "policy_model", "latency_s": 0.01},
        {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
        {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
        {"kind": "agent", "name": "math_agent", "checkpoint_mode": "stateless", "policy": "policy_model"},
        {"kind": "resources", "name": "tools", "judge": "judge"},
    ]
}


def auth(token: str | None = TOKEN) -> dict[str, str]:
    return {} if token is None else {"authorization": f"Bearer {token}"}


class Gym:
    """Control-plane calls against the servers of one cluster."""

    def __init__(self, urls: Mapping[str, str], http: httpx.AsyncClient) -> None:
        self.urls = dict(urls)
        self.http = http
        self._components: dict[str, str] = {}

    async def caps(self, name: str) -> dict[str, Any]:
        reply = await self.http.get(self.urls[name] + CAPABILITIES_PATH)
        assert reply.status_code == 200, reply.text
        document: dict[str, Any] = reply.json()
        return document

    async def component(self, name: str) -> str:
        if name not in self._components:
            self._components[name] = (await self.caps(name))["component"]
        return self._components[name]

    async def op(
        self,
        name: str,
        operation: str,
        checkpoint_id: str = "c1",
        *,
        deadline_s: float = 30.0,
        token: str | None = TOKEN,
        body: dict[str, Any] | None = None,
        http_timeout: float | None = 60.0,
        **extra: Any,
    ) -> httpx.Response:
        path = route(await self.component(name), operation).full_path
        document = (
            body
            if body is not None
            else {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + deadline_s, **extra}
        )
        return await self.http.post(
            self.urls[name] + path, json=document, headers=auth(token), timeout=http_timeout
        )

    async def status(
        self, name: str, checkpoint_id: str = "c1", *, token: str | None = TOKEN, **params: Any
    ) -> httpx.Response:
        path = route(await self.component(name), "status").full_path
        return await self.http.get(
            self.urls[name] + path, params={"checkpoint_id": checkpoint_id, **params}, headers=auth(token)
        )

    async def admin(self, name: str, method: str, path: str, **kwargs: Any) -> Any:
        reply = await self.http.request(method, self.urls[name] + "/gymsim/admin/" + path, **kwargs)
        assert reply.status_code == 200, reply.text
        return reply.json()

    async def faults(self, name: str, *faults: dict[str, Any]) -> None:
        await self.admin(name, "POST", "faults", json={"faults": list(faults)})

    async def fence(self, name: str) -> tuple[str, str | None]:
        caps = await self.caps(name)
        return caps["phase"], caps["active_checkpoint_id"]


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 60.0, what: str = ""
) -> None:
    """Poll `check` until it holds (a test timeout guard, not a timing assertion)."""
    give_up = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"never happened: {what or check}")
        await asyncio.sleep(0.01)


def code(reply: httpx.Response) -> str | None:
    body = reply.json()
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def cluster() -> Iterator[RunningCluster]:
    with start_cluster(SPEC, token=TOKEN) as running:
        yield running


@pytest.fixture
async def gym(cluster: RunningCluster) -> AsyncIterator[Gym]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        yield Gym(cluster.urls, http)


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[RunningCluster]:
    """One cluster for a module's tests that leave every fence idle (401, 422, read-only)."""
    with start_cluster(SPEC, token=TOKEN) as running:
        yield running


@pytest.fixture
async def sgym(shared_cluster: RunningCluster) -> AsyncIterator[Gym]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        yield Gym(shared_cluster.urls, http)
