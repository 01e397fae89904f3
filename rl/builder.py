"""The branch NeMo RL adds to its backend selector: `build_quiesce_environment_checkpoint`, with
the arguments of RL's `build_environment_checkpoint(master_config, *, env_handles, rollout_manager,
dp_client)` (nightly docs), returning a `QuiesceEnvironmentCheckpoint`.

Rules:

- It is synchronous, as RL's selector is, and contacts nothing: the Gym deployments are found
  (`quiesce.rl.deployments.find_deployments`, through Ray) when the backend is first used, on the
  loop that uses it.
- quiesce's settings are `master_config["quiesce"]`: any cluster-config key but `servers` (the
  servers are RL's deployments) — `ledger`, `snapshots`, `deadline_s`, `token_env`, ... — plus
  `plane` (`v2`, Gym's unified plane, by default; `v1` for the first RL integration's servers).
  Relative paths resolve against the working directory. An unknown key is a `ConfigError` when the
  backend starts, naming it.
- `rollout_manager` and `dp_client` are accepted for the selector's signature; quiesce reads
  neither. RL's view of the episodes in flight reaches the snapshot's cut check through
  `expected` (a function of the cut), which RL's branch passes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from quiesce.coordinator import ClusterConfig, parse_config
from quiesce.coordinator.errors import ConfigError
from quiesce.rl.backend import Expected, QuiesceEnvironmentCheckpoint, Scope
from quiesce.rl.deployments import cluster_servers, find_deployments

__all__ = ["SETTINGS_KEY", "build_quiesce_environment_checkpoint", "rl_cluster_config"]

#: The key of quiesce's settings in RL's master config.
SETTINGS_KEY = "quiesce"


def _settings(master_config: Any) -> tuple[dict[str, Any], Literal["v1", "v2"]]:
    raw = master_config.get(SETTINGS_KEY) if isinstance(master_config, Mapping) else None
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"master_config[{SETTINGS_KEY!r}] must be a mapping of quiesce's settings")
    settings = dict(raw)
    if "servers" in settings:
        raise ConfigError(
            f"master_config[{SETTINGS_KEY!r}] names servers; quiesce finds them from RL's Gym deployments,"
            " remove the key"
        )
    plane = settings.pop("plane", "v2")
    if plane not in ("v1", "v2"):
        raise ConfigError(f"master_config[{SETTINGS_KEY!r}].plane must be 'v1' or 'v2', not {plane!r}")
    return settings, plane


def rl_cluster_config(
    master_config: Any, *, env_handles: Mapping[str, Any]
) -> Callable[[], Awaitable[ClusterConfig]]:
    """The cluster config of RL's run, made when first awaited (its deployments found through
    Ray then): `master_config["quiesce"]`'s settings plus a server entry for every server of every
    Gym deployment in `env_handles`. Settings errors are raised here. Picklable (Ray's
    cloudpickle) when `env_handles` is, so a host actor can be given it."""
    settings, plane = _settings(master_config)

    async def config() -> ClusterConfig:
        deployments = await find_deployments(env_handles)
        document = {**settings, "servers": cluster_servers(deployments, plane=plane)}
        return parse_config(document, base_dir=Path.cwd())

    return config


def build_quiesce_environment_checkpoint(
    master_config: Any,
    *,
    env_handles: Mapping[str, Any],
    rollout_manager: Any = None,
    dp_client: Any = None,
    expected: Expected | None = None,
    scope: Scope | None = None,
    token: str | None = None,
) -> QuiesceEnvironmentCheckpoint:
    """quiesce's `EnvironmentCheckpoint` for RL's run (module docstring). Settings errors are
    raised here; the deployments are found on first use."""
    settings, _ = _settings(master_config)
    deadline = settings.get("deadline_s")
    return QuiesceEnvironmentCheckpoint(
        rl_cluster_config(master_config, env_handles=env_handles),
        token=token,
        deadline_s=float(deadline) if isinstance(deadline, int | float) else None,
        scope=scope,
        expected=expected,
    )
