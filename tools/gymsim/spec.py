"""The launcher spec: which reference servers a cluster runs, and how.

YAML (or a dict) of this shape; every field but `servers[].kind/name` is optional:

```yaml
host: 127.0.0.1                 # loopback address to bind
ledger: sqlite+aiosqlite:///quiesce.db   # copied into the written cluster config
snapshots: ./checkpoints
deadline_s: 60
fanout: sequential              # or parallel
servers:
  - {kind: model, name: policy_model, latency_s: 0.01}            # instance_role: policy (default)
  - {kind: model, name: judge, instance_role: auxiliary}
  - {kind: agent, name: simple_agent, policy: policy_model, resources: tools}
  - {kind: agent, name: math_agent, checkpoint_mode: stateless, policy: policy_model}
  - {kind: resources, name: tools, judge: judge}
  - {kind: agent, name: "agent_{i}", count: 256, prefix: true,   # 256 agents on one shared port
     policy: policy_model, resources: "tools_{i}"}
```

Per server: `count` (> 1 expands `{i}` in name/policy/resources/judge, 0-based; a
name without `{i}` gets `_<i>` appended), `prefix` (host under
`http://HOST:PORT/s/<name>` on the one shared port instead of an own port),
`latency_s` (model: per call; resources: per mutation, inside the session lock),
`workers` (> 1 declares `multi_process: unmanaged`, unless `worker_mode` says otherwise),
`worker_mode` (policy models: `coordinator` runs `workers` workers behind the shapes of Gym's
multi-worker admission coordinator), `instance_role` (models:
`policy`, `auxiliary` or null to declare none), `config_instance_role` (written into
the cluster config for this server), `checkpoint_mode` (`export_restore`, `stateless` — a
policy model then is drain-only —, or `restart_only`; an auxiliary model is always
`stateless`), `restore_index` (policy models: `opt_in`, the anchor's restore that returns
`storage_reference_index` only when asked, or `always`, later Gym's, which refuses the flag),
`acknowledgement` (agents: `pair`, the anchor's `{rollout_id, attempt_index}`; later Gym's, which
acknowledges a finished result only by its completion receipt, shown in each status entry of a held
result: `receipt_status`, five fields and no receipt route; `receipt_plain`, the same five fields
and `GET /agent-checkpoint/completion-receipt`; `receipt`, that route and the model-lineage pair —
seven fields, null when the result has no lineage), `generation_cut`
(single-worker policy models: later Gym with a generation-cut backend — a pause cuts the calls in
flight and holds their responses until resume), `discard` (export_restore agents: later Gym's
`POST /agent-checkpoint/discard-restored-continuation` and its features
`discard_restored_continuation_v1`, `agent_resource_dependency_index_v1`),
`policy` / `resources` (agent: server name or URL), `judge` (resources: the model `/verify`
calls), `instance` (both planes; default: the server's name: the name the server reports — v1:
its capabilities `name` — and writes its files under — v1: `model-ledger/<instance>/`, ...;
replicas of one Gym config, as NeMo RL runs them, repeat it), `body_before_auth` (as Gym's own
FastAPI routes: a control request's body or query is validated before its token, so one with
neither gets 422, one with a valid body and no valid token 401), `faults` (see `faults.py`).

Plane v2 (`plane: v2`, NeMo Gym's unified `/ng-control/v1/checkpoint/*`, `tools/gymsim/v2`):
`kind: environment` exists only there (`agent:` names the agent each turn calls); `lease_grace_s`
(default 600) is the lease grace; `checkpoint_mode` picks agents' `export_restore`/`restart_only`
and resources' `exported` (`export_restore`)/`stateless`/`restart_only`; `workers: N` with
`worker_mode: coordinator` makes an environment a multi-worker coordinator; `instance` is the
instance name the server reports in its status and stores under (`gym/<kind>/<instance>/`).
`default_v2_spec()`:
environment, policy_model, agent, resources.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from quiesce.coordinator.protocol import CheckpointMode, InstanceRole, WorkerMode
from quiesce.tools.gymsim.common import ROLLOUT_ID_RE
from quiesce.tools.gymsim.faults import Fault

ServerKind = Literal["environment", "model", "agent", "resources"]
Plane = Literal["v1", "v2"]


class ServerSpec(BaseModel):
    """One server (or `count` alike servers) of a simulated cluster."""

    model_config = ConfigDict(extra="forbid")

    kind: ServerKind
    name: str = Field(min_length=1)
    plane: Plane = "v1"
    instance: str | None = Field(default=None, min_length=1)
    lease_grace_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    agent: str | None = None
    count: int = Field(default=1, ge=1)
    prefix: bool = False
    latency_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    workers: int = Field(default=1, ge=1)
    worker_mode: WorkerMode | None = None
    instance_role: InstanceRole | None = "policy"
    config_instance_role: InstanceRole | None = None
    checkpoint_mode: CheckpointMode = "export_restore"
    restore_index: Literal["opt_in", "always"] = "opt_in"
    acknowledgement: Literal["pair", "receipt_status", "receipt_plain", "receipt"] = "pair"
    generation_cut: bool = False
    discard: bool = False
    policy: str | None = None
    resources: str | None = None
    judge: str | None = None
    body_before_auth: bool = False
    faults: list[Fault] = Field(default_factory=list)

    @property
    def instance_name(self) -> str:
        """The name it reports and stores under: `instance`, else its name."""
        return self.instance if self.instance is not None else self.name

    def expand(self) -> list[ServerSpec]:
        if self.count == 1:
            return [self]
        out = []
        for i in range(self.count):

            def sub(value: str | None, i: int = i) -> str | None:
                return None if value is None else value.replace("{i}", str(i))

            name = self.name.replace("{i}", str(i)) if "{i}" in self.name else f"{self.name}_{i}"
            out.append(
                self.model_copy(
                    update={
                        "name": name,
                        "count": 1,
                        "policy": sub(self.policy),
                        "resources": sub(self.resources),
                        "judge": sub(self.judge),
                        "agent": sub(self.agent),
                        "instance": sub(self.instance),
                    }
                )
            )
        return out


class ClusterSpec(BaseModel):
    """A whole simulated cluster (see the module docstring for the YAML shape)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    ledger: str = "sqlite+aiosqlite:///quiesce.db"
    snapshots: str = "./checkpoints"
    deadline_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    fanout: Literal["sequential", "parallel"] = "sequential"
    servers: list[ServerSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [s.name for s in self.expanded()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate server names: {', '.join(duplicates)}")
        bad = [n for n in names if not ROLLOUT_ID_RE.match(n)]
        if bad:
            raise ValueError(f"server names must match [A-Za-z0-9][A-Za-z0-9._-]*: {', '.join(bad)}")
        instances = [s.instance_name for s in self.expanded()]
        bad = [n for n in instances if not ROLLOUT_ID_RE.match(n)]
        if bad:
            raise ValueError(f"instance names must match [A-Za-z0-9][A-Za-z0-9._-]*: {', '.join(bad)}")
        shared = sorted({n for n in instances if instances.count(n) > 1})
        if shared:
            raise ValueError(f"servers of one cluster share instance names: {', '.join(shared)}")
        known = set(names)
        for server in self.expanded():
            for field_name in ("policy", "resources", "judge", "agent"):
                ref = getattr(server, field_name)
                if ref is not None and not ref.startswith(("http://", "https://")) and ref not in known:
                    raise ValueError(f"server {server.name}: {field_name} {ref!r} names no server")
            if server.kind == "agent" and server.policy is None:
                raise ValueError(f"agent {server.name} needs a policy model (policy: NAME)")
            if server.plane == "v1":
                if server.kind == "environment":
                    raise ValueError(f"server {server.name}: kind environment exists only on plane v2")
                if server.lease_grace_s is not None or server.agent is not None:
                    raise ValueError(f"server {server.name}: lease_grace_s and agent apply to plane v2 only")
            if server.worker_mode == "coordinator" and server.kind != (
                "environment" if server.plane == "v2" else "model"
            ):
                raise ValueError(
                    f"server {server.name}: worker_mode coordinator applies to policy models (v1)"
                    " and environments (v2) only"
                )
        return self

    def expanded(self) -> list[ServerSpec]:
        return [one for server in self.servers for one in server.expand()]

    def with_workers(self, workers: dict[str, int] | int) -> ClusterSpec:
        """A copy where the named servers (or, given an int, every server) declare `workers`."""
        servers = []
        for server in self.expanded():
            n = workers if isinstance(workers, int) else workers.get(server.name)
            servers.append(server if n is None else server.model_copy(update={"workers": n}))
        return self.model_copy(update={"servers": servers})


def default_spec() -> ClusterSpec:
    """The seed's example: policy model, judge, a stateful and a stateless agent, one resources server."""
    return ClusterSpec.model_validate(
        {
            "servers": [
                {"kind": "model", "name": "policy_model"},
                {"kind": "model", "name": "judge", "instance_role": "auxiliary"},
                {"kind": "agent", "name": "simple_agent", "policy": "policy_model", "resources": "tools"},
                {
                    "kind": "agent",
                    "name": "math_agent",
                    "checkpoint_mode": "stateless",
                    "policy": "policy_model",
                },
                {"kind": "resources", "name": "tools", "judge": "judge"},
            ]
        }
    )


def default_v2_spec() -> ClusterSpec:
    """The smallest v2 cluster: an environment whose turns call one agent, which calls the policy
    model and one resources server."""
    return ClusterSpec.model_validate(
        {
            "servers": [
                {"kind": "environment", "plane": "v2", "name": "environment", "agent": "agent"},
                {"kind": "model", "plane": "v2", "name": "policy_model"},
                {
                    "kind": "agent",
                    "plane": "v2",
                    "name": "agent",
                    "policy": "policy_model",
                    "resources": "resources",
                },
                {"kind": "resources", "plane": "v2", "name": "resources"},
            ]
        }
    )


#: The spec fields that name another server of the same cluster (a URL names one outside it).
SERVER_REFS = ("policy", "resources", "judge", "agent")


def replica_spec(base: ClusterSpec, prefix: str) -> ClusterSpec:
    """`base` as one replica of a Gym deployment: every server named `<prefix><name>` (references
    too) and still reporting — and writing its files under — its own name (`instance`), on either
    plane, as the replicas of one Gym config do, which is why each needs its own folder in a
    snapshot."""
    document = base.model_dump(mode="json")
    servers = []
    for server in base.expanded():
        entry = server.model_dump(mode="json")
        if server.prefix:
            raise ValueError(f"{server.name}: a path-prefixed server has no host and port of its own")
        entry["instance"] = server.instance_name
        entry["name"] = prefix + server.name
        for ref in SERVER_REFS:
            value = entry.get(ref)
            if isinstance(value, str) and not value.startswith(("http://", "https://")):
                entry[ref] = prefix + value
        servers.append(entry)
    document["servers"] = servers
    return ClusterSpec.model_validate(document)


SpecLike = ClusterSpec | dict[str, Any] | str | Path | None


def load_spec(spec: SpecLike) -> ClusterSpec:
    """A `ClusterSpec` from a spec, a dict, a YAML file path, or None (the default cluster)."""
    if spec is None:
        return default_spec()
    if isinstance(spec, ClusterSpec):
        return spec
    if isinstance(spec, dict):
        return ClusterSpec.model_validate(spec)
    document = yaml.safe_load(Path(spec).read_text(encoding="utf-8"))
    return ClusterSpec.model_validate(document)
