"""The Gym deployments of a NeMo RL run and their servers, found from the driver without changing RL.

RL keeps one Ray actor per Gym deployment. Its `env_handles` (task name → environment) hold them as
a shard set — an object whose `checkpoint_handles` maps instance id `"<shard>/replica-<i>"` to the
actor handle — or as a bare actor handle, which RL treats as shard `nemo_gym`, replica 0. Each actor
keeps its Gym head server's address in `head_server_config` (a `host`/`port` pair); the head server
serves Gym's resolved global config at `GET /global_config_dict_yaml` (a JSON string holding YAML),
where every server is a top-level entry `<name>: {<server type>: {<implementation>: {host, port, ...}}}`.

Invariants:

- Ray is imported only inside `find_deployments`; importing this module needs no Ray.
- The function sent to an actor to read its head address references nothing of quiesce, so the
  actor's process (RL's, without quiesce installed) can run it.
- A `Deployment` lists only servers under one of Gym's server types, each with an `http://host:port`
  URL; a wildcard bind address (`0.0.0.0`, `::`) is replaced by the head server's host.
- Every error names the deployment (its instance id) and never quotes the config's values beyond
  the offending server entry's name (Gym's config also holds keys and tokens).
- `cluster_servers` names are unique and match `^[A-Za-z0-9][A-Za-z0-9._-]*$`; each server of a
  deployment gets that deployment's `folder`, on either plane (replicas of one Gym config report
  the same names, v1 and v2 alike, so each deployment writes into its own folder).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import httpx
import yaml

__all__ = [
    "CONFIG_PATH",
    "DEFAULT_SHARD",
    "SERVER_TYPE_KEYS",
    "Deployment",
    "cluster_servers",
    "find_deployments",
    "parse_global_config",
    "parse_instance_id",
    "quiesce_name",
]

#: Gym's head server route that returns the resolved global config.
CONFIG_PATH = "/global_config_dict_yaml"
#: The shard RL gives a bare actor handle (an unsharded job).
DEFAULT_SHARD = "nemo_gym"
#: Gym's server types: the keys one level below a server's top-level entry.
SERVER_TYPE_KEYS = frozenset(
    {"responses_api_models", "responses_api_agents", "resources_servers", "environment_servers"}
)
#: Gym's own key for the head server's address in the global config (not a server).
HEAD_SERVER_KEY = "head_server"
#: The largest global-config reply read (bytes).
MAX_CONFIG_BYTES = 8 * 1024 * 1024
#: The class name of RL's Gym actor (a bare handle counts as a deployment only if it is one).
ACTOR_CLASS = "NemoGym"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_INSTANCE_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)/replica-(0|[1-9][0-9]{0,5})$")
_MAX_NAME = 200
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")


@dataclass(frozen=True)
class Deployment:
    """One Gym deployment (one RL actor): its instance id, where its servers commit inside a
    snapshot, and its servers as (Gym name, base URL) sorted by name."""

    instance_id: str
    shard: str
    replica: int
    folder: str
    servers: tuple[tuple[str, str], ...]
    #: the head server it was read from (`http://host:port`)
    head_url: str = ""


def parse_instance_id(instance_id: str) -> tuple[str, int]:
    """`"<shard>/replica-<i>"` → (shard, i); ValueError for anything else."""
    match = _INSTANCE_ID.match(instance_id) if isinstance(instance_id, str) else None
    if match is None:
        raise ValueError(
            f"Gym instance id {instance_id!r} is not '<shard>/replica-<i>' (shard a plain name, i a number)"
        )
    return match.group(1), int(match.group(2))


def _folder(shard: str, replica: int) -> str:
    return f"gym-instances/{shard}/replica-{replica}"


def quiesce_name(shard: str, replica: int, gym_name: str) -> str:
    """`<shard>.r<i>.<gym_name>` with every character outside `[A-Za-z0-9._-]` made `_` (and a long
    one shortened with a digest), so it is a valid quiesce server name."""
    raw = f"{shard}.r{replica}.{gym_name}"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", raw)
    if len(name) > _MAX_NAME:
        name = name[: _MAX_NAME - 13] + "-" + hashlib.sha256(raw.encode()).hexdigest()[:12]
    return name


#: A name `quiesce_name` made: `<shard>.r<i>.<gym name>`.
_QUIESCE_NAME: Final = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]*)\.r(0|[1-9][0-9]{0,5})\.(.+)$")


def parse_quiesce_name(name: str) -> tuple[str, int, str] | None:
    """`(shard, replica, gym name)` of a server name `quiesce_name` made; None for any other name."""
    match = _QUIESCE_NAME.match(name)
    return None if match is None else (match.group(1), int(match.group(2)), match.group(3))


def cluster_servers(
    deployments: list[Deployment] | tuple[Deployment, ...], *, plane: Literal["v1", "v2"] = "v2"
) -> list[dict[str, Any]]:
    """quiesce cluster-config server entries for every server of `deployments`, in order:
    `{"name", "url", "folder"}` — the folder its deployment's (`gym-instances/<shard>/replica-<i>`)
    on either plane: a v1 server too writes under the Gym name it reports, which every replica
    repeats. Names are `quiesce_name(...)`, made unique with a digest suffix when two collide.
    `plane` is the plane the servers speak (accepted for the builder; the entries are the same)."""
    entries: list[dict[str, Any]] = []
    used: set[str] = set()
    for deployment in deployments:
        for gym_name, url in deployment.servers:
            base = quiesce_name(deployment.shard, deployment.replica, gym_name)
            name, n = base, 0
            while name in used:
                n += 1
                digest = hashlib.sha256(f"{deployment.instance_id}\0{gym_name}\0{n}".encode()).hexdigest()
                name = f"{base[: _MAX_NAME - 9]}-{digest[:8]}"
            used.add(name)
            entries.append({"name": name, "url": url, "folder": deployment.folder})
    return entries


# -- reading the global config ------------------------------------------------------------------


def _host_for_url(host: str) -> str | None:
    """`host` as a URL's host part (an IPv6 address bracketed); None when it is no IP address and
    no DNS name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host if len(host) <= 253 and _HOSTNAME.match(host) else None
    return f"[{host}]" if address.version == 6 else host


def _http_url(host: Any, port: Any, *, what: str) -> str:
    """`http://host:port` from a config's host and port; ValueError naming `what` when they do not
    make one."""
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
        raise ValueError(f"{what} has no string host and integer port (host={type(host).__name__})")
    if not 0 < port < 65536:
        raise ValueError(f"{what} has port {port}, outside 1..65535")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    in_url = _host_for_url(bare)
    if in_url is None:
        raise ValueError(f"{what}: host {host[:100]!r} and port {port} do not make an http URL")
    url = f"http://{in_url}:{port}"
    try:
        parts = urlsplit(url)
        ok = parts.scheme == "http" and parts.hostname == bare.lower() and parts.port == port
        ok = ok and parts.path == "" and not parts.query and not parts.fragment and not parts.username
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{what}: host {host[:100]!r} and port {port} do not make an http URL")
    return url


def parse_global_config(document: Any, *, head_host: str, instance_id: str) -> tuple[tuple[str, str], ...]:
    """The (Gym name, URL) of every server in a decoded head-server reply, sorted by name.

    `document` is the reply's JSON: a string of YAML (Gym's head server) or a mapping. Top-level
    entries that are not servers (scalars, `head_server`, blocks whose one key is no server type)
    are skipped; one under a server type that does not hold exactly one implementation with a host
    and port is an error, as is a config with no server at all."""
    where = f"Gym deployment {instance_id}"
    if isinstance(document, str):
        try:
            document = yaml.safe_load(document)
        except yaml.YAMLError as error:
            raise ValueError(f"{where}: the head server's global config is not YAML ({error})") from None
    if not isinstance(document, Mapping):
        raise ValueError(
            f"{where}: the head server's global config is a {type(document).__name__}, not a mapping"
        )
    servers: dict[str, str] = {}
    for name, entry in document.items():
        if name == HEAD_SERVER_KEY or not isinstance(entry, Mapping) or len(entry) != 1:
            continue
        ((server_type, implementations),) = entry.items()
        if server_type not in SERVER_TYPE_KEYS:
            continue
        label = f"{where}: server {str(name)[:100]!r} ({server_type})"
        if not isinstance(name, str) or not name:
            raise ValueError(f"{label}: its name is not a non-empty string")
        if not isinstance(implementations, Mapping) or len(implementations) != 1:
            raise ValueError(f"{label} does not hold exactly one implementation")
        ((_, config),) = implementations.items()
        if not isinstance(config, Mapping):
            raise ValueError(f"{label}: its implementation's config is not a mapping")
        host = config.get("host")
        if isinstance(host, str) and host in _WILDCARD_HOSTS:
            host = head_host
        servers[name] = _http_url(host, config.get("port"), what=label)
    if not servers:
        raise ValueError(
            f"{where}: the head server's global config lists no Gym server"
            f" (no top-level entry under {', '.join(sorted(SERVER_TYPE_KEYS))})"
        )
    return tuple(sorted(servers.items()))


async def _read_config(head_url: str, *, instance_id: str, timeout_s: float) -> Any:
    where = f"Gym deployment {instance_id}"
    try:
        async with (
            httpx.AsyncClient(trust_env=False, timeout=timeout_s, follow_redirects=False) as http,
            http.stream("GET", head_url + CONFIG_PATH) as reply,
        ):
            if reply.status_code != 200:
                raise ValueError(f"{where}: GET {head_url}{CONFIG_PATH} answered {reply.status_code}")
            body = bytearray()
            async for chunk in reply.aiter_bytes():
                body += chunk
                if len(body) > MAX_CONFIG_BYTES:
                    raise ValueError(f"{where}: the global config is larger than {MAX_CONFIG_BYTES} bytes")
    except httpx.HTTPError as error:
        raise ValueError(
            f"{where}: cannot read {head_url}{CONFIG_PATH}: {type(error).__name__}: {error}"
        ) from None
    try:
        return json.loads(body)
    except ValueError:
        raise ValueError(f"{where}: {head_url}{CONFIG_PATH} did not answer JSON") from None


# -- finding the actors -------------------------------------------------------------------------


def _actor_key(handle: Any) -> Any:
    hex_of = getattr(getattr(handle, "_actor_id", None), "hex", None)
    return hex_of() if callable(hex_of) else id(handle)


def _actor_class(handle: Any) -> str | None:
    descriptor = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    name = getattr(descriptor, "class_name", None)
    return name if isinstance(name, str) else None


def _checkpoint_handles(value: Any) -> Mapping[str, Any] | None:
    handles = getattr(value, "checkpoint_handles", None)
    if handles is not None and not isinstance(handles, Mapping) and callable(handles):
        handles = handles()
    return handles if isinstance(handles, Mapping) else None


def _gym_actors(env_handles: Mapping[str, Any]) -> dict[str, Any]:
    """instance id → actor handle over every shard set and bare Gym actor in `env_handles` (one
    object under several task names counts once)."""
    from ray.actor import ActorHandle

    if not isinstance(env_handles, Mapping):
        raise ValueError(
            f"env_handles is a {type(env_handles).__name__}, not a mapping of task → environment"
        )
    found: dict[str, Any] = {}
    owner: dict[str, str] = {}
    seen_sets: set[int] = set()
    seen_actors: dict[Any, str] = {}

    def add(instance_id: str, handle: Any, task: str) -> None:
        if not isinstance(handle, ActorHandle):
            raise ValueError(
                f"Gym instance {instance_id} of {task!r} is a {type(handle).__name__}, not a Ray actor handle"
            )
        parse_instance_id(instance_id)
        key = _actor_key(handle)
        if key in seen_actors:
            if seen_actors[key] != instance_id:
                raise ValueError(
                    f"one Gym actor is both instance {seen_actors[key]} and {instance_id} ({task!r})"
                )
            return
        if instance_id in found:
            raise ValueError(f"two Gym actors are instance {instance_id} ({owner[instance_id]!r}, {task!r})")
        seen_actors[key] = instance_id
        found[instance_id] = handle
        owner[instance_id] = task

    for task, value in env_handles.items():
        handles = _checkpoint_handles(value)
        if handles is not None:
            if id(value) in seen_sets:
                continue
            seen_sets.add(id(value))
            for instance_id, handle in handles.items():
                add(instance_id, handle, str(task))
        elif isinstance(value, ActorHandle) and _actor_class(value) == ACTOR_CLASS:
            add(f"{DEFAULT_SHARD}/replica-0", value, str(task))
    if not found:
        kinds = ", ".join(
            f"{task!r}: {_actor_class(v) or type(v).__name__}" for task, v in env_handles.items()
        )
        raise ValueError(
            "no Gym deployment among the environments (a shard set with `checkpoint_handles`, or a"
            f" {ACTOR_CLASS} actor handle); found {{{kinds}}}"
        )
    return found


async def _head_address(instance_id: str, handle: Any, timeout_s: float) -> str:
    where = f"Gym deployment {instance_id}"

    def read_head(actor: Any) -> Any:
        # Runs inside the Gym actor. Defined here (not at module level) so cloudpickle sends it by
        # value: it uses builtins only, and the actor's process needs nothing of quiesce.
        config = getattr(actor, "head_server_config", None)
        if config is None:
            return None
        if isinstance(config, dict):
            return (config.get("host"), config.get("port"))
        return (getattr(config, "host", None), getattr(config, "port", None))

    try:
        address = await asyncio.wait_for(handle.__ray_call__.remote(read_head), timeout_s)
    except TimeoutError:
        raise ValueError(f"{where}: its actor did not report its head server within {timeout_s}s") from None
    except Exception as error:
        raise ValueError(
            f"{where}: reading its head server failed: {type(error).__name__}: {error}"
        ) from None
    if address is None:
        raise ValueError(f"{where}: its actor has no head_server_config (was it spun up?)")
    if not (isinstance(address, tuple) and len(address) == 2):
        raise ValueError(f"{where}: its head_server_config is not a host and port")
    return _http_url(address[0], address[1], what=f"{where}: head server")


async def find_deployments(env_handles: Mapping[str, Any], *, timeout_s: float = 30.0) -> list[Deployment]:
    """Every Gym deployment in RL's `env_handles`, sorted by (shard, replica), with its servers read
    from its head server. ValueError naming the deployment for any reply that does not fit."""
    actors = _gym_actors(env_handles)

    async def one(instance_id: str, handle: Any) -> Deployment:
        shard, replica = parse_instance_id(instance_id)
        head_url = await _head_address(instance_id, handle, timeout_s)
        document = await _read_config(head_url, instance_id=instance_id, timeout_s=timeout_s)
        servers = parse_global_config(
            document, head_host=urlsplit(head_url).hostname or "", instance_id=instance_id
        )
        return Deployment(
            instance_id=instance_id,
            shard=shard,
            replica=replica,
            folder=_folder(shard, replica),
            servers=servers,
            head_url=head_url,
        )

    found = await asyncio.gather(*(one(i, h) for i, h in actors.items()))
    return sorted(found, key=lambda d: (d.shard, d.replica))
