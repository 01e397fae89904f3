"""The trainer's side of a v2 cluster: start episodes, pace them, know which are in flight, continue
them after a restore, collect their results. For tests, the demo and the bench.

```python
tasks = make_tasks(4, turns=5)                  # {"r0": {"turns": 5, "seed": 0}, ...}
async with Trainer(cluster.urls["environment"]) as trainer:
    await trainer.start(tasks, paced=True)       # every episode waits at boundary 0
    await trainer.advance(2)                     # grant two turns each
    await trainer.wait_parked()                  # all at boundary 2, none mid-turn
    await trainer.hold(["r0"])                   # r0's next turn stops mid-turn (a prepare blocker)
    ... checkpoint (tools/gymsim/v2/drive.py, raw calls, or the coordinator) ...
    await trainer.detach()                       # the old cluster is gone: its /run calls are lost
    await trainer.continue_on(new_env_url)       # attempt n+1 of every rollout in flight
    results = await trainer.wait_results()       # {rollout_id: result}
assert results == expected_results(tasks)
```

Rules: an episode's result is a pure function of its task (`logic.reference_result`), so
`expected_results(tasks)` is what any run — interrupted, restored, restarted — must finish with.
`in_flight()` names each unfinished rollout by its current attempt; `continue_on` starts attempt + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import httpx

from quiesce.coordinator.protocol_v2 import EpisodeId, episode_of_key
from quiesce.tools.gymsim.v2.logic import reference_result


def make_tasks(count: int, *, turns: int = 4, prefix: str = "r") -> dict[str, dict[str, Any]]:
    """`count` tasks keyed by rollout id (`r0`, `r1`, ...), each running `turns` turns."""
    return {f"{prefix}{i}": {"turns": turns, "seed": i} for i in range(count)}


def expected_results(tasks: Mapping[str, Any], *, stateless_resources: bool = False) -> dict[str, str]:
    """What an uninterrupted run of these tasks finishes with (no server needed)."""
    return {
        rid: reference_result(task, stateless_resources=stateless_resources) for rid, task in tasks.items()
    }


class EpisodeFailed(Exception):
    """An episode's `/run` ended with an error reply."""


class Trainer:
    """Runs episodes on one environment server (and, after `continue_on`, on another)."""

    def __init__(self, env_url: str, *, http: httpx.AsyncClient | None = None) -> None:
        self.env_url = env_url.rstrip("/")
        self._own_http = http is None
        # every episode's /run holds a connection until the episode ends
        self.http = http or httpx.AsyncClient(
            trust_env=False, timeout=httpx.Timeout(30.0, read=None), limits=httpx.Limits(max_connections=None)
        )
        self.tasks: dict[str, Any] = {}
        self.attempts: dict[str, int] = {}
        self.results: dict[str, str] = {}
        #: rollout id → (status, body) of a `/run` that ended in an error (or None: connection lost)
        self.failures: dict[str, tuple[int | None, Any]] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}

    async def __aenter__(self) -> Trainer:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.detach()
        if self._own_http:
            await self.http.aclose()

    # -- episodes ----------------------------------------------------------------------------

    async def start(
        self, tasks: Mapping[str, Any], *, paced: bool = True, attempt: int = 0
    ) -> list[EpisodeId]:
        """Start one episode per task (attempt `attempt`); with `paced` each waits at its boundaries
        for `advance`. Returns once the environment registered every one."""
        started = []
        for rollout_id, task in tasks.items():
            self.tasks[rollout_id] = task
            self.attempts[rollout_id] = attempt
            started.append(self._launch(rollout_id, paced))
        await self._registered([e.capture_key for e in started])
        return started

    def _launch(self, rollout_id: str, paced: bool) -> EpisodeId:
        episode = EpisodeId(rollout_id=rollout_id, attempt=self.attempts[rollout_id])
        self.failures.pop(rollout_id, None)
        body = {"episode_id": episode.model_dump(), "task": self.tasks[rollout_id], "paced": paced}
        self._runs[rollout_id] = asyncio.create_task(self._run(rollout_id, self.env_url, body))
        return episode

    async def _run(self, rollout_id: str, env_url: str, body: dict[str, Any]) -> None:
        try:
            reply = await self.http.post(env_url + "/run", json=body, timeout=None)
        except httpx.HTTPError:
            self.failures[rollout_id] = (None, None)
            return
        if reply.status_code == 200:
            self.results[rollout_id] = str(reply.json()["result"])
        else:
            try:
                document: Any = reply.json()
            except ValueError:
                document = reply.text
            self.failures[rollout_id] = (reply.status_code, document)

    async def _registered(self, keys: list[str], timeout_s: float = 60.0) -> None:
        """Wait until the environment lists each key, or its run ended (a refusal, or done)."""
        give_up = time.monotonic() + timeout_s
        while True:
            live = await self.episodes()
            pending = [
                k for k in keys if k not in live and not self._runs[episode_of_key(k).rollout_id].done()
            ]
            if not pending:
                return
            if time.monotonic() > give_up:
                raise TimeoutError(f"episodes never started: {pending}")
            await asyncio.sleep(0.01)

    def in_flight(self) -> list[EpisodeId]:
        """Every rollout started and not finished, as its current attempt (sorted by rollout id)."""
        return [
            EpisodeId(rollout_id=rid, attempt=self.attempts[rid])
            for rid in sorted(self.tasks)
            if rid not in self.results
        ]

    async def episodes(self) -> dict[str, Any]:
        """The environment's live episodes: capture key → {turn, allowed, mid_turn, held, ...}."""
        reply = await self.http.get(self.env_url + "/gymsim/admin/episodes")
        reply.raise_for_status()
        document: dict[str, Any] = reply.json()
        return document

    async def advance(self, turns: int = 1, rollout_ids: Iterable[str] | None = None) -> None:
        """Grant `turns` more turns to paced episodes (all, or these rollouts)."""
        await self._admin("episodes/advance", {"turns": turns, "rollout_ids": _list(rollout_ids)})

    async def unpace(self, rollout_ids: Iterable[str] | None = None) -> None:
        """Let paced episodes run to their end."""
        await self._admin("episodes/unpace", {"rollout_ids": _list(rollout_ids)})

    async def hold(self, rollout_ids: Iterable[str]) -> None:
        """Stop these rollouts' next turn mid-turn (a prepare blocker) until `release`."""
        await self._admin("episodes/hold", {"rollout_ids": list(rollout_ids)})

    async def hold_mid_turn(self, rollout_ids: Iterable[str]) -> None:
        """Start these paced rollouts' next turn and hold them in it (a prepare blocker) until
        `release`: returns once each is mid-turn."""
        held = list(rollout_ids)
        await self.hold(held)
        await self.advance(1, held)
        await self.wait_mid_turn(held)

    async def release(self, rollout_ids: Iterable[str] | None = None) -> None:
        await self._admin("episodes/release", {"rollout_ids": _list(rollout_ids)})

    async def _admin(self, path: str, body: dict[str, Any]) -> None:
        reply = await self.http.post(f"{self.env_url}/gymsim/admin/{path}", json=body)
        reply.raise_for_status()

    async def wait_parked(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until no live paced episode is mid-turn and each used its granted turns (or finished)."""
        give_up = time.monotonic() + timeout_s
        while True:
            live = await self.episodes()
            busy = [
                k
                for k, e in live.items()
                if e["mid_turn"] or (e["allowed"] is not None and e["turn"] < min(e["allowed"], e["turns"]))
            ]
            if not busy:
                return live
            if time.monotonic() > give_up:
                raise TimeoutError(f"episodes never parked: {busy}")
            await asyncio.sleep(0.01)

    async def wait_done(self, rollout_ids: Iterable[str], timeout_s: float = 60.0) -> None:
        """Wait until the `/run` of each of these rollouts has ended (a result or a failure)."""
        tasks = [self._runs[r] for r in rollout_ids if r in self._runs]
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)

    async def wait_mid_turn(self, rollout_ids: Iterable[str], timeout_s: float = 60.0) -> None:
        """Wait until each of these rollouts is mid-turn (e.g. held)."""
        wanted = set(rollout_ids)
        give_up = time.monotonic() + timeout_s
        while True:
            live = await self.episodes()
            if all(any(e["rollout_id"] == r and e["mid_turn"] for e in live.values()) for r in wanted):
                return
            if time.monotonic() > give_up:
                raise TimeoutError(f"never mid-turn: {sorted(wanted)}")
            await asyncio.sleep(0.01)

    # -- after a restore ---------------------------------------------------------------------

    async def detach(self) -> None:
        """Stop waiting for the `/run` calls under way (their cluster is gone, or is being left)."""
        for task in self._runs.values():
            task.cancel()
        for task in self._runs.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._runs = {rid: t for rid, t in self._runs.items() if not t.cancelled()}

    async def continue_on(
        self, env_url: str, rollout_ids: Iterable[str] | None = None, *, paced: bool = False
    ) -> list[EpisodeId]:
        """Start attempt + 1 of every rollout in flight (or of these) on `env_url`: a restored one
        continues from its saved boundary, any other starts over."""
        self.env_url = env_url.rstrip("/")
        chosen = [e.rollout_id for e in self.in_flight()] if rollout_ids is None else list(rollout_ids)
        started = []
        for rollout_id in chosen:
            old = self._runs.get(rollout_id)
            if old is not None and not old.done():
                old.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await old
            self.attempts[rollout_id] += 1
            started.append(self._launch(rollout_id, paced))
        await self._registered([e.capture_key for e in started])
        return started

    async def wait_results(self, timeout_s: float = 120.0) -> dict[str, str]:
        """Wait for every started rollout's `/run`; the results by rollout id. `EpisodeFailed` names
        each rollout whose run ended without a result."""
        pending = [t for t in self._runs.values() if not t.done()]
        if pending:
            await asyncio.wait_for(asyncio.gather(*pending), timeout_s)
        missing = {rid: self.failures.get(rid) for rid in self.tasks if rid not in self.results}
        if missing:
            raise EpisodeFailed(f"episodes without a result: {missing}")
        return dict(sorted(self.results.items()))


def _list(values: Iterable[str] | None) -> list[str] | None:
    return None if values is None else list(values)
