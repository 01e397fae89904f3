"""The spec's `instance` (v2): the name a server reports in its status and stores under, apart from its
server name — so two deployments of one Gym config (NeMo RL's replicas) repeat instance names while
every server keeps its own name, and a checkpoint of one restores into the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from quiesce.tools.gymsim.spec import ClusterSpec, default_v2_spec
from quiesce.tools.gymsim.v2.trainer import expected_results, make_tasks
from tests.gymsim_v2.conftest import V2, running

pytestmark = pytest.mark.anyio

KINDS = {"environment": "environment", "policy_model": "model", "agent": "agent", "resources": "resources"}
REFS = ("agent", "policy", "resources", "judge")


def replica(prefix: str) -> dict[str, Any]:
    """The default v2 spec with every server renamed `<prefix><name>` and its instance the plain name."""
    document = default_v2_spec().model_dump(mode="json")
    for server in document["servers"]:
        server["instance"] = server["name"]
        server["name"] = prefix + server["name"]
        for ref in REFS:
            if server.get(ref) is not None:
                server[ref] = prefix + server[ref]
    return document


def test_the_default_instance_is_the_server_name() -> None:
    spec = default_v2_spec()
    assert [s.instance_name for s in spec.expanded()] == [s.name for s in spec.expanded()]


def test_count_expands_the_instance_too() -> None:
    spec = ClusterSpec.model_validate(
        {
            "servers": [
                {"kind": "model", "plane": "v2", "name": "m{i}", "instance": "inst{i}", "count": 2},
            ]
        }
    )
    assert [(s.name, s.instance_name) for s in spec.expanded()] == [("m0", "inst0"), ("m1", "inst1")]


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ([{"kind": "model", "plane": "v2", "name": "m", "instance": "../x"}], "instance names must match"),
        ([{"kind": "model", "plane": "v2", "name": "m", "instance": ""}], "at least 1 character"),
        (
            [
                {"kind": "model", "plane": "v2", "name": "m"},
                {"kind": "resources", "plane": "v2", "name": "r", "instance": "m"},
            ],
            "share instance names: m",
        ),
    ],
)
def test_bad_instances_are_refused(servers: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ClusterSpec.model_validate({"servers": servers})


async def test_replicas_share_instances_and_restore_into_each_other(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tasks = make_tasks(3, turns=4)
    folder = tmp_path / "ckpt"
    with running(replica("nemo_gym.r0.")) as first:
        gym = V2(first.urls, http)
        for name, kind in KINDS.items():
            state = await gym.state(f"nemo_gym.r0.{name}")
            assert (state["kind"], state["instance"]) == (kind, name)
        trainer = gym.trainer("nemo_gym.r0.environment")
        await trainer.start(tasks, paced=True)
        await trainer.advance(2)
        await trainer.wait_parked()
        commits = await gym.control.checkpoint("c1", str(folder), trainer.in_flight(), stop=True)
        await trainer.detach()
    for name, kind in KINDS.items():
        assert commits[f"nemo_gym.r0.{name}"]["manifest"]["instance"] == name
        assert (folder / "gym" / kind / name / "manifest.json").is_file()
    assert sorted(p.name for p in (folder / "gym" / "agent").iterdir()) == ["agent"]
    with running(replica("nemo_gym.r1.")) as second:
        gym = V2(second.urls, http)
        restored = await gym.control.restore_all("r-c1", str(folder), trainer.in_flight())
        assert {r["source_checkpoint_id"] for r in restored.values()} == {"c1"}
        await gym.control.resume_all("r-c1")
        await trainer.continue_on(second.urls["nemo_gym.r1.environment"])
        assert await trainer.wait_results() == expected_results(tasks)
