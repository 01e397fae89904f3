"""Fixtures for the service tests: real `quiesce serve` processes beside real gymsim servers.

`spawn_service(config, api_token=None)` starts `python -m quiesce serve --config C --listen
127.0.0.1:0 --json` as a child process (the worktree's code, the control token in its environment, the
API token in `QUIESCE_API_TOKEN` when given) and returns once it printed its address: a
`ServiceProcess` with `.url`, `.announced` (the JSON line) and the process (`env_extra`: more
of its environment, e.g. `QUIESCE_ALLOW_HOSTS`). Every service started
is stopped at the end of the test (SIGTERM, then SIGKILL). stderr goes to a file (`.log()`).

The coordinator tests' fixtures (`token`, `make_cluster`, `cluster`, `configure`) are reused.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim.cluster import IMPORT_ROOT, RunningCluster
from quiesce.tools.serve.auth import API_TOKEN_ENV
from quiesce.tools.serve.hosts import ALLOW_HOSTS_ENV
from quiesce.tools.serve.spawn import ServiceDidNotStart, start_service
from tests.coordinator.conftest import cluster, configure, make_cluster, sqlite_url, token

__all__ = [
    "Patience",
    "ServiceProcess",
    "cluster",
    "configure",
    "make_cluster",
    "sqlite_url",
    "token",
    "wait_ready",
]

STARTUP_S = 60.0


class ServiceProcess:
    """One running `quiesce serve` child."""

    def __init__(self, process: subprocess.Popen[str], log_path: Path, announced: dict[str, Any]) -> None:
        self.process = process
        self.log_path = log_path
        self.announced = announced
        self.url: str = announced["listening"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout_s: float = 120.0) -> int:
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def spawn_service(token: str, tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def spawn(
        config: Path,
        *,
        api_token: str | None = None,
        extra: tuple[str, ...] = (),
        env_extra: dict[str, str] | None = None,
    ) -> ServiceProcess:
        env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": str(IMPORT_ROOT)}
        env.pop(API_TOKEN_ENV, None)
        env.pop(ALLOW_HOSTS_ENV, None)
        env.update(env_extra or {})
        if api_token is not None:
            env[API_TOKEN_ENV] = api_token
        log_path = tmp_path / f"serve-{len(started)}.log"
        try:
            process, announced = start_service(config, env, log_path, extra=extra, startup_s=STARTUP_S)
        except ServiceDidNotStart as error:
            pytest.fail(str(error))
        service = ServiceProcess(process, log_path, announced)
        started.append(service)
        return service

    yield spawn
    for service in started:
        service.stop()


async def wait_ready(url: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll `/readyz` until the service is ready (a hang guard, not a timing assertion)."""
    import time

    import anyio
    import httpx

    give_up = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as http:
        while True:
            reply = await http.get(f"{url}/readyz")
            if reply.status_code == 200:
                document: dict[str, Any] = reply.json()
                return document
            assert time.monotonic() < give_up, f"{url} not ready: {reply.json()}"
            await anyio.sleep(0.05)


class Patience:
    """A hang guard for polling loops: `while not done: await patience.wait("what")` fails the test
    with a message once `seconds` have passed (it bounds a hang; it asserts no timing)."""

    def __init__(self, seconds: float = 60.0) -> None:
        import time

        self._until = time.monotonic() + seconds

    async def wait(self, what: str) -> None:
        import time

        import anyio

        assert time.monotonic() < self._until, f"gave up waiting for {what}"
        await anyio.sleep(0.05)


#: A fault that makes the resources server's prepare hang: a save stays in progress until removed.
HOLD = {"kind": "hang", "path": "/resources-checkpoint/prepare", "method": "POST"}


@asynccontextmanager
async def save_in_progress(http: httpx.AsyncClient, cluster: RunningCluster) -> AsyncIterator[dict[str, Any]]:
    """`POST /v1/checkpoints` (through `http`, the service's client) held in its prepare phase by
    `HOLD`: entered once the agent reports `prepared`; leaving removes the fault and waits for the
    save's reply, then in the yielded dict's `"reply"`."""
    from tests.coordinator.helpers import server_states, set_faults

    await set_faults(http, cluster.urls["tools"], [HOLD])
    result: dict[str, Any] = {}

    async def save() -> None:
        result["reply"] = await http.post("/v1/checkpoints", json={"deadline_s": 60})

    async with anyio.create_task_group() as tg:
        tg.start_soon(save)
        try:
            patience = Patience()
            while (await server_states(http, cluster))["simple_agent"][0] != "prepared":
                await patience.wait("the agent prepared")
            yield result
        finally:
            await http.delete(f"{cluster.urls['tools']}/gymsim/admin/faults")
