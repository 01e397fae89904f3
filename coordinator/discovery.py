"""Discovery: the capabilities of every configured server → participants, skipped, refused, warnings.

Rules (Gym's control plane v1, the coordinator's side), applied by the pure function `classify`:
- skipped (recorded with the reason, never called again): auxiliary models, stateless agents and
  stateless resources servers, and any server whose `checkpoint_mode` is `restart_only` (it can
  pause and resume but not export its state: it comes back empty after a restart, so it takes
  part in no phase — a `restart_only` policy model still counts as the cluster's policy model,
  so the setup is never refused for it);
- a policy model whose `checkpoint_mode` is `stateless` is *drain-only*: a participant that is
  paused, drained and resumed, but takes no part in commit or restore (`Member.exports`);
- refused — the whole setup fails with a `DiscoveryError` listing every offender: a server that
  cannot be reached or whose capabilities do not validate (one without a capabilities route that
  answers Gym's control plane v2 status instead is named as such), `schema_version` ≠ 1, `unmanaged`
  multiple workers, a name differing from the configured one (unless the server has a `folder`),
  a model with no instance role (unless the config gives one), a config `instance_role`
  contradicting the server's own or set on a non-model, no policy model at all, a policy model
  that cannot reach `paused`;
- folders (v1 too): a v1 server writes under the name it reports (`Member.gym_name`), in its
  `folder` of the snapshot. With a folder it may report another name than the config's (replicas
  of one Gym config report the same names); two participants that would write the same files —
  same folder, component and reported name — are refused, naming both. The servers of one folder
  are one Gym deployment: an exporting agent needs a policy model in its folder (the model's
  commit takes the indexes of its own folder's agents only);
- warning: more than one model of one folder claims the policy role (they are all paused, as one
  role group), naming them and the config key that fixes it (`instance_role: auxiliary`).

Each server's plane is found per server: its v1 capabilities; or — when that route answers 404 —
the unified plane's status (`GET /ng-control/v1/checkpoint/status`, with the token); a server
answering 404 to both is not a participant (refused, naming both routes and what to do). A
cluster whose servers speak different planes is refused as a whole, naming each server's plane
(`mixed_planes`). On the unified plane every server that answers its status takes part, as its
`kind` (`classify_v2`); its role group is its stage.

`discover` fetches capabilities through `Caller` (so each GET is in the ledger), classifies, and
appends `discovery.completed` — refusals included, each participant's plane recorded — before
raising or returning.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from quiesce.coordinator.calls import Caller, CallResult, Target
from quiesce.coordinator.config import ClusterConfig
from quiesce.coordinator.errors import DiscoveryError
from quiesce.coordinator.phases import V2_ROLE_OF_KIND, Plane, Role, role_of
from quiesce.coordinator.protocol import MODEL, RESOURCES, SCHEMA_VERSION, Capabilities, manifest_path
from quiesce.coordinator.protocol_v2 import StatusReply
from quiesce.ledger import Ledger

__all__ = ["CLUSTER", "Discovery", "Member", "classify", "classify_v2", "discover", "mixed_planes"]

#: The name used for refusals that concern the cluster as a whole (e.g. no policy model).
CLUSTER = "(cluster)"


@dataclass(frozen=True)
class Member:
    """A participating server: identity, what it is, and its role group."""

    name: str
    component: str
    checkpoint_mode: str
    instance_role: str | None
    role: Role
    url: str
    features: tuple[str, ...] = ()
    #: the control plane it speaks (`v2`: Gym's unified plane; `component` is then its kind)
    plane: Plane = "v1"
    #: where it writes and restores inside a snapshot, relative ("": the snapshot itself)
    folder: str = ""
    #: v1: the name the server reports in its capabilities, under which it writes its files
    #: (`model-ledger/<it>/`, ...) in its folder; "" when it is `name` (always, without a folder)
    reported_name: str = ""

    @property
    def target(self) -> Target:
        return Target(self.name, self.component, self.url)

    @property
    def gym_name(self) -> str:
        """The name the Gym server goes by (v1): what it reports and writes its files under."""
        return self.reported_name or self.name

    @property
    def exports(self) -> bool:
        """Takes part in commit and restore (`export_restore`); a drain-only policy model does not."""
        return self.checkpoint_mode == "export_restore"


@dataclass(frozen=True)
class Discovery:
    """The result of discovery. `participants` keep the config's order."""

    participants: tuple[Member, ...]
    skipped: tuple[tuple[str, str], ...]
    refused: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]
    #: the capability `features` of every server whose capabilities validated (skipped ones too)
    features: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: what each server answered (or why it could not be read), fence state included, as of discovery
    found: Mapping[str, Capabilities | str] = field(default_factory=dict, compare=False, repr=False)
    #: unified plane: each participant's status as of discovery (phase, active id, lease, report)
    statuses: Mapping[str, StatusReply] = field(default_factory=dict, compare=False, repr=False)

    @property
    def plane(self) -> Plane:
        """The control plane the participants speak (one per cluster: discovery refuses a mix)."""
        return "v2" if any(m.plane == "v2" for m in self.participants) else "v1"

    def group(self, role: Role) -> tuple[Member, ...]:
        """The participants of one role group, in config order."""
        return tuple(m for m in self.participants if m.role == role)

    @property
    def restart_only_resources(self) -> tuple[str, ...]:
        """The resources servers that answered `checkpoint_mode: restart_only` (config order, each
        name once): they come back empty after a restore, so no saved turn that depends on one can
        continue. Named as they report themselves — as an agent's `resource_state_revisions` names
        them; their config names unless they have a `folder`."""
        return tuple(
            dict.fromkeys(
                caps.name
                for caps in self.found.values()
                if isinstance(caps, Capabilities)
                and caps.component == RESOURCES
                and caps.checkpoint_mode == "restart_only"
            )
        )

    @property
    def exporters(self) -> tuple[Member, ...]:
        """The participants that take part in commit and restore (not a drain-only policy model)."""
        return tuple(m for m in self.participants if m.exports)

    def member(self, name: str) -> Member | None:
        return next((m for m in self.participants if m.name == name), None)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.participants]

    def payload(self) -> dict[str, Any]:
        """The `discovery.completed` payload."""
        return {
            "participants": [
                {
                    "name": m.name,
                    "component": m.component,
                    "mode": m.checkpoint_mode,
                    "role": m.role,
                    "url": m.url,
                    **({"plane": m.plane} if m.plane != "v1" else {}),
                    **({"features": list(m.features)} if m.features else {}),
                    **({"folder": m.folder} if m.folder else {}),
                    **({"reported_name": m.reported_name} if m.reported_name else {}),
                }
                for m in self.participants
            ],
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "refused": [{"name": n, "reason": r} for n, r in self.refused],
            "warnings": list(self.warnings),
        }

    def as_json(self) -> dict[str, Any]:
        """The `quiesce discover --json` document."""
        return {
            "participants": [
                {
                    "name": m.name,
                    "component": m.component,
                    "checkpoint_mode": m.checkpoint_mode,
                    "instance_role": m.instance_role,
                    "plane": m.plane,
                    **({"folder": m.folder} if m.folder else {}),
                    **({"reported_name": m.reported_name} if m.reported_name else {}),
                }
                for m in self.participants
            ],
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "refused": [{"name": n, "reason": r} for n, r in self.refused],
            "warnings": list(self.warnings),
        }


async def _speaking_v2(
    caller: Caller, config: ClusterConfig, results: Mapping[str, CallResult], deadline_ts: float
) -> dict[str, StatusReply | str]:
    """The servers without a capabilities route (404), asked for Gym's unified-plane status
    (`GET /ng-control/v1/checkpoint/status`, with the token, concurrently; recorded like every
    call): the status of each that answers one, or why its answer is not one."""
    missing = [s for s in config.servers if results[s.name].error == "http" and results[s.name].status == 404]
    if not missing or not caller.has_token:
        return {}
    found: dict[str, StatusReply | str] = {}

    async def probe(name: str, url: str) -> None:
        result = await caller.v2_status(name, url, deadline_ts=deadline_ts)
        if result.ok and isinstance(result.reply, StatusReply):
            found[name] = result.reply
        elif result.error == "http" and result.status == 404:
            return  # neither plane's route: not a participant (see `discover`)
        elif result.error == "protocol":
            found[name] = f"its unified-plane status reply is invalid: {result.detail}"
        else:
            found[name] = f"its unified-plane status cannot be read: {result.describe()}"

    async with anyio.create_task_group() as tg:
        for server in missing:
            tg.start_soon(probe, server.name, server.url)
    return found


def classify_v2(config: ClusterConfig, found: Mapping[str, StatusReply | str]) -> Discovery:
    """The discovery rules of Gym's unified plane: every server answering its status is a
    participant of its `kind` (Gym's own coordinator takes every one); one that cannot be read is
    refused; at least one `model` participant (the policy model) is required; a config
    `instance_role` has no meaning there (the plane has no auxiliary models: a judge serves no
    checkpoint routes) and is refused. Two servers reporting the same kind and instance may not
    share a folder (`ServerConfig.folder`): Gym stores a participant under
    `gym/<kind>/<instance>/` of its folder, so one would overwrite the other."""
    participants: list[Member] = []
    refused: list[tuple[str, str]] = []
    stored_as: dict[tuple[str, str, str], str] = {}  # (folder, kind, instance) -> first server's name
    for server in config.servers:
        status = found.get(server.name, "was not asked for its status")
        if isinstance(status, str):
            refused.append((server.name, status))
            continue
        if server.instance_role is not None:
            refused.append(
                (
                    server.name,
                    "instance_role is set in the config, but on Gym's unified plane every server that"
                    " answers the checkpoint status takes part; remove it (a judge model serves no"
                    " checkpoint routes)",
                )
            )
            continue
        participants.append(
            Member(
                name=server.name,
                component=status.kind,
                checkpoint_mode="export_restore",
                instance_role="policy" if status.kind == "model" else None,
                role=V2_ROLE_OF_KIND[status.kind],
                url=server.url,
                plane="v2",
                folder=server.folder or "",
            )
        )
        place = (server.folder or "", status.kind, status.instance)
        first = stored_as.setdefault(place, server.name)
        if first != server.name:
            where = f"folder {server.folder!r}" if server.folder else "the snapshot's top folder"
            refused.append(
                (
                    server.name,
                    f"reports kind {status.kind!r} and instance {status.instance!r}, as {first} does, and"
                    f" both would write {where}: give each Gym deployment its own `folder` in the"
                    " config (e.g. gym-instances/<deployment>)",
                )
            )
    if not refused and not any(m.component == "model" for m in participants):
        refused.append(
            (CLUSTER, "no model participant: Gym's unified plane needs the policy model server among them")
        )
    return Discovery(tuple(participants), (), tuple(refused), ())


def mixed_planes(planes: Mapping[str, str]) -> str | None:
    """Why a cluster whose servers speak different control planes is refused (None when one plane)."""
    if len(set(planes.values())) <= 1:
        return None
    named = ", ".join(f"{name} speaks {plane}" for name, plane in planes.items())
    return (
        f"its servers speak different checkpoint control planes ({named}): quiesce coordinates one"
        " plane per cluster, as Gym does. Run every server on the same Gym version, or split them"
        " into one config per plane"
    )


def classify(config: ClusterConfig, found: Mapping[str, Capabilities | str]) -> Discovery:
    """Apply the discovery rules. `found[name]` is the server's capabilities, or why they are missing."""
    participants: list[Member] = []
    skipped: list[tuple[str, str]] = []
    refused: list[tuple[str, str]] = []
    warnings: list[str] = []
    policy: list[str] = []
    restart_only_policy: list[str] = []
    features: dict[str, tuple[str, ...]] = {}

    for server in config.servers:
        caps = found.get(server.name, "was not asked for its capabilities")
        if isinstance(caps, str):
            refused.append((server.name, caps))
            continue
        features[server.name] = tuple(caps.features)
        reasons: list[str] = []
        if caps.schema_version != SCHEMA_VERSION:
            reasons.append(f"speaks control-plane schema_version {caps.schema_version}; quiesce speaks 1")
        if caps.name != server.name and server.folder is None:
            reasons.append(
                f"reports its name as {caps.name!r}; name it {caps.name!r} in the config (servers write"
                " their files under their own name), or give it its Gym deployment's `folder` (then"
                " the config may name it apart from replicas that report the same name)"
            )
        if caps.multi_process.mode == "unmanaged":
            reasons.append(
                f"runs {caps.multi_process.num_workers} unmanaged workers; run it with a single worker or"
                " a worker coordinator"
            )
        role = caps.instance_role
        if server.instance_role is not None:
            if caps.component != MODEL:
                reasons.append(
                    "instance_role is set in the config but applies to model servers only; remove it"
                )
            elif caps.instance_role is not None and caps.instance_role != server.instance_role:
                reasons.append(
                    f"declares instance_role {caps.instance_role!r} but the config says"
                    f" {server.instance_role!r}; the config may only add a role the server does not declare"
                )
            elif caps.instance_role is None:
                role = server.instance_role
        if caps.component == MODEL and role is None:
            reasons.append(
                "is a model server that declares no instance_role; set `instance_role: policy` (or"
                " `auxiliary` for a judge) for it in the config"
            )
        if caps.component == MODEL and role == "policy" and "paused" not in caps.admission_states:
            reasons.append(
                f"is the policy model but cannot reach the paused admission state (admission_states:"
                f" {caps.admission_states})"
            )
        if reasons:
            refused.extend((server.name, reason) for reason in reasons)
            continue
        if caps.checkpoint_mode == "restart_only":
            if caps.component == MODEL and role == "policy":
                restart_only_policy.append(server.name)
            skipped.append(
                (
                    server.name,
                    "checkpoint_mode restart_only: it can pause and resume but cannot export its state"
                    " (it comes back empty after a restart), so it takes part in no phase",
                )
            )
            continue
        group = role_of(caps.component, caps.checkpoint_mode, role)
        if group is None:
            if caps.component == MODEL:
                skipped.append((server.name, "auxiliary model (instance_role: auxiliary): never paused"))
            else:
                kind = "agent" if caps.component.endswith("agents") else "resources server"
                skipped.append(
                    (server.name, f"stateless {kind} (checkpoint_mode: stateless): nothing to save")
                )
            continue
        if group == "policy":
            policy.append(server.name)
        participants.append(
            Member(
                name=server.name,
                component=caps.component,
                checkpoint_mode=caps.checkpoint_mode,
                instance_role=role,
                role=group,
                url=server.url,
                features=tuple(caps.features),
                folder=server.folder or "",
                reported_name=caps.name if caps.name != server.name else "",
            )
        )

    claimed = policy + restart_only_policy + [n for n, _ in refused if _claims_policy(found.get(n))]
    if not claimed:
        refused.append(
            (
                CLUSTER,
                "no policy model: one model server must have instance_role policy (declared by the server,"
                " or `instance_role: policy` in the config)",
            )
        )
    folder_of = {s.name: s.folder or "" for s in config.servers}
    refused.extend(_same_files(participants))
    if claimed:
        refused.extend(_agents_without_policy(participants, {folder_of[n] for n in claimed}))
    by_folder: dict[str, list[str]] = {}
    for name in policy:
        by_folder.setdefault(folder_of[name], []).append(name)
    for folder, names in by_folder.items():
        if len(names) > 1:
            where = f" in folder {folder!r}" if folder else ""
            warnings.append(
                f"more than one model claims the policy role{where}: {', '.join(names)}; all of them will"
                " be paused. If one is a judge or reward model, set `instance_role: auxiliary` for it in"
                " the config"
            )
    return Discovery(tuple(participants), tuple(skipped), tuple(refused), tuple(warnings), features)


def _where(folder: str) -> str:
    return f"folder {folder!r}" if folder else "the snapshot's top folder"


def _same_files(participants: Sequence[Member]) -> list[tuple[str, str]]:
    """v1: every exporting participant that would write the files of an earlier one — same folder,
    component and reported name (`Member.gym_name`: a v1 server writes under the name it reports),
    refused naming that one."""
    refused: list[tuple[str, str]] = []
    first: dict[tuple[str, str, str], str] = {}
    for m in participants:
        if not m.exports:
            continue  # a drain-only model writes nothing
        earlier = first.setdefault((m.folder, m.component, m.gym_name), m.name)
        if earlier != m.name:
            files = manifest_path(m.component, m.gym_name).rsplit("/", 1)[0]
            refused.append(
                (
                    m.name,
                    f"reports its name as {m.gym_name!r}, as {earlier} does, and both would write {files}/"
                    f" in {_where(m.folder)}: give each Gym deployment its own `folder` in the config"
                    " (e.g. gym-instances/<deployment>)",
                )
            )
    return refused


def _agents_without_policy(participants: Sequence[Member], policy_folders: set[str]) -> list[tuple[str, str]]:
    """v1: every agent whose folder holds no policy model — the servers of one folder are one
    deployment, and a model's commit takes the continuation indexes of its own folder's agents
    only, so this agent's rollouts would be saved without their model calls."""
    return [
        (
            m.name,
            f"is an agent in {_where(m.folder)}, which holds no policy model: a model's commit takes"
            " the continuation indexes of the agents of its own folder only (the servers of one folder"
            " are one Gym deployment), so its rollouts would be saved without their model calls —"
            " give its deployment's policy model the same `folder`",
        )
        for m in participants
        if m.role == "agent" and m.folder not in policy_folders
    ]


def _claims_policy(caps: Capabilities | str | None) -> bool:
    return isinstance(caps, Capabilities) and caps.component == MODEL and caps.instance_role == "policy"


async def discover(
    config: ClusterConfig, caller: Caller, ledger: Ledger, *, strict: bool = True
) -> Discovery:
    """Ask every configured server for its capabilities, classify, record `discovery.completed`.

    Raises `DiscoveryError` (after recording) when anything is refused, unless `strict` is False
    (then the caller inspects `refused`). The capabilities GETs run
    concurrently; each is bounded by `control_timeout_s`.
    """
    deadline_ts = time.time() + config.control_timeout_s
    results: dict[str, CallResult] = {}

    async def fetch(name: str, url: str) -> None:
        results[name] = await caller.capabilities(name, url, deadline_ts=deadline_ts)

    async with anyio.create_task_group() as tg:
        for server in config.servers:
            tg.start_soon(fetch, server.name, server.url)
    v2 = await _speaking_v2(caller, config, results, deadline_ts)

    found: dict[str, Capabilities | str] = {}
    planes: dict[str, str] = {}
    for server in config.servers:
        result = results[server.name]
        if result.ok and isinstance(result.reply, Capabilities):
            found[server.name] = result.reply
            planes[server.name] = "v1"
        elif isinstance(v2.get(server.name), StatusReply):
            planes[server.name] = "v2"
        elif server.name in v2:
            found[server.name] = str(v2[server.name])
        elif result.error == "http" and result.status == 404 and not caller.has_token:
            found[server.name] = (
                "has no v1 capabilities route (404); the unified plane's status needs the control"
                " token, which is not set — set it to discover a server of current Gym"
            )
        elif result.error == "http" and result.status == 404:
            found[server.name] = (
                "is not a checkpoint participant: it answers 404 to both control planes' discovery"
                " (`/ng-control/v1/capabilities` and `/ng-control/v1/checkpoint/status`) — remove it"
                " from the config, or enable checkpointing on it"
            )
        elif result.error == "protocol":
            found[server.name] = f"capabilities reply is invalid: {result.detail}"
        else:
            found[server.name] = f"cannot be reached at {server.url}: {result.describe()}"
    mixed = mixed_planes(planes)
    if mixed is not None:
        unread = tuple((n, r) for n, r in found.items() if isinstance(r, str))
        discovery = Discovery((), (), ((CLUSTER, mixed), *unread), (), found=found)
    elif planes and set(planes.values()) == {"v2"}:
        statuses: dict[str, StatusReply | str] = {}
        for server in config.servers:
            got = v2.get(server.name) or found.get(server.name)
            statuses[server.name] = got if isinstance(got, StatusReply | str) else "was not asked"
        read = {n: r for n, r in statuses.items() if isinstance(r, StatusReply)}
        discovery = replace(classify_v2(config, statuses), statuses=read)
    else:
        discovery = replace(classify(config, found), found=found)
    await ledger.append("discovery.completed", data=discovery.payload())
    if discovery.refused and strict:
        lines = [f"{name}: {reason}" for name, reason in discovery.refused]
        raise DiscoveryError(
            "discovery refused the setup:\n  " + "\n  ".join(lines), reasons=list(discovery.refused)
        )
    return discovery
