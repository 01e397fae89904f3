"""Restarts reach the environment: an episode that seeded a participant unable to capture it (a
restart-only resources server or agent) is a restart on the environment too — listed under
`restarts`, never a blocker, never exported under a null scope, `restart_in_scope` when a scope names
it — and after a restore its replacement starts over and still finishes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import RESTART_HEADER, VERIFY_HEADER, EpisodeId
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.gymsim_v2.conftest import V2, code, running, v2_spec

pytestmark = pytest.mark.anyio

RESTART_ONLY = {"checkpoint_mode": "restart_only"}


def _ids(*keys: str) -> list[dict[str, object]]:
    return [EpisodeId(rollout_id=k).model_dump() for k in keys]


async def _post(gym: V2, name: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await gym.http.post(gym.urls[name] + path, json=body)


async def test_only_a_seed_reply_and_the_turn_that_opened_the_session_carry_the_header(
    http: httpx.AsyncClient,
) -> None:
    with running(v2_spec(resources=RESTART_ONLY)) as cluster:
        gym = V2(cluster.urls, http)
        episode = EpisodeId(rollout_id="x").model_dump()
        seed = await _post(gym, "resources", "/seed_session", {"episode_id": episode, "seed": "s"})
        assert seed.status_code == 200, seed.text
        assert (seed.headers.get(RESTART_HEADER), seed.headers.get(VERIFY_HEADER)) == ("1", "replay")
        turn = {"episode_id": EpisodeId(rollout_id="y").model_dump(), "observation": "o"}
        first = await _post(gym, "agent", "/v1/turn", turn | {"turn": 0})
        second = await _post(gym, "agent", "/v1/turn", turn | {"turn": 1})
        assert first.status_code == second.status_code == 200, (first.text, second.text)
        # the agent relays the resources seed reply's header once; the environment's mark sticks
        assert first.headers.get(RESTART_HEADER) == "1"
        assert RESTART_HEADER not in second.headers
    with running(v2_spec(agent=RESTART_ONLY)) as cluster:  # the agent's own: on its seeding turn only
        gym = V2(cluster.urls, http)
        turn = {"episode_id": EpisodeId(rollout_id="y").model_dump(), "observation": "o"}
        first = await _post(gym, "agent", "/v1/turn", turn | {"turn": 0})
        second = await _post(gym, "agent", "/v1/turn", turn | {"turn": 1})
        assert first.headers.get(RESTART_HEADER) == "1"
        assert RESTART_HEADER not in second.headers
    with running(v2_spec()) as cluster:  # an exporting resources server marks nothing
        gym = V2(cluster.urls, http)
        turn = {"episode_id": EpisodeId(rollout_id="y").model_dump(), "observation": "o"}
        reply = await _post(gym, "agent", "/v1/turn", turn | {"turn": 0})
        assert reply.status_code == 200
        assert RESTART_HEADER not in reply.headers


async def test_a_restart_only_resources_server_makes_its_episodes_restarts_on_the_environment(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tasks = make_tasks(3, turns=3)
    with running(v2_spec(resources=RESTART_ONLY)) as cluster:
        gym = V2(cluster.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        await trainer.advance(1, ["r0", "r1"])  # r2 never ran a turn: it seeded nothing
        await trainer.wait_parked()
        live = await trainer.episodes()
        assert {k: e["restart"] for k, e in live.items()} == {"r0": True, "r1": True, "r2": False}
        prepared = await gym.control.prepare_all("c1")
        assert {n: r["phase"] for n, r in prepared.items()} == dict.fromkeys(prepared, "prepared")
        for name in ("environment", "agent", "resources"):
            assert prepared[name]["report"]["restarts"] == ["r0", "r1"], name
            assert prepared[name]["report"]["blockers"] == [], name
        named = await gym.op(
            "environment", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0")
        )
        assert (named.status_code, code(named)) == (409, "restart_in_scope")
        unscoped = await gym.op("environment", "commit", "c1", checkpoint_dir=str(tmp_path))
        assert unscoped.status_code == 200, unscoped.text
        assert unscoped.json()["episode_ids"] == ["r2"]  # the restarts are simply not exported
        agent = await gym.op("agent", "commit", "c1", checkpoint_dir=str(tmp_path))
        assert agent.status_code == 200
        assert agent.json()["episode_ids"] == []
        await gym.control.resume_all("c1")
        await trainer.unpace()
        assert await trainer.wait_results() == expected_results(tasks)  # a restart just keeps running


async def test_a_restart_only_agent_makes_its_episodes_restarts_on_the_environment(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tasks = make_tasks(2, turns=3)
    with running(v2_spec(agent=RESTART_ONLY)) as cluster:
        gym = V2(cluster.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        await trainer.advance(1, ["r0"])
        await trainer.wait_parked()
        prepared = await gym.control.prepare_all("c1")
        assert prepared["environment"]["report"]["restarts"] == ["r0"]
        assert prepared["agent"]["report"]["restarts"] == ["r0"]
        assert prepared["resources"]["report"]["restarts"] == []  # it exports its sessions
        named = await gym.op(
            "environment", "commit", "c1", checkpoint_dir=str(tmp_path), episode_ids=_ids("r0")
        )
        assert (named.status_code, code(named)) == (409, "restart_in_scope")
        unscoped = await gym.op("environment", "commit", "c1", checkpoint_dir=str(tmp_path))
        assert unscoped.json()["episode_ids"] == ["r1"]
        await gym.control.resume_all("c1")
        await trainer.unpace()
        assert await trainer.wait_results() == expected_results(tasks)


async def test_exact_restore_with_a_restart_only_resources_server(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """Restarts start over on the fresh cluster; the rest continue; every result is exact."""
    spec = v2_spec(resources=RESTART_ONLY)
    tasks = make_tasks(5, turns=4)
    folder = str(tmp_path / "ckpt")
    with running(spec) as first:
        gym = V2(first.urls, http)
        trainer = gym.trainer()
        await trainer.start(tasks, paced=True)
        # r0, r1 at boundary 0 (nothing seeded: they continue); r2, r3 at 2 (restarts); r4 finished
        await trainer.advance(2, ["r2", "r3"])
        await trainer.unpace(["r4"])
        await trainer.wait_done(["r4"])
        await trainer.wait_parked()
        commits = await gym.control.checkpoint("c1", folder, trainer.in_flight(), stop=True)
        await trainer.detach()
    assert commits["environment"]["episode_ids"] == ["r0", "r1"]
    for name in ("agent", "policy_model", "resources"):
        assert commits[name]["episode_ids"] == [], name
    scope = [e for e in trainer.in_flight() if e.rollout_id in ("r0", "r1")]
    with running(spec) as second:
        gym = V2(second.urls, http)
        restored = await gym.control.restore_all("r-c1", folder, scope)
        assert restored["environment"]["restored"] == ["r0-a1", "r1-a1"]
        await gym.control.resume_all("r-c1")
        started = await trainer.continue_on(second.urls["environment"], paced=True)
        assert [e.capture_key for e in started] == ["r0-a1", "r1-a1", "r2-a1", "r3-a1"]
        live = await trainer.episodes()
        # the restarts' replacements start over at turn 0 (they were at 2), nothing restored for them
        assert {k: e["turn"] for k, e in live.items()} == dict.fromkeys(live, 0)
        assert (await gym.state("environment"))["restored_pending"] == []
        await trainer.advance(1)
        await trainer.wait_parked()
        live = await trainer.episodes()
        assert {k: e["restart"] for k, e in live.items()} == dict.fromkeys(live, True)  # seeded anew
        await trainer.unpace()
        results = await trainer.wait_results()
    assert results == expected_results(tasks)
