"""The rollout lineage through the service: real `quiesce serve` processes against real v2
reference servers (`tools/gymsim/v2`).

- `GET /v1/rollouts` (`?rollout=ID` repeated, `?state=S`) answers what `quiesce rollouts --json`
  prints for the same ledger, behind the API token (401 without it); a state that is none is 422
  `InvalidRequest` naming `query.state`; `RemoteCoordinator.rollouts()` rebuilds the very
  `Rollout` objects the embedded API returns.
- `/metrics`: `quiesce_rollouts_captured_total` is the number of attempts the service's published
  saves captured. A service started after a restore it did not see (the lineage seeded from the
  ledger) counts the loss a later save shows (`quiesce_rollouts_lost_total`), and nothing of
  what was recorded before it started.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiesce.coordinator import ConfigError, Coordinator, EpisodeId
from quiesce.ledger import Ledger
from quiesce.ledger.lineage import read_lineage
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.gymsim.spec import SpecLike, default_v2_spec
from quiesce.tools.gymsim.v2.trainer import Trainer, make_tasks
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.errors import InvalidRequest, Unauthorized
from tests.cli.helpers import json_of, quiesce
from tests.serve.conftest import ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

LEDGER = "sqlite+aiosqlite:///q.db"
COUNTERS = ("captured", "restarted", "retired", "lost")


def _counters(text: str) -> dict[str, float]:
    """The four rollout counters of a scrape (absent: not in it)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for what in COUNTERS:
                if sample.name == f"quiesce_rollouts_{what}_total":
                    out[what] = sample.value
    return out


async def _service(spawn_service: Any, config: Path, api_token: str) -> ServiceProcess:
    service: ServiceProcess = spawn_service(config, api_token=api_token)
    await wait_ready(service.url)
    return service


async def test_rollouts_route_client_and_counters(
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]],
    tmp_path: Path,
    spawn_service: Any,
    token: str,
) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as gym:
        await _run(make_cluster, tmp_path, spawn_service, gym)


async def _run(
    make_cluster: Callable[[SpecLike], AbstractContextManager[RunningCluster]],
    tmp_path: Path,
    spawn_service: Any,
    gym: httpx.AsyncClient,
) -> None:
    api_token = "api-" + secrets.token_hex(16)
    auth = {"Authorization": f"Bearer {api_token}"}
    ledger_file = tmp_path / "q.db"
    with make_cluster(default_v2_spec()) as first:
        config = first.write_config(tmp_path / "first.yaml", LEDGER, tmp_path / "snaps")
        service = await _service(spawn_service, config, api_token)
        trainer = Trainer(first.urls["environment"], http=gym)
        async with httpx.AsyncClient(
            base_url=service.url, trust_env=False, timeout=120, headers=auth
        ) as http:
            await trainer.start(make_tasks(3, turns=5), paced=True)
            await trainer.advance(1)
            await trainer.wait_parked()
            assert _counters((await http.get("/metrics")).text) == dict.fromkeys(COUNTERS, 0.0)
            scope = [e.model_dump() for e in trainer.in_flight()]
            reply = await http.post("/v1/checkpoints", json={"deadline_s": 60, "episodes": scope})
            assert reply.status_code == 200, reply.text
            saved = reply.json()
            assert saved["scope"] == ["r0", "r1", "r2"]

            refused = await http.get("/v1/rollouts", headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["type"] == "Unauthorized"
            every = await http.get("/v1/rollouts")
            assert every.status_code == 200, every.text
            document = every.json()
            assert [(r["rollout_id"], r["state"], r["attempt"]) for r in document["rollouts"]] == [
                (f"r{i}", "live", 0) for i in range(3)
            ]
            assert [[(s["what"], s["checkpoint_id"]) for s in r["steps"]] for r in document["rollouts"]] == [
                [("captured", saved["checkpoint_id"])]
            ] * 3
            assert document["counts"] == {"live": 3, "restarted": 0, "retired": 0, "finished": 0, "lost": 0}
            assert (document["violations"], document["warnings"]) == ([], [])
            # the CLI prints the same document for the same ledger
            cli = await anyio.to_thread.run_sync(
                lambda: quiesce("rollouts", "--ledger", str(ledger_file), "--json", cwd=tmp_path)
            )
            assert json_of(cli) == document
            picked = (await http.get("/v1/rollouts", params=[("rollout", "r2"), ("rollout", "nope"),
                                                             ("rollout", "r0")])).json()  # fmt: skip
            assert [r["rollout_id"] for r in picked["rollouts"]] == ["r2", "r0"]
            assert picked["unknown"] == ["nope"]
            assert (await http.get("/v1/rollouts", params={"state": "lost"})).json()["rollouts"] == []
            bad = await http.get("/v1/rollouts", params={"state": "gone"})
            assert bad.status_code == 422, bad.text
            assert bad.json()["error"]["type"] == "InvalidRequest"
            assert [f["field"] for f in bad.json()["error"]["fields"]] == ["query.state"]

            async with RemoteCoordinator(service.url, token=api_token) as remote:
                shown = await remote.rollouts()
                async with Ledger.open(f"sqlite+aiosqlite:///{ledger_file}", readonly=True) as ledger:
                    embedded = await read_lineage(ledger)
                assert shown == [embedded.rollouts[f"r{i}"] for i in range(3)]
                assert [r.rollout_id for r in await remote.rollouts(["r1", "nope"])] == ["r1"]
                assert await remote.rollouts("r1", state="restarted") == []
                assert await remote.rollouts([]) == []
                with pytest.raises(InvalidRequest) as caught:
                    await remote.rollouts(state="gone")
                assert isinstance(caught.value, ConfigError)  # as the embedded API raises
                again = await remote.checkpoint(deadline_s=60, episodes=trainer.in_flight())
            async with RemoteCoordinator(service.url, token="wrong") as stranger:
                with pytest.raises(Unauthorized):
                    await stranger.rollouts()
            # two saves of three attempts each
            assert _counters((await http.get("/metrics")).text) == {
                "captured": 6.0,
                "restarted": 0.0,
                "retired": 0.0,
                "lost": 0.0,
            }
            await trainer.detach()
        service.stop()
    assert again.snapshot is not None

    # a restore into fresh servers the next service does not see; r1 and r2 are dropped
    with make_cluster(default_v2_spec()) as second:
        config = second.write_config(tmp_path / "second.yaml", LEDGER, tmp_path / "snaps")
        async with Coordinator.open(config) as coord:
            restored = await coord.restore(again.snapshot, resume=True)
        assert restored.state == "completed"
        service = await _service(spawn_service, config, api_token)
        async with httpx.AsyncClient(
            base_url=service.url, trust_env=False, timeout=120, headers=auth
        ) as http:
            await trainer.continue_on(second.urls["environment"], ["r0"], paced=True)
            await trainer.wait_parked()
            assert _counters((await http.get("/metrics")).text) == dict.fromkeys(COUNTERS, 0.0)
            kept = [{"rollout_id": "r0", "attempt": 1}]
            reply = await http.post("/v1/checkpoints", json={"deadline_s": 60, "episodes": kept})
            assert reply.status_code == 200, reply.text
            assert _counters((await http.get("/metrics")).text) == {
                "captured": 1.0,
                "restarted": 0.0,
                "retired": 0.0,
                "lost": 2.0,
            }
            lost = (await http.get("/v1/rollouts", params={"state": "lost"})).json()
            assert [r["rollout_id"] for r in lost["rollouts"]] == ["r1", "r2"]
            assert [(v["rule"], v["rollout_id"]) for v in lost["violations"]] == [
                ("lost", "r1"),
                ("lost", "r2"),
            ]
            assert lost["counts"]["lost"] == 2
            await trainer.detach()
    assert EpisodeId(rollout_id="r0", attempt=1) in trainer.in_flight()
