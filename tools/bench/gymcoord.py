"""``GymCoordination``: the floor of measure #11 — the calls NeMo Gym's own stateless coordination
module makes for a save, in its order, with no ledger: what a user runs instead of quiesce.

The calls and their order are those of Gym's ``nemo_gym/_checkpoint/coordination.py`` (read it
there), written here from its behaviour, not its code:

- discover: ``GET …/status`` on every server at once; a 404 is not a participant; participants
  sorted by (stage, name); at least one model.
- prepare: stage by stage — environment → model → agent → resources —, a stage's calls at once;
  it stops at the first stage with a reply whose phase is not ``prepared``.
- commit: every participant at once, with the folder, the scope and ``stop``.
- resume: the stages in reverse order, a stage's calls at once, past failures (raised at the end).
- every call: the bearer token, the save's one ``deadline_ts``, a client timeout of
  ``deadline - now + 5 s``; a reply other than 200 is an error carrying the envelope's code.

``save`` adds the controller's part that Gym leaves to its caller: a new checkpoint id, a staging
folder, not prepared → resume and fail, the scope = the caller's episodes minus every reported
restart, publication after every commit (the folder renamed into place), then resume. No
retention (nothing is deleted), nothing recorded, nothing verified beyond a reply's status and JSON.
The HTTP client is the coordinator's (``coordinator/http.py``), given by the caller, so both sides
of #11 send on the same client code and the same connection policy. Bench-only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.protocol_v2 import PREFIX, STAGES, STATUS_PATH

#: Request bodies as compact JSON, as the coordinator encodes them.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
#: The reply cap the coordinator uses too.
MAX_BODY = 1 << 20
#: Gym's discovery: a probe that gets no reply within this fails discovery.
DISCOVER_TIMEOUT_S = 60.0
#: Gym's client timeout beyond the deadline: the reply still in flight.
REPLY_SLACK_S = 5.0


class GymCoordinationError(RuntimeError):
    """One or more participants failed a coordination call (server name → what went wrong)."""

    def __init__(self, operation: str, failures: Mapping[str, str]) -> None:
        self.failures = dict(failures)
        detail = "; ".join(f"{name}: {why}" for name, why in sorted(self.failures.items()))
        super().__init__(f"checkpoint {operation} failed on {len(self.failures)} participant(s): {detail}")


class GymCoordination:
    """See the module docstring. ``urls``: every server of the deployment, name → base URL."""

    def __init__(self, urls: Mapping[str, str], token: str, snapshots: Path, client: HttpClient) -> None:
        self.urls = dict(urls)
        self.client = client
        self.snapshots = snapshots
        self.kinds: dict[str, str] = {}  #: participant → kind, in (stage, name) order
        self._count = 0
        self._post_headers = {
            "Authorization": f"Bearer {token}",
            "Accept": "application/json",
            "Content-Type": "application/json",
        }
        self._get_headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    async def _request(
        self, method: str, name: str, path: str, body: dict[str, Any] | None, timeout_s: float
    ) -> tuple[int, Any]:
        reply = await self.client.request(
            method,
            self.urls[name] + path,
            headers=self._post_headers if method == "POST" else self._get_headers,
            body=_ENCODE(body).encode() if body is not None else None,
            timeout_s=timeout_s,
            max_body=MAX_BODY,
        )
        return reply.status, json.loads(reply.body) if reply.body else None

    async def _post(self, name: str, operation: str, body: dict[str, Any], deadline_ts: float) -> Any:
        timeout_s = max(deadline_ts - time.time(), 0.0) + REPLY_SLACK_S
        status, document = await self._request("POST", name, f"{PREFIX}/{operation}", body, timeout_s)
        if status != 200:
            error = (document or {}).get("error") if isinstance(document, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            raise RuntimeError(f"HTTP {status} {code or ''} {document!r:.200}".strip())
        return document

    async def _fan_out(
        self, names: Sequence[str], operation: str, body: dict[str, Any], deadline_ts: float
    ) -> dict[str, Any]:
        replies: dict[str, Any] = {}
        failures: dict[str, str] = {}

        async def one(name: str) -> None:
            try:
                replies[name] = await self._post(name, operation, body, deadline_ts)
            except Exception as error:
                failures[name] = str(error) or type(error).__name__

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(one, name)
        if failures:
            raise GymCoordinationError(operation, failures)
        return replies

    def of_kind(self, kind: str) -> list[str]:
        return [name for name, k in self.kinds.items() if k == kind]

    # -- Gym's coordination calls --------------------------------------------------------------

    async def discover(self) -> dict[str, str]:
        """Every server's status at once: the participants by (stage, name)."""
        found: dict[str, str] = {}
        failures: dict[str, str] = {}

        async def probe(name: str) -> None:
            try:
                status, document = await self._request("GET", name, STATUS_PATH, None, DISCOVER_TIMEOUT_S)
                if status == 404:
                    return
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                if document["kind"] not in STAGES:
                    raise ValueError(f"unknown participant kind {document['kind']!r}")
                found[name] = document["kind"]
            except Exception as error:
                failures[name] = str(error) or type(error).__name__

        async with anyio.create_task_group() as tg:
            for name in self.urls:
                tg.start_soon(probe, name)
        if failures:
            raise GymCoordinationError("discover", failures)
        if "model" not in found.values():
            raise GymCoordinationError("discover", {"deployment": "no policy model takes part"})
        self.kinds = dict(sorted(found.items(), key=lambda item: (STAGES.index(item[1]), item[0])))
        return self.kinds

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> tuple[bool, dict[str, Any]]:
        """Stage by stage; (prepared, replies), stopping after the first stage not prepared."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        replies: dict[str, Any] = {}
        for kind in STAGES:
            stage = await self._fan_out(self.of_kind(kind), "prepare", body, deadline_ts)
            replies.update(stage)
            if any(reply["phase"] != "prepared" for reply in stage.values()):
                return False, replies
        return True, replies

    async def commit(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episodes: Sequence[Mapping[str, Any]],
        deadline_ts: float,
        *,
        stop: bool = False,
    ) -> dict[str, Any]:
        body = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": [dict(e) for e in episodes],
            "stop": stop,
        }
        return await self._fan_out(list(self.kinds), "commit", body, deadline_ts)

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> None:
        """The stages in reverse order, past failures; the failures raised together at the end."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        failures: dict[str, str] = {}
        for kind in reversed(STAGES):
            try:
                await self._fan_out(self.of_kind(kind), "resume", body, deadline_ts)
            except GymCoordinationError as error:
                failures.update(error.failures)
        if failures:
            raise GymCoordinationError("resume", failures)

    # -- the controller's part -----------------------------------------------------------------

    async def save(self, episodes: Sequence[Mapping[str, Any]], *, deadline_s: float) -> str:
        """One save (module docstring): prepare → commit → publish → resume. The published id."""
        self._count += 1
        checkpoint_id = f"gym-{os.getpid()}-{self._count:06d}"
        deadline_ts = time.time() + deadline_s
        prepared, replies = await self.prepare(checkpoint_id, deadline_ts)
        if not prepared:
            await self.resume(checkpoint_id, deadline_ts)
            raise GymCoordinationError("prepare", {n: "not prepared" for n, r in replies.items()
                                                   if r["phase"] != "prepared"})  # fmt: skip
        restarts = {key for reply in replies.values() for key in reply["report"]["restarts"]}
        scope = [e for e in episodes if _capture_key(e) not in restarts]
        staging = self.snapshots / ".staging" / checkpoint_id
        await anyio.to_thread.run_sync(lambda: staging.mkdir(parents=True))
        await self.commit(checkpoint_id, str(staging), scope, deadline_ts)
        await anyio.to_thread.run_sync(staging.rename, self.snapshots / checkpoint_id)
        await self.resume(checkpoint_id, deadline_ts)
        return checkpoint_id


def _capture_key(episode: Mapping[str, Any]) -> str:
    """Gym's capture key: the rollout id, with ``-a<attempt>`` for an attempt above 0."""
    attempt = int(episode.get("attempt", 0))
    return str(episode["rollout_id"]) + (f"-a{attempt}" if attempt else "")


__all__ = ["GymCoordination", "GymCoordinationError"]
