"""Raw v2 control calls against a set of servers, in Gym's stage order — no ledger, no recovery.

For tests, the demo and the bench (a baseline to compare the coordinator with); the coordinator
itself never uses this. Order (Gym's `_checkpoint/coordination.py`): prepare stage by stage
(environment → model → agent → resources), stopping at the first stage not prepared; commit,
restore and renew all at once; resume in reverse stage order, past failures.

```python
control = Control(cluster.urls, token="secret", http=http)
prepared = await control.prepare_all("c1")            # {name: prepare reply}
scope = control.continued(trainer.in_flight(), prepared)   # the scope minus every restart
await control.commit_all("c1", "/ckpt/c1", scope)
await control.resume_all("c1")
```
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from quiesce.coordinator.protocol_v2 import PREFIX, STAGES, EpisodeId, stage_of


class ControlError(Exception):
    """A control call answered something other than 200."""

    def __init__(self, name: str, operation: str, reply: httpx.Response) -> None:
        super().__init__(f"{name} {operation}: {reply.status_code} {reply.text[:300]}")
        self.name = name
        self.operation = operation
        self.reply = reply


class Control:
    """Control calls to the participants among `urls` (a server whose status is 404 is skipped)."""

    def __init__(self, urls: Mapping[str, str], *, token: str, http: httpx.AsyncClient) -> None:
        self.urls = dict(urls)
        self.token = token
        self.http = http
        self._kinds: dict[str, str] | None = None

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    async def call(
        self, name: str, operation: str, checkpoint_id: str, *, deadline_s: float = 30.0, **fields: Any
    ) -> httpx.Response:
        """One raw POST `operation` with `{checkpoint_id, deadline_ts, **fields}` (no status check)."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + deadline_s, **fields}
        return await self.http.post(
            f"{self.urls[name]}{PREFIX}/{operation}",
            json=body,
            headers=self._headers(),
            timeout=deadline_s + 5,
        )

    async def ok(self, name: str, operation: str, checkpoint_id: str, **fields: Any) -> dict[str, Any]:
        reply = await self.call(name, operation, checkpoint_id, **fields)
        if reply.status_code != 200:
            raise ControlError(name, operation, reply)
        document: dict[str, Any] = reply.json()
        return document

    async def status(self, name: str) -> dict[str, Any]:
        reply = await self.http.get(f"{self.urls[name]}{PREFIX}/status", headers=self._headers())
        if reply.status_code != 200:
            raise ControlError(name, "status", reply)
        document: dict[str, Any] = reply.json()
        return document

    async def kinds(self) -> dict[str, str]:
        """Participant name → kind, sorted by (stage, name); non-participants (404) left out."""
        if self._kinds is None:
            found: dict[str, str] = {}
            for name, url in self.urls.items():
                reply = await self.http.get(f"{url}{PREFIX}/status", headers=self._headers())
                if reply.status_code == 404:
                    continue
                if reply.status_code != 200:
                    raise ControlError(name, "status", reply)
                found[name] = reply.json()["kind"]
            self._kinds = dict(sorted(found.items(), key=lambda item: (stage_of(item[1]), item[0])))
        return self._kinds

    async def _all(
        self, names: Iterable[str], operation: str, checkpoint_id: str, **fields: Any
    ) -> dict[str, dict[str, Any]]:
        """The call on every one at once; once all answered, the first failure is raised."""
        names = list(names)
        replies = await asyncio.gather(
            *(self.ok(n, operation, checkpoint_id, **fields) for n in names), return_exceptions=True
        )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return {n: r for n, r in zip(names, replies, strict=True) if not isinstance(r, BaseException)}

    async def prepare_all(self, checkpoint_id: str, *, deadline_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Prepare stage by stage; stops after the first stage with a reply not `prepared`."""
        kinds = await self.kinds()
        replies: dict[str, dict[str, Any]] = {}
        for stage in STAGES:
            names = [n for n, k in kinds.items() if k == stage]
            got = await self._all(names, "prepare", checkpoint_id, deadline_s=deadline_s)
            replies.update(got)
            if any(r["phase"] != "prepared" for r in got.values()):
                break
        return replies

    @staticmethod
    def prepared(replies: Mapping[str, Mapping[str, Any]], kinds: Mapping[str, str]) -> bool:
        return set(replies) == set(kinds) and all(r["phase"] == "prepared" for r in replies.values())

    @staticmethod
    def restarts(replies: Mapping[str, Mapping[str, Any]]) -> set[str]:
        return {key for r in replies.values() for key in r["report"]["restarts"]}

    @classmethod
    def continued(
        cls, episodes: Iterable[EpisodeId], replies: Mapping[str, Mapping[str, Any]]
    ) -> list[EpisodeId]:
        """`episodes` without the restarts any participant reported."""
        restarts = cls.restarts(replies)
        return [e for e in episodes if e.capture_key not in restarts]

    async def commit_all(
        self, checkpoint_id: str, checkpoint_dir: str, scope: list[EpisodeId] | None, *, stop: bool = False
    ) -> dict[str, dict[str, Any]]:
        episodes = None if scope is None else [e.model_dump() for e in scope]
        return await self._all(
            await self.kinds(),
            "commit",
            checkpoint_id,
            checkpoint_dir=checkpoint_dir,
            episode_ids=episodes,
            stop=stop,
        )

    async def restore_all(
        self, checkpoint_id: str, checkpoint_dir: str, scope: list[EpisodeId], *, deadline_s: float = 30.0
    ) -> dict[str, dict[str, Any]]:
        episodes = [e.model_dump() for e in scope]
        return await self._all(
            await self.kinds(),
            "restore",
            checkpoint_id,
            deadline_s=deadline_s,
            checkpoint_dir=checkpoint_dir,
            episode_ids=episodes,
        )

    async def renew_all(self, checkpoint_id: str, *, deadline_s: float = 30.0) -> dict[str, dict[str, Any]]:
        return await self._all(await self.kinds(), "renew", checkpoint_id, deadline_s=deadline_s)

    async def resume_all(self, checkpoint_id: str) -> dict[str, dict[str, Any]]:
        """Resume in reverse stage order, every participant even after a failure; raises the first."""
        replies: dict[str, dict[str, Any]] = {}
        failures: list[ControlError] = []
        for name in reversed(list(await self.kinds())):
            try:
                replies[name] = await self.ok(name, "resume", checkpoint_id)
            except ControlError as error:
                failures.append(error)
        if failures:
            raise failures[0]
        return replies

    async def checkpoint(
        self, checkpoint_id: str, checkpoint_dir: str, episodes: Iterable[EpisodeId], *, stop: bool = False
    ) -> dict[str, dict[str, Any]]:
        """prepare → commit (scope: `episodes` minus restarts) → resume (unless `stop`). Resumes and
        raises `ControlError` when a stage is not prepared."""
        replies = await self.prepare_all(checkpoint_id)
        if not self.prepared(replies, await self.kinds()):
            await self.resume_all(checkpoint_id)
            raise RuntimeError(f"checkpoint {checkpoint_id} not prepared: {replies}")
        commits = await self.commit_all(
            checkpoint_id, checkpoint_dir, self.continued(episodes, replies), stop=stop
        )
        if not stop:
            await self.resume_all(checkpoint_id)
        return commits
