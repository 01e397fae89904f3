"""``running_episodes``: v2 episodes kept running on environment servers for the length of a measure.

A v2 episode is a ``/run`` request held open by its trainer (``tools/gymsim/v2/trainer.py``) for
as long as the episode runs, so the trainer must live as long as the cluster: here it runs in a
background thread of the bench's own process (its own event loop), never in the measured child.
Each environment gets its own rollout ids (``<env>-r<i>``: one policy model serves every
environment, and its ledger is keyed by episode); ``scope`` is every episode started, as the
commit scope a trainer gives (``{"rollout_id", "attempt"}`` dicts, attempt 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks

#: Turns per episode: none finishes within a measure.
ENDLESS = 1_000_000
STARTUP_TIMEOUT_S = 120.0


def tasks_of(envs: Mapping[str, str], per_env: int) -> dict[str, dict[str, dict[str, Any]]]:
    """environment name → its tasks (rollout id → task), ``per_env`` endless episodes each."""
    return {name: make_tasks(per_env, turns=ENDLESS, prefix=f"{name}-r") for name in envs}


def scope_of(tasks: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every episode of ``tasks`` as the commit scope (attempt 0), sorted by rollout id."""
    return [{"rollout_id": rid, "attempt": 0} for per_env in tasks.values() for rid in sorted(per_env)]


@contextlib.contextmanager
def running_episodes(
    envs: Mapping[str, str], per_env: int, *, parked_after: int | None = None
) -> Iterator[list[dict[str, Any]]]:
    """Start ``per_env`` endless episodes on each environment (name → URL); yields their scope once
    every environment has registered them — free-running, or with ``parked_after`` paced: run that
    many turns and parked at that boundary (every save then has the same scope and no turn under
    way) — and detaches the trainers on exit."""
    tasks = tasks_of(envs, per_env)
    loop = asyncio.new_event_loop()
    trainers: list[Trainer] = []

    async def start() -> None:
        for name, url in envs.items():
            trainer = Trainer(url)
            trainers.append(trainer)
            await trainer.start(tasks[name], paced=parked_after is not None)
            if parked_after is not None:
                await trainer.advance(parked_after)
        if parked_after is not None:
            for trainer in trainers:
                await trainer.wait_parked()

    async def stop() -> None:
        for trainer in trainers:
            await trainer.aclose()

    thread = threading.Thread(target=loop.run_forever, name="bench-episodes", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(STARTUP_TIMEOUT_S)
        yield scope_of(tasks)
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


__all__ = ["ENDLESS", "running_episodes", "scope_of", "tasks_of"]
