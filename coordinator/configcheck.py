"""`quiesce config check`: is a cluster config ready for a save — without making one.

Rules kept here:
- **Nothing is recorded and no epoch is taken**: the ledger is opened read-only (or not at all
  when it does not exist yet), and every request to a Gym server is an unrecorded read
  (`calls.peek_capabilities`, `calls.peek_read`), so a check never fences a coordinator at work.
- **Offline checks** (no Gym server contacted): the driver the ledger URL needs is installed; the
  ledger can be opened (a SQLite file's folder exists — quiesce never creates it; an existing
  ledger is at this code's schema); the snapshots folder passes the very preflight a save runs
  (`coordinator/preflight.py`: it may create the folder, as a save would, and writes and removes
  one probe file); the control token is set and can be a bearer token (never shown).
- **Server checks** (`servers=True`): each server answers; its plane — v1 when it serves
  `GET /capabilities`, the unified plane (`/ng-control/v1/checkpoint/*`) when only its token-
  protected status answers; and the token is accepted on an authenticated read: any reply but 401
  means the server let the token through (a v1 status read about an id nobody holds answers 409,
  after the token was checked).
- The outcome's exit code is `status`'s: 0 every check passed; 2 an offline check failed (config,
  install, ledger, snapshots, token: fix the setup); 1 a server check failed.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import anyio

from quiesce.coordinator.calls import CallResult, peek_capabilities, peek_read
from quiesce.coordinator.config import ClusterConfig, ServerConfig, find_token, missing_token
from quiesce.coordinator.errors import QuiesceError, SnapshotError
from quiesce.coordinator.http import HttpClient
from quiesce.coordinator.preflight import preflight
from quiesce.coordinator.protocol import AGENT, MODEL, RESOURCES, Capabilities, route
from quiesce.coordinator.protocol_v2 import STATUS_PATH as V2_STATUS_PATH
from quiesce.ledger.errors import LedgerError, MissingExtra, require_extra
from quiesce.ledger.urls import parse, plain_sqlite_path

__all__ = ["Check", "ConfigReport", "check_config"]

#: The id a token probe names in a v1 status read: valid, and held by nobody (the server answers
#: 409 about it once the token passed, and changes nothing).
PROBE_ID: Final = "quiesce-config-check"
#: Each server's reads (capabilities, then one status read) share this budget.
SERVER_BUDGET_S: Final = 5.0

Scope = Literal["offline", "server"]


@dataclass(frozen=True)
class Check:
    """One check: what was checked (`name`: `ledger`, `snapshots`, a server's name...), whether it
    passed, and what was found or what to do."""

    scope: Scope
    name: str
    ok: bool
    detail: str
    plane: str | None = None
    role: str | None = None
    warnings: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "name": self.name,
            "ok": self.ok,
            "detail": self.detail,
            "plane": self.plane,
            "role": self.role,
            "warnings": list(self.warnings),
        }


@dataclass
class ConfigReport:
    """Every check of one config, offline ones first, servers in config order."""

    checks: list[Check] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if any(not c.ok for c in self.checks if c.scope == "offline"):
            return 2
        return 1 if any(not c.ok for c in self.checks) else 0

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.exit_code == 0, "checks": [c.as_json() for c in self.checks]}


def _found(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _extras(config: ClusterConfig) -> Check:
    """The driver the ledger URL needs; which optional extras this install has."""
    have = [
        extra for extra, module in (("postgres", "asyncpg"), ("serve", "prometheus_client")) if _found(module)
    ]
    installed = f"extras installed: {', '.join(have) or 'none'}"
    if plain_sqlite_path(config.ledger) is None:
        try:
            backend, _ = parse(config.ledger)
        except (LedgerError, ValueError) as error:
            return Check("offline", "install", False, f"the ledger URL cannot be read: {error}")
        if backend == "postgresql":
            try:
                require_extra("asyncpg", extra="postgres", needed_by="the PostgreSQL ledger")
            except MissingExtra as missing:
                return Check("offline", "install", False, str(missing))
    return Check("offline", "install", True, installed)


async def _ledger(config: ClusterConfig) -> Check:
    """The ledger opens read-only at this code's schema, or does not exist yet in a folder that does."""
    from quiesce.ledger import Ledger  # the ledger's database layer: loaded only for this check

    path = plain_sqlite_path(config.ledger)
    if path is not None and not await anyio.Path(path).exists():
        folder = Path(path).parent
        if not await anyio.Path(folder).is_dir():
            return Check(
                "offline",
                "ledger",
                False,
                f"the folder {folder} of the ledger file does not exist; quiesce does not create it:"
                " create it, or change `ledger:` in the config",
            )
        return Check(
            "offline", "ledger", True, f"{path} does not exist yet: the first coordinator creates it"
        )
    try:
        async with Ledger.open(config.ledger, readonly=True) as ledger:
            head = await ledger.head()
    except MissingExtra as missing:
        return Check("offline", "ledger", False, str(missing))
    except QuiesceError as error:
        return Check("offline", "ledger", False, str(error))
    except OSError as error:
        return Check("offline", "ledger", False, f"cannot open the ledger: {error.strerror or error}")
    events = 0 if head is None else head.seq
    return Check("offline", "ledger", True, f"opens at this version's schema; {events} events")


def _snapshots(config: ClusterConfig) -> Check:
    try:
        warnings = preflight(config)
    except SnapshotError as error:
        what = "; ".join(error.differences) or str(error)
        return Check(
            "offline",
            "snapshots",
            False,
            f"a save cannot write into {config.snapshots}: {what} — fix this, or change `snapshots:`",
        )
    return Check(
        "offline",
        "snapshots",
        True,
        f"{config.snapshots}: a save can write and publish there",
        warnings=tuple(warnings),
    )


def _token(config: ClusterConfig) -> tuple[Check, str | None]:
    try:
        token = find_token(config)
    except QuiesceError as error:
        return Check("offline", "token", False, str(error)), None
    if token is None:
        return Check("offline", "token", False, missing_token(config)), None
    return Check("offline", "token", True, "set (not shown)"), token


def _v1_status_read(capabilities: Capabilities) -> tuple[str, dict[str, Any]]:
    """The status GET of a v1 server's role, with every query field its route takes."""
    component = {MODEL: MODEL, AGENT: AGENT, RESOURCES: RESOURCES}[capabilities.component]
    params: dict[str, Any] = {"checkpoint_id": PROBE_ID}
    if component != AGENT:
        params["deadline_ts"] = time.time()
    if component == MODEL:
        params.update(wait_state="paused", timeout_s=0)
    return route(component, "status").full_path, params


def _token_verdict(read: CallResult) -> tuple[bool, str]:
    """Whether a status read shows the token accepted: any reply from the server but 401."""
    if read.status is None:
        return False, f"the authenticated read failed: {read.describe()}"
    if read.status == 401:
        return False, "the server refused the control token (401): the token is not this server's"
    return True, f"the control token is accepted (status read answered {read.status})"


async def _server(client: HttpClient, server: ServerConfig, token: str | None) -> Check:
    deadline = time.time() + SERVER_BUDGET_S
    caps = await peek_capabilities(client, server.name, server.url, token=token, deadline_ts=deadline)
    kind: str | None = None
    if caps.ok and isinstance(caps.reply, Capabilities):
        plane, kind = "v1", caps.reply.component
        path, params = _v1_status_read(caps.reply)
    elif caps.status == 404:
        plane, path, params = "v2", V2_STATUS_PATH, None
    else:
        return Check("server", server.name, False, f"{server.url}: {caps.describe()}")
    if token is None:
        return Check(
            "server", server.name, False, f"{server.url}: answers; no token to check", plane=plane, role=kind
        )
    read = await peek_read(
        client, server.name, server.url, path, token=token, params=params, deadline_ts=deadline
    )
    if plane == "v2":
        if read.status == 404:
            return Check(
                "server",
                server.name,
                False,
                f"{server.url}: serves neither control plane (no /capabilities, no checkpoint status):"
                " not a Gym server with checkpointing, or a wrong URL",
            )
        if read.ok and isinstance(read.body, dict) and read.body.get("kind") is not None:
            kind = str(read.body["kind"])
    accepted, detail = _token_verdict(read)
    return Check("server", server.name, accepted, f"{server.url}: {detail}", plane=plane, role=kind)


async def check_config(config: ClusterConfig, *, servers: bool) -> ConfigReport:
    """Every check of `config` (see the module docstring); servers only when `servers`."""
    report = ConfigReport()
    report.checks.append(_extras(config))
    report.checks.append(await _ledger(config))
    report.checks.append(await anyio.to_thread.run_sync(_snapshots, config))
    token_check, token = _token(config)
    report.checks.append(token_check)
    if servers:
        found: list[Check | None] = [None] * len(config.servers)
        client = HttpClient()
        try:
            async with anyio.create_task_group() as group:
                for index, server in enumerate(config.servers):

                    async def one(index: int = index, server: ServerConfig = server) -> None:
                        found[index] = await _server(client, server, token)

                    group.start_soon(one)
        finally:
            await client.aclose()
        report.checks.extend(c for c in found if c is not None)
        planes = {c.plane for c in report.checks if c.scope == "server" and c.plane is not None}
        if len(planes) > 1:
            report.checks.append(_mixed(report.checks))
    return report


def _mixed(checks: Sequence[Check]) -> Check:
    """A cluster whose servers speak different planes cannot be coordinated as one."""
    named = ", ".join(f"{c.name}: {c.plane}" for c in checks if c.scope == "server" and c.plane)
    return Check(
        "server",
        "planes",
        False,
        f"the servers speak different checkpoint control planes ({named}); one save needs one plane",
    )
