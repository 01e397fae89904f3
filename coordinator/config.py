"""The cluster config: a YAML file validated into `ClusterConfig` before any server is contacted.

Invariants:
- Unknown keys are refused (`extra="forbid"`) at every level; a bad value is a `ConfigError`
  whose message names the file and the field path (e.g. `servers[2].url: ...`).
- Relative paths (`snapshots`, and the file of a `sqlite` ledger URL) are resolved against the
  folder of the config file, so a config means the same thing from any working directory.
- Deadlines are finite, positive and at most `max_deadline_s` (default one day): the config's
  own `deadline_s`, and every `deadline_s` a caller passes (`check_deadline`), so a typo cannot
  pause every server for a week.
- The control token is never in the config: only the *name* of the environment variable that
  holds it (`token_env`, default `NEMO_GYM_CHECKPOINT_CONTROL_TOKEN`, falling back to
  `NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN` when the named variable is unset).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quiesce.coordinator.calls import token_problem
from quiesce.coordinator.errors import ConfigError
from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK, InstanceRole
from quiesce.coordinator.wording import field_path, plain

__all__ = [
    "DEFAULT_LEDGER",
    "MAX_DEADLINE_S",
    "ClusterConfig",
    "ServerConfig",
    "check_deadline",
    "find_token",
    "folder_problem",
    "load_config",
    "missing_token",
    "parse_config",
    "resolve_token",
]

DEFAULT_LEDGER = "sqlite+aiosqlite:///quiesce.db"
#: The default upper bound of an attempt's budget: one day.
MAX_DEADLINE_S = 86_400.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


#: Most components a server's `folder` may have.
MAX_FOLDER_DEPTH = 8


def folder_problem(value: str) -> str | None:
    """Why `value` is not a server folder (None: it is one): a relative path of at most
    `MAX_FOLDER_DEPTH` plain names joined by '/' — no '.', '..', empty or absolute part, so it
    always stays inside the snapshot."""
    parts = value.split("/")
    if 0 < len(value) <= 256 and len(parts) <= MAX_FOLDER_DEPTH and all(_NAME.fullmatch(p) for p in parts):
        return None
    return (
        f"{value!r} is not a relative folder of at most {MAX_FOLDER_DEPTH} plain names joined by '/'"
        " (each starts with a letter or digit and uses only letters, digits, '.', '_', '-'),"
        " e.g. gym-instances/nemo_gym/replica-0"
    )


class ServerConfig(BaseModel):
    """One Gym server: its name (quiesce's, unique in the config), base URL, and optionally its
    role and its folder.

    `folder` (both planes): where inside every snapshot this server writes and restores from — a
    relative path of plain names (`gym-instances/nemo_gym/replica-0`), the snapshot itself when
    unset. The servers of one folder are one Gym deployment; deployments that repeat Gym's names
    (replicas of one Gym config, as NeMo RL runs them) each need their own, since Gym stores a
    participant under a path of its own name inside its folder (v2: `gym/<kind>/<instance>/`; v1:
    `model-ledger/<name>/`, `agent/instance-<sha256(name)>/`, `resources/<name>/`).

    `name`: a v1 server without a folder must report this name in its capabilities; with a folder
    it may report another (the name it writes under), so replicas reporting one name each keep
    their own name here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=256)]
    url: str
    instance_role: InstanceRole | None = None
    folder: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @field_validator("folder")
    @classmethod
    def _folder_ok(cls, value: str | None) -> str | None:
        if value is None:
            return None
        problem = folder_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must start with a letter or digit and use only letters, digits, '.', '_', '-'")
        return value

    @field_validator("url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8001")
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as error:
            raise ValueError(f"{value!r} has an invalid port") from error
        if parts.query or parts.fragment:
            raise ValueError(f"{value!r} must not have a query or fragment")
        return value.rstrip("/")


class ClusterConfig(BaseModel):
    """The whole cluster config. Build with `load_config(path)` or `parse_config(mapping, base_dir)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ledger: Annotated[str, Field(min_length=1)] = DEFAULT_LEDGER
    snapshots: Path = Path("checkpoints")
    deadline_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 60.0
    #: The longest budget an attempt may be given (config or caller); servers stay paused that long.
    max_deadline_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = MAX_DEADLINE_S
    control_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0
    token_env: Annotated[str, Field(min_length=1)] = TOKEN_ENV
    fanout: Literal["sequential", "parallel"] = "sequential"
    keep_latest: Annotated[int, Field(ge=1)] = 3
    durability: Literal["full", "process"] = "full"
    #: How long the coordinator lease lasts without renewal (PostgreSQL standby takeover).
    lease_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 10.0
    servers: Annotated[list[ServerConfig], Field(min_length=1)]

    @field_validator("ledger")
    @classmethod
    def _ledger_ok(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if not (scheme.startswith("sqlite") or scheme.startswith("postgresql")):
            raise ValueError(
                f"{value!r} is not a ledger URL; use sqlite+aiosqlite:///FILE or postgresql+asyncpg://USER@HOST/DB"
            )
        return value

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterConfig:
        seen: dict[str, int] = {}
        for index, server in enumerate(self.servers):
            if server.name in seen:
                raise ValueError(
                    f"servers[{index}].name: {server.name!r} is already used by servers[{seen[server.name]}]"
                )
            seen[server.name] = index
        return self

    @model_validator(mode="after")
    def _deadline_bounded(self) -> ClusterConfig:
        if self.deadline_s > self.max_deadline_s:
            raise ValueError(
                f"deadline_s: {self.deadline_s:g} is more than max_deadline_s ({self.max_deadline_s:g});"
                " lower it, or raise max_deadline_s if servers may really stay paused that long"
            )
        return self

    def server(self, name: str) -> ServerConfig | None:
        """The configured server called `name`, if any."""
        return next((s for s in self.servers if s.name == name), None)

    @property
    def staging_root(self) -> Path:
        """`<snapshots>/.staging`: where attempts stage their checkpoint dirs."""
        return self.snapshots / ".staging"


def check_deadline(config: ClusterConfig, deadline_s: object, *, what: str = "deadline_s") -> float:
    """`deadline_s` (None: the config's) as a finite number of seconds in (0, `max_deadline_s`].

    Anything else raises `ConfigError` naming `what`, the value and the bound — before the attempt
    starts, so nothing has been recorded or called.
    """
    if deadline_s is None:
        return config.deadline_s
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        raise ConfigError(f"{what} must be a number of seconds, not {deadline_s!r}")
    value = float(deadline_s)
    if math.isnan(value) or math.isinf(value):
        raise ConfigError(f"{what} must be a finite number of seconds, not {value}")
    if value <= 0:
        raise ConfigError(f"{what} must be more than 0 seconds, not {value:g}")
    if value > config.max_deadline_s:
        raise ConfigError(
            f"{what} {value:g} is more than max_deadline_s ({config.max_deadline_s:g} s): servers would stay"
            " paused that long if something hangs; pass a shorter budget, or raise max_deadline_s in the"
            " config"
        )
    return value


def _describe(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        message = plain(item["msg"])
        if item["type"] == "extra_forbidden":
            message = "unknown key (not part of the config)"
        if item["type"] == "value_error" and not loc and ": " in message:
            lines.append(message)  # model-level check that names its own field
        else:
            lines.append(f"{field_path(loc) or '(top level)'}: {message}")
    return lines


def _resolve_ledger(url: str, base_dir: Path) -> str:
    """Make the file of a relative SQLite URL relative to `base_dir`. Other URLs are unchanged."""
    if not url.startswith("sqlite"):
        return url
    scheme, _, rest = url.partition(":///")
    if not rest or rest.startswith("/") or rest.startswith(":memory:") or rest.startswith("file:"):
        return url
    path, sep, query = rest.partition("?")
    return f"{scheme}:///{(base_dir / path).resolve()}{sep}{query}"


def parse_config(data: Any, *, base_dir: Path, source: str = "config") -> ClusterConfig:
    """Validate a mapping (already parsed YAML) into a `ClusterConfig`.

    Relative paths resolve against `base_dir`. Raises `ConfigError` naming `source` and every bad field.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the config must be a mapping with at least a 'servers' list")
    try:
        config = ClusterConfig.model_validate(dict(data))
    except ValidationError as error:
        details = _describe(error)
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(details)) from None
    snapshots = config.snapshots if config.snapshots.is_absolute() else base_dir / config.snapshots
    return config.model_copy(
        update={
            "snapshots": snapshots.resolve(),
            "ledger": _resolve_ledger(config.ledger, base_dir),
        }
    )


#: libyaml's safe loader when PyYAML has it: a 512-server config parses in a few ms instead of
#: about 100 ms (bench #6 and #8: part of every command's start-up); the same documents load.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate the YAML config at `path` (relative paths inside resolve against its folder)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{file}: cannot read the config: {error.strerror or error}") from None
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)  # a safe loader (libyaml's when built)
    except yaml.YAMLError as error:
        raise ConfigError(f"{file}: not valid YAML: {error}") from None
    return parse_config(data, base_dir=file.resolve().parent, source=str(file))


def find_token(config: ClusterConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The control token from `config.token_env`, else `NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN`;
    None when neither is set (an empty value counts as unset).

    Raises `ConfigError` (naming the variable, never the value) for a value that cannot be a
    bearer token (`calls.token_problem`).
    """
    env = os.environ if environ is None else environ
    for name in (config.token_env, TOKEN_ENV_FALLBACK):
        value = env.get(name)
        if value:
            problem = token_problem(value)
            if problem is not None:
                raise ConfigError(
                    f"{problem} (from the environment variable {name}); set it to the bearer token alone"
                )
            return value
    return None


def missing_token(config: ClusterConfig) -> str:
    """What to do when there is no control token: the variables to set (never a value)."""
    return (
        f"no control token: set the environment variable {config.token_env}"
        f" (or {TOKEN_ENV_FALLBACK}) to the Gym servers' control-plane bearer token"
    )


def resolve_token(config: ClusterConfig, environ: Mapping[str, str] | None = None) -> str:
    """The control token (`find_token`). Raises `ConfigError` (naming the variables, never a
    value) when neither is set or the value cannot be a bearer token.
    """
    token = find_token(config, environ)
    if token is None:
        raise ConfigError(missing_token(config))
    return token
