"""Async helpers to drive rollouts on reference agents (tests, demo, benchmarks).

```python
async with httpx.AsyncClient() as http:
    await start_rollouts(http, agent_url, {"r0": 5, "r1": 5})
    rollouts = await wait_finished(http, agent_url, timeout_s=60)
    results = final_results(rollouts)           # rollout id -> final result
    assert not turn_log_problems(rollouts)      # no turn lost, none run twice
```

After a restore nothing runs a restored rollout until the trainer sends `/run` again for the
execution the restore continues, (rollout_id, saved attempt + 1) — exactly what the coordinator's
restore lists (`Attempt.resubmit`): `await resubmit(http, agent_url, attempt.resubmit_on(name))`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import httpx

FINISHED = ("completed", "failed")


class RolloutError(RuntimeError):
    pass


class Execution(Protocol):
    """One agent execution to send: a rollout id and its attempt index (the coordinator's
    `Resubmission` is one)."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def attempt_index(self) -> int: ...


async def start_rollout(
    http: httpx.AsyncClient, agent_url: str, rollout_id: str, turns: int, *, attempt_index: int = 0
) -> dict[str, Any]:
    """`POST /run`, retrying while the agent's admission is closed (409 `checkpoint_parked`)."""
    body = {"rollout_id": rollout_id, "turns": turns, "attempt_index": attempt_index}
    while True:
        reply = await http.post(f"{agent_url}/run", json=body)
        if reply.status_code == 409 and reply.json().get("error", {}).get("code") == "checkpoint_parked":
            await asyncio.sleep(min(1.0, float(reply.headers.get("retry-after", "1"))))
            continue
        if reply.status_code != 200:
            raise RolloutError(f"POST {agent_url}/run {rollout_id}: {reply.status_code} {reply.text}")
        result: dict[str, Any] = reply.json()
        return result


async def start_rollouts(http: httpx.AsyncClient, agent_url: str, rollouts: Mapping[str, int]) -> None:
    """Start every `rollout_id: turns` of `rollouts` on one agent."""
    await asyncio.gather(*(start_rollout(http, agent_url, rid, turns) for rid, turns in rollouts.items()))


async def resubmit(http: httpx.AsyncClient, agent_url: str, executions: Iterable[Execution]) -> None:
    """Send `/run` again for each execution a restore continues, as a trainer on real Gym must.

    Each must be a restored continuation waiting on this agent (`/rollouts` status `restored`,
    that attempt index): its task (`turns`) is read from there — this helper's stand-in for the
    trainer's own copy of the request. Anything else raises `RolloutError`; so does a refused
    `/run` (409 `stale_attempt` for an execution the restore retired).
    """
    chosen = list(executions)
    if not chosen:
        return
    views = await get_rollouts(http, agent_url)
    turns: dict[str, int] = {}
    for execution in chosen:
        view = views.get(execution.rollout_id)
        if view is None or view["status"] != "restored" or view["attempt_index"] != execution.attempt_index:
            raise RolloutError(
                f"{agent_url} holds no restored continuation of rollout {execution.rollout_id!r}"
                f" attempt {execution.attempt_index}"
            )
        turns[execution.rollout_id] = int(view["turns"])
    await asyncio.gather(
        *(
            start_rollout(http, agent_url, e.rollout_id, turns[e.rollout_id], attempt_index=e.attempt_index)
            for e in chosen
        )
    )


async def restart(http: httpx.AsyncClient, server_url: str) -> None:
    """Restart one gymsim server as its process would be: same URL, nothing of its state kept."""
    reply = await http.post(f"{server_url}/gymsim/admin/restart")
    reply.raise_for_status()


async def get_rollouts(http: httpx.AsyncClient, agent_url: str) -> dict[str, dict[str, Any]]:
    """`GET /rollouts` as rollout id → view (status, attempt, turns_done, turn_log, result, …)."""
    reply = await http.get(f"{agent_url}/rollouts")
    reply.raise_for_status()
    return {r["rollout_id"]: r for r in reply.json()["rollouts"]}


async def wait_until(
    http: httpx.AsyncClient,
    agent_url: str,
    predicate: Callable[[dict[str, dict[str, Any]]], bool],
    *,
    timeout_s: float = 120.0,
    poll_s: float = 0.02,
) -> dict[str, dict[str, Any]]:
    """Poll `/rollouts` until `predicate(rollouts)` holds; TimeoutError after `timeout_s`."""
    give_up = time.monotonic() + timeout_s
    while True:
        rollouts = await get_rollouts(http, agent_url)
        if predicate(rollouts):
            return rollouts
        if time.monotonic() > give_up:
            raise TimeoutError(f"rollouts on {agent_url} did not get there: {summary(rollouts)}")
        await asyncio.sleep(poll_s)


async def wait_finished(
    http: httpx.AsyncClient, agent_url: str, *, timeout_s: float = 120.0, expect: int | None = None
) -> dict[str, dict[str, Any]]:
    """Wait until every rollout (at least `expect` of them) is completed or failed."""
    return await wait_until(
        http,
        agent_url,
        lambda rs: (
            (expect is None or len(rs) >= expect) and all(r["status"] in FINISHED for r in rs.values())
        ),
        timeout_s=timeout_s,
    )


async def wait_turns(
    http: httpx.AsyncClient, agent_url: str, min_turns: int, *, timeout_s: float = 120.0
) -> dict[str, dict[str, Any]]:
    """Wait until every rollout has finished at least `min_turns` turns."""
    return await wait_until(
        http,
        agent_url,
        lambda rs: bool(rs) and all(r["turns_done"] >= min_turns for r in rs.values()),
        timeout_s=timeout_s,
    )


def final_results(rollouts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Rollout id → final result (None for an unfinished rollout)."""
    return {rid: rollouts[rid]["result"] for rid in sorted(rollouts)}


def turn_log_problems(rollouts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every turn lost or run twice, and every model call id / revision out of sequence."""
    problems: list[str] = []
    for rid in sorted(rollouts):
        rollout = rollouts[rid]
        turns = [entry["turn"] for entry in rollout["turn_log"]]
        expected = list(range(1, rollout["turns_done"] + 1))
        if turns != expected:
            problems.append(f"{rid}: turns ran {turns}, expected {expected}")
        for entry in rollout["turn_log"]:
            if entry["model_call_id"] != f"call-{entry['turn']}":
                problems.append(f"{rid}: turn {entry['turn']} used model call {entry['model_call_id']}")
            revision = entry.get("resource_revision")
            if revision is not None and revision != entry["turn"]:
                problems.append(f"{rid}: turn {entry['turn']} saw resource revision {revision}")
    return problems


def summary(rollouts: Mapping[str, Mapping[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for rollout in rollouts.values():
        counts[rollout["status"]] = counts.get(rollout["status"], 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no rollouts"
