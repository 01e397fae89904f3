"""Finding the Gym deployments of a NeMo RL run from the driver (`quiesce.rl.deployments`): real Ray
actors standing in for RL's `NemoGym` (`tests/rl/gym_actor.py`), each with a gymsim deployment and a
head server; and hostile head servers, whose replies must give errors naming the deployment."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from starlette.responses import Response

from quiesce.coordinator import parse_config
from quiesce.coordinator.protocol_v2 import PREFIX
from quiesce.rl import deployments
from quiesce.rl.deployments import Deployment, cluster_servers, find_deployments, parse_global_config
from tests.rl.conftest import ShardSet, StartActors, env_handles
from tests.rl.gym_actor import BareHead, HeadServer, HeadServerConfig

pytestmark = pytest.mark.anyio

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
V2_NAMES = ["agent", "environment", "policy_model", "resources"]
V1_NAMES = ["judge", "math_agent", "policy_model", "simple_agent", "tools"]
V2_KINDS = {"environment": "environment", "policy_model": "model", "agent": "agent", "resources": "resources"}


async def _check_found(found: list[Deployment], shard_set: ShardSet, names: list[str]) -> None:
    actors = shard_set.handles["nemo_gym"]
    assert [d.instance_id for d in found] == ["nemo_gym/replica-0", "nemo_gym/replica-1"]
    for i, (deployment, actor) in enumerate(zip(found, actors, strict=True)):
        assert (deployment.shard, deployment.replica) == ("nemo_gym", i)
        assert deployment.folder == f"gym-instances/nemo_gym/replica-{i}"
        assert [n for n, _ in deployment.servers] == names
        assert dict(deployment.servers) == await actor.urls.remote()
        assert deployment.head_url == await actor.head_url.remote()
    assert not set(dict(found[0].servers).values()) & set(dict(found[1].servers).values())


def _config(entries: list[dict[str, Any]], tmp_path: Path) -> Any:
    return parse_config(
        {"ledger": f"sqlite+aiosqlite:///{tmp_path / 'l.db'}", "snapshots": "snaps", "servers": entries},
        base_dir=tmp_path,
    )


async def test_v2_replicas_are_found_with_their_servers_and_folders(
    gym_actors: StartActors, token: str, tmp_path: Path
) -> None:
    shard_set = await gym_actors("v2")
    other = BareHead.remote()  # type: ignore[attr-defined]  # another environment's actor: not Gym
    found = await find_deployments(env_handles(shard_set, math=other, also_gym=shard_set))
    await _check_found(found, shard_set, V2_NAMES)

    entries = cluster_servers(found)
    assert [e["name"] for e in entries] == [f"nemo_gym.r{i}.{n}" for i in (0, 1) for n in V2_NAMES]
    assert all(NAME.match(e["name"]) for e in entries)
    assert [e["folder"] for e in entries] == [
        f"gym-instances/nemo_gym/replica-{i}" for i in (0, 1) for _ in V2_NAMES
    ]
    config = _config(entries, tmp_path)
    assert [(s.name, s.url, s.folder) for s in config.servers] == [
        (e["name"], e["url"], e["folder"]) for e in entries
    ]

    # replicas of one Gym config: the same instance names, told apart only by their folder
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        for deployment in found:
            for gym_name, url in deployment.servers:
                reply = await http.get(url + PREFIX + "/status", headers={"authorization": f"Bearer {token}"})
                assert reply.status_code == 200, reply.text
                assert (reply.json()["kind"], reply.json()["instance"]) == (V2_KINDS[gym_name], gym_name)

    # the head address was read without importing quiesce.rl into RL's actor
    for actor in shard_set.handles["nemo_gym"]:
        assert not await actor.__ray_call__.remote(lambda self: "quiesce.rl.deployments" in sys.modules)
    ray.kill(other)


async def test_v1_replicas_are_found_each_named_per_replica_and_in_its_folder(
    gym_actors: StartActors, tmp_path: Path
) -> None:
    shard_set = await gym_actors("v1")
    found = await find_deployments(env_handles(shard_set))
    await _check_found(found, shard_set, V1_NAMES)
    entries = cluster_servers(found, plane="v1")
    # replicas' v1 servers report the same Gym names: each deployment writes into its own folder
    assert [e["folder"] for e in entries] == [d.folder for d in found for _ in d.servers]
    for deployment, actor in zip(found, shard_set.handles["nemo_gym"], strict=True):
        own = await actor.server_names.remote()
        mine = [e for e in entries if e["url"] in dict(deployment.servers).values()]
        assert [e["name"] for e in mine] == [own[n] for n, _ in deployment.servers]
    assert [s.name for s in _config(entries, tmp_path).servers] == [e["name"] for e in entries]


async def test_a_bare_actor_handle_is_shard_nemo_gym_replica_0(gym_actors: StartActors) -> None:
    shard_set = await gym_actors("v2", replicas=1)
    actor = shard_set.handles["nemo_gym"][0]
    (found,) = await find_deployments({"nemo_gym": actor, "same": actor})
    assert (found.instance_id, found.folder) == ("nemo_gym/replica-0", "gym-instances/nemo_gym/replica-0")
    assert dict(found.servers) == await actor.urls.remote()
    with pytest.raises(ValueError, match="one Gym actor is both instance"):
        await find_deployments({"a": actor, "b": ShardSet({"other": [actor]})})


# -- what is not a Gym deployment ---------------------------------------------------------------


async def test_no_gym_deployment_names_what_was_found(ray_local: None) -> None:
    other = BareHead.remote()  # type: ignore[attr-defined]
    try:
        with pytest.raises(ValueError, match=r"no Gym deployment .*'math': BareHead, 'n': int"):
            await find_deployments({"math": other, "n": 3})
        with pytest.raises(ValueError, match="not a mapping"):
            await find_deployments([other])  # type: ignore[arg-type]
    finally:
        ray.kill(other)


@pytest.mark.parametrize(
    ("handles", "message"),
    [
        ({"nemo_gym/0": "actor"}, r"'nemo_gym/0' is not '<shard>/replica-<i>'"),
        ({"../x/replica-0": "actor"}, "is not '<shard>/replica-<i>'"),
        ({"nemo_gym/replica-0": "not an actor"}, "is a str, not a Ray actor handle"),
    ],
)
async def test_bad_checkpoint_handles_are_refused(
    ray_local: None, handles: dict[str, Any], message: str
) -> None:
    other = BareHead.remote()  # type: ignore[attr-defined]
    try:
        real = {k: (other if v == "actor" else v) for k, v in handles.items()}

        class Set:
            checkpoint_handles = real

        with pytest.raises(ValueError, match=message):
            await find_deployments({"nemo_gym": Set()})
    finally:
        ray.kill(other)


# -- hostile head servers -----------------------------------------------------------------------


@pytest.fixture
def head() -> Iterator[HeadServer]:
    server = HeadServer({})
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def bare(ray_local: None) -> Any:
    actor = BareHead.remote()  # type: ignore[attr-defined]
    yield actor
    ray.kill(actor)


def _gym(**servers: Any) -> dict[str, Any]:
    return {"head_server": {"host": "127.0.0.1", "port": 1}, "policy_api_key": "secret-key", **servers}


def _server(host: Any = "127.0.0.1", port: Any = 8001, kind: str = "responses_api_models") -> dict[str, Any]:
    return {kind: {"impl": {"entrypoint": "app.py", "host": host, "port": port}}}


async def _find(bare: Any, head: HeadServer, reply: Any) -> list[Deployment]:
    head.replies[deployments.CONFIG_PATH] = reply
    await bare.set_head.remote(head.config)
    return await find_deployments({"env": ShardSet({"shard": [bare]})})


async def test_a_good_reply_through_a_bare_actor(bare: Any, head: HeadServer) -> None:
    (found,) = await _find(bare, head, yaml.safe_dump(_gym(model=_server(), wild=_server("0.0.0.0", 9))))
    assert found.servers == (("model", "http://127.0.0.1:8001"), ("wild", "http://127.0.0.1:9"))
    # a mapping reply (JSON, not a YAML string) is read too; the head address may be a dict
    await bare.set_head.remote({"host": head.config.host, "port": head.config.port})
    head.replies[deployments.CONFIG_PATH] = _gym(m=_server("::1", 7))
    (found,) = await find_deployments({"env": ShardSet({"shard": [bare]})})
    assert found.servers == (("m", "http://[::1]:7"),)


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Response(b"{not json", media_type="application/json"), "did not answer JSON"),
        (Response(b"nope", status_code=500), "answered 500"),
        (3, "global config is a int, not a mapping"),
        ("key: [unclosed", "is not YAML"),
        (yaml.safe_dump(_gym()), "lists no Gym server"),
        (yaml.safe_dump(_gym(m={"responses_api_models": {"a": {}, "b": {}}})), "exactly one implementation"),
        (yaml.safe_dump(_gym(m={"resources_servers": ["x"]})), "exactly one implementation"),
        (yaml.safe_dump(_gym(m=_server(port=70000))), "outside 1..65535"),
        (yaml.safe_dump(_gym(m=_server(port=True))), "no string host and integer port"),
        (yaml.safe_dump(_gym(m=_server(port="80"))), "no string host and integer port"),
        (yaml.safe_dump(_gym(m=_server(host=None))), "no string host and integer port"),
        (yaml.safe_dump(_gym(m=_server(host="evil.example/x"))), "do not make an http URL"),
        (yaml.safe_dump(_gym(m=_server(host="user@evil.example"))), "do not make an http URL"),
        (yaml.safe_dump(_gym(m=_server(host="a b"))), "do not make an http URL"),
        (yaml.safe_dump(_gym(m=_server(host="h:80"))), "do not make an http URL"),
        (yaml.safe_dump(_gym(m=_server(host="-h"))), "do not make an http URL"),
    ],
)
async def test_hostile_replies_name_the_deployment(
    bare: Any, head: HeadServer, reply: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        await _find(bare, head, reply)
    assert "Gym deployment shard/replica-0" in str(caught.value)
    assert "secret-key" not in str(caught.value)


async def test_an_oversized_reply_is_refused(
    bare: Any, head: HeadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deployments, "MAX_CONFIG_BYTES", 1000)
    with pytest.raises(ValueError, match="larger than 1000 bytes"):
        await _find(bare, head, "x" * 2000)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, r"has no head_server_config \(was it spun up\?\)"),
        (HeadServerConfig(host="127.0.0.1", port=0), "outside 1..65535"),
        ({"host": 5, "port": 80}, "no string host and integer port"),
        ("a string", "no string host and integer port"),
    ],
)
async def test_bad_head_addresses_name_the_deployment(bare: Any, config: Any, message: str) -> None:
    await bare.set_head.remote(config)
    with pytest.raises(ValueError, match=message) as caught:
        await find_deployments({"env": ShardSet({"shard": [bare]})})
    assert "Gym deployment shard/replica-0" in str(caught.value)


async def test_an_unreachable_head_server(bare: Any, head: HeadServer) -> None:
    address = head.config
    head.close()
    await bare.set_head.remote(address)
    with pytest.raises(ValueError, match=r"shard/replica-0: cannot read http://127\.0\.0\.1:"):
        await find_deployments({"env": ShardSet({"shard": [bare]})}, timeout_s=5)


# -- names ------------------------------------------------------------------------------------


def test_names_are_sanitised_and_unique() -> None:
    one = Deployment(
        "s/replica-0", "s", 0, "gym-instances/s/replica-0", (("a b", "http://h:1"), ("a_b", "http://h:2"))
    )
    two = Deployment("s/replica-1", "s", 1, "gym-instances/s/replica-1", (("x" * 300, "http://h:3"),))
    entries = cluster_servers([one, two])
    names = [e["name"] for e in entries]
    assert names[0] == "s.r0.a_b"
    assert names[1].startswith("s.r0.a_b-")
    assert len(set(names)) == 3
    assert all(NAME.match(n) and len(n) <= 200 for n in names)
    assert [e["folder"] for e in entries] == [one.folder, one.folder, two.folder]


def test_parse_skips_what_is_not_a_server() -> None:
    document = _gym(
        policy_model=_server(),
        overrides={"responses_api_models": {"vllm_model": {"return_token_id_information": False}}, "b": 1},
        other={"not_a_server_type": {"x": {"host": "h", "port": 1}}},
        scalar=3,
    )
    assert parse_global_config(document, head_host="h", instance_id="s/replica-0") == (
        ("policy_model", "http://127.0.0.1:8001"),
    )
