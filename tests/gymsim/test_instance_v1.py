"""The spec's `instance` on v1: the name a v1 server reports in its capabilities and writes its
files under, apart from its server name — so two deployments of one Gym config (NeMo RL's replicas,
`replica_spec`) report the same names while every server keeps its own, as Gym's do."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from quiesce.coordinator.protocol import CAPABILITIES_PATH
from quiesce.tools.gymsim import client
from quiesce.tools.gymsim.cluster import start_cluster
from quiesce.tools.gymsim.spec import ClusterSpec, default_spec, replica_spec
from tests.gymsim.conftest import TOKEN

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def test_replica_spec_keeps_each_v1_servers_own_name_as_its_instance() -> None:
    spec = replica_spec(default_spec(), "d1.")
    assert [(s.name, s.instance_name) for s in spec.expanded()] == [
        ("d1.policy_model", "policy_model"),
        ("d1.judge", "judge"),
        ("d1.simple_agent", "simple_agent"),
        ("d1.math_agent", "math_agent"),
        ("d1.tools", "tools"),
    ]
    agent = next(s for s in spec.expanded() if s.name == "d1.simple_agent")
    assert (agent.policy, agent.resources) == ("d1.policy_model", "d1.tools")  # peers by server name


def test_a_v1_instance_defaults_to_the_name_and_may_not_be_shared_in_one_cluster() -> None:
    plain = ClusterSpec.model_validate({"servers": [{"kind": "model", "name": "m"}]})
    assert plain.expanded()[0].instance_name == "m"
    with pytest.raises(ValueError, match="share instance names: m"):
        ClusterSpec.model_validate(
            {"servers": [{"kind": "model", "name": "m"}, {"kind": "resources", "name": "r", "instance": "m"}]}
        )


async def test_a_replica_reports_and_keys_revisions_by_its_servers_instance_names() -> None:
    with start_cluster(replica_spec(default_spec(), "d0."), token=TOKEN) as running:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            names: dict[str, Any] = {}
            for name, url in running.urls.items():
                names[name] = (await http.get(url + CAPABILITIES_PATH)).json()["name"]
            assert names == {name: name.removeprefix("d0.") for name in running.urls}
            agent = running.urls["d0.simple_agent"]
            await client.start_rollouts(http, agent, {"r0": 2})
            rollouts = await client.wait_finished(http, agent, timeout_s=30)
    # the agent names its resources server as that server names itself (Gym's agents key
    # `resource_state_revisions` by the resources server's own name)
    assert set(rollouts["r0"]["resource_state_revisions"]) == {"tools"}
