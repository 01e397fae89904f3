"""Who holds a ledger's writer: the active coordinator's lease (PostgreSQL standby takeover), and
the `quiesce serve` behind a ledger someone else holds.

- `keep_lease(ledger, interval_s)` runs as a background task of `Coordinator.open` for as long as
  the coordinator is open. Every `interval_s` (a third of `lease_s`) it renews the lease through
  `Ledger.renew_lease`. When a renewal finds that another coordinator took the lease (this one was
  stopped or too slow for longer than `lease_s`), the ledger fences itself and the task ends: every
  later append raises `FencedError`, so no further control call can be sent (calls are recorded
  before they are sent). A database error is retried at the next tick; if it lasts longer than the
  lease, a standby takes over, and the next renewal reports it.
- `LeaseGuard`: the operations the coordinator runs, stopped together when that renewal finds the
  lease lost — a call still waiting on its reply is not waited for up to its deadline.
- The lease row's holder names the process (`host/pid/uuid`) and, for a coordinator that serves
  (`quiesce serve`), the address it serves at after one space: `holder_text` writes it and
  `advertised_address` reads it back, so a standby can send callers to the active one.
- `ledger_writer(url, reader)` tells whether a running `quiesce serve` holds the ledger, and where
  it serves: PostgreSQL, from the live lease; SQLite (no lease), from the process that holds the
  writer lock (`/proc/locks`): its command line (`quiesce serve`, its `--advertise`), else the one
  socket it listens on. Best effort and read-only: every lookup that fails means "unknown".
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread

from quiesce.coordinator.errors import LedgerError, QuiesceError
from quiesce.ledger import FencedError, Ledger

__all__ = [
    "LeaseGuard",
    "LedgerWriter",
    "advertised_address",
    "holder_text",
    "keep_lease",
    "ledger_writer",
    "sqlite_writer",
]

#: The literal a command line shows for a service whose address cannot be told.
UNKNOWN_ADDRESS: Final = "URL"
#: `quiesce` options that take a value as the next word (skipped when finding the command name).
_VALUE_OPTIONS: Final = frozenset({"--config", "--ledger", "--service", "-o", "--output"})
#: TCP state LISTEN in `/proc/net/tcp`.
_LISTEN_STATE: Final = "0A"


async def keep_lease(ledger: Ledger, interval_s: float) -> None:
    """Renew `ledger`'s lease every `interval_s` until cancelled or until the lease is lost."""
    while True:
        await anyio.sleep(interval_s)
        try:
            if not await ledger.renew_lease():
                return
        except LedgerError:
            continue


class LeaseGuard:
    """The operations a coordinator runs, stopped together the moment its lease is found lost.

    Rule: once `lost()` is called, every operation running under `guard()` is cancelled at its
    next await (a control call waiting on its reply included), and one that starts later is
    cancelled before its first await. Nothing it did after the loss is recorded — the ledger is
    fenced and refuses every append — and the coordinator that took the lease recovers whatever
    these operations left, so stopping them at once loses nothing; waiting would only hold
    connections and servers' attention up to the attempt's deadline. The caller of `guard()` turns
    the cancellation into `error`.
    """

    def __init__(self) -> None:
        self._scopes: set[anyio.CancelScope] = set()
        #: why the steps were stopped (the ledger's own error), once they were
        self.error: FencedError | None = None

    @property
    def is_lost(self) -> bool:
        return self.error is not None

    @contextlib.contextmanager
    def guard(self) -> Iterator[anyio.CancelScope]:
        """Run the block as an operation that the lease's loss cancels (the scope is yielded: its
        `cancelled_caught` tells that it was)."""
        scope = anyio.CancelScope()
        if self.is_lost:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)

    def lost(self, error: FencedError) -> None:
        """The lease was found taken (`error`, the ledger's): cancel every guarded operation, now
        and from now on."""
        self.error = error
        for scope in list(self._scopes):
            scope.cancel()


def holder_text(identity: dict[str, object], advertise: str | None = None) -> str:
    """The lease holder of the coordinator `identity` (host, pid, uuid), with the address it
    serves at, if any (no spaces allowed in it: the first space separates it)."""
    base = f"{identity['host']}/{identity['pid']}/{identity['uuid']}"
    return f"{base} {advertise}" if advertise else base


def advertised_address(holder: str) -> str | None:
    """The address a lease holder serves at (`holder_text`), or None when it serves none."""
    _, _, address = holder.partition(" ")
    return address or None


@dataclass(frozen=True)
class LedgerWriter:
    """What is known of the process that holds a ledger's writer: `service` True (a `quiesce
    serve`), False (another process: a trainer, a CLI command), None (unknown); `address` where the
    service serves, when known; `pid` (SQLite) when known."""

    service: bool | None
    address: str | None = None
    pid: str | None = None

    @property
    def via(self) -> str | None:
        """Where commands must go instead of opening the ledger: the service's address (`URL` when
        it is a service whose address cannot be told), or None when no service holds the ledger."""
        return (self.address or UNKNOWN_ADDRESS) if self.service else None


async def ledger_writer(url: str, reader: Ledger | None = None) -> LedgerWriter | None:
    """Who holds the writer of the ledger at `url` now (None: nobody, as far as can be told).

    PostgreSQL: the live lease (read through `reader`, an open ledger of `url`): a service when its
    holder advertises an address. SQLite: `sqlite_writer` of the ledger file. Never raises."""
    try:
        if url.startswith("postgresql"):
            if reader is None:
                return None
            lease = await reader.read_lease()
            if lease is None or lease.remaining_s <= 0:
                return None
            address = advertised_address(lease.holder)
            return LedgerWriter(address is not None, address)
        path = _sqlite_path(url)
        return await anyio.to_thread.run_sync(sqlite_writer, path) if path is not None else None
    except (QuiesceError, OSError, ValueError):
        return None


def _sqlite_path(url: str) -> Path | None:
    from quiesce.ledger.urls import parse, plain_sqlite_path

    path = plain_sqlite_path(url)
    if path is None:
        path = parse(url)[1].database
    return Path(path) if path else None


def sqlite_writer(path: Path) -> LedgerWriter | None:
    """The process holding the writer lock of the SQLite ledger file at `path` (Linux `/proc`), None
    when none does (or `/proc/locks` cannot tell)."""
    from quiesce.ledger.sqlitefile import lock_holder, resolve

    pid = lock_holder(resolve(path).stat())
    if pid is None:
        return None
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return LedgerWriter(None, pid=pid)
    if not _is_serve(words):
        return LedgerWriter(False, pid=pid)
    return LedgerWriter(True, _advertised(words) or _listening(pid), pid)


def _is_serve(words: list[str]) -> bool:
    """Whether a command line runs `quiesce serve` (the script, or `python -m quiesce`)."""
    for i, word in enumerate(words):
        if os.path.basename(word) == "quiesce" or word in ("quiesce.__main__", "quiesce.tools.cli.main"):
            skip = False
            for rest in words[i + 1 :]:
                if skip:
                    skip = False
                elif rest.startswith("-"):
                    skip = rest in _VALUE_OPTIONS
                elif rest:
                    return rest == "serve"
            return False
    return False


def _advertised(words: list[str]) -> str | None:
    for i, word in enumerate(words):
        if word == "--advertise" and i + 1 < len(words):
            return words[i + 1].rstrip("/") or None
        if word.startswith("--advertise="):
            return word.split("=", 1)[1].rstrip("/") or None
    return None


def _listening(pid: str) -> str | None:
    """`http://HOST:PORT` of the one TCP socket process `pid` listens on, else None."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[3] == _LISTEN_STATE and parts[9] in inodes:
                    found.add(_address(parts[1]))
    return f"http://{found.pop()}" if len(found) == 1 else None


def _address(hex_address: str) -> str:
    """`HOST:PORT` of a `/proc/net/tcp[6]` local address; a wildcard address as loopback."""
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, host order
    ip = ipaddress.ip_address(packed)
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    host = str(ip) if ip.version == 4 else f"[{ip}]"
    return f"{host}:{int(port_hex, 16)}"
