"""``BareClient``: the floor of measure #4 — the requests of a save and of discovery, and nothing else.

It sends what a ``Coordinator`` sends for a discovery (every server's capabilities) and for a save,
to the same servers, in the same role-group order, with the same fan-out (every call of a role
group at once) and the same HTTP client code (``coordinator/http.py``, keep-alive per origin,
the same idle-reuse rule):

    prepare: policy pause → agents prepare (``agent_prepare_incomplete`` retried every 0.1 s)
             → resources prepare → policy status long-poll until paused and drained
    commit:  (staging folder made) agents commit → policy commit (with the agents' continuation
             indexes) → resources commit
    publish: the staging folder renamed into place (the previous one removed)
    resume:  resources → policy → agents

It keeps no ledger, validates nothing beyond the HTTP status, hashes and fsyncs no file and
writes no manifest: what a save costs beyond it is what the coordinator adds. Bench-only.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio

from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.protocol import (
    AGENT,
    AGENT_PREPARE_INCOMPLETE,
    CAPABILITIES_PATH,
    MODEL,
    RESOURCES,
    route,
)

#: Request bodies as compact JSON, as the coordinator encodes them (one encoder, built once).
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
#: The reply cap the coordinator uses too.
MAX_BODY = 1 << 20


class BareError(RuntimeError):
    """A request of the floor failed (the floor would not be a floor)."""


class BareClient:
    """See the module docstring. ``members``: (name, component, url) of every participant."""

    def __init__(self, members: Sequence[tuple[str, str, str]], token: str, snapshots: Path) -> None:
        self.members = list(members)
        self.token = token
        self.snapshots = snapshots
        self.http = HttpClient()
        self._count = 0
        self._previous: Path | None = None
        self._post_headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json",
            "Content-Type": "application/json",
        }
        self._get_headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    def group(self, component: str) -> list[tuple[str, str, str]]:
        return [m for m in self.members if m[1] == component]

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _request(self, method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = _ENCODE(body).encode() if body is not None else None
        headers = self._post_headers if method == "POST" else self._get_headers
        reply = await self.http.request(
            method, url, headers=headers, body=data, timeout_s=60, max_body=MAX_BODY
        )
        return reply.status, json.loads(reply.body) if reply.body else None

    async def _ok(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        status, parsed = await self._request(method, url, body)
        if status != 200:
            raise BareError(f"{method} {url}: HTTP {status} {parsed}")
        return parsed

    @staticmethod
    async def _each(members: Sequence[tuple[str, str, str]],
                    call: Callable[[tuple[str, str, str]], Awaitable[Any]]) -> dict[str, Any]:  # fmt: skip
        out: dict[str, Any] = {}

        async def one(member: tuple[str, str, str]) -> None:
            out[member[0]] = await call(member)

        async with anyio.create_task_group() as tg:
            for member in members:
                tg.start_soon(one, member)
        return out

    async def discover(self, urls: Sequence[str]) -> int:
        """Every server's capabilities at once; how many answered."""
        answered = await self._each([("", "", url) for url in urls],
                                    lambda m: self._ok("GET", m[2] + CAPABILITIES_PATH))  # fmt: skip
        return len(answered)

    async def save(self) -> str:
        """One save's requests (see the module docstring); the published folder's name."""
        self._count += 1
        cid = f"bare-{os.getpid()}-{self._count:06d}"
        deadline = time.time() + 120
        common = {"schema_version": 1, "checkpoint_id": cid, "deadline_ts": deadline}
        models, agents, resources = self.group(MODEL), self.group(AGENT), self.group(RESOURCES)

        def post(component: str, operation: str, body: dict[str, Any]) -> Callable[[Any], Awaitable[Any]]:
            path = route(component, operation).full_path
            return lambda m: self._ok("POST", m[2] + path, body)

        await self._each(models, post(MODEL, "pause", common))

        async def agent_prepare(member: tuple[str, str, str]) -> Any:
            path = route(AGENT, "prepare").full_path
            while True:
                status, parsed = await self._request("POST", member[2] + path, common)
                if status == 409 and (parsed or {}).get("error", {}).get("code") == AGENT_PREPARE_INCOMPLETE:
                    await anyio.sleep(0.1)
                    continue
                if status != 200:
                    raise BareError(f"agent prepare {member[0]}: HTTP {status} {parsed}")
                return parsed

        await self._each(agents, agent_prepare)
        await self._each(resources, post(RESOURCES, "prepare", common))

        async def drain(member: tuple[str, str, str]) -> None:
            query = urlencode({"checkpoint_id": cid, "deadline_ts": repr(deadline), "wait_state": "paused",
                               "timeout_s": "1.0"})  # fmt: skip
            while True:
                reply = await self._ok("GET", f"{member[2]}{route(MODEL, 'status').full_path}?{query}")
                if reply["state"] == "paused" and reply["inflight_total"] == 0:
                    return

        await self._each(models, drain)
        staging = self.snapshots / ".staging" / cid
        await anyio.to_thread.run_sync(lambda: staging.mkdir(parents=True))
        with_dir = {**common, "checkpoint_dir": str(staging)}
        committed = await self._each(agents, post(AGENT, "commit", with_dir))
        indexes = [committed[m[0]]["continuation_index"] for m in agents]
        await self._each(models, post(MODEL, "commit", {**with_dir, "continuation_indexes": indexes}))
        await self._each(resources, post(RESOURCES, "commit", with_dir))
        final = self.snapshots / cid
        previous, self._previous = self._previous, final

        def publish() -> None:
            staging.rename(final)
            if previous is not None:
                shutil.rmtree(previous, ignore_errors=True)

        await anyio.to_thread.run_sync(publish)
        await self._each(resources, post(RESOURCES, "resume", common))
        await self._each(models, post(MODEL, "resume", common))
        await self._each(agents, post(AGENT, "resume", common))
        return cid
