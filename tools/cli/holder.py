"""Who holds a ledger a command could not open as its writer, and the way that works instead.

When a command fails with the ledger's "already has a writer" (`FencedError`), `name_the_service`
finds out whether the writer is a running `quiesce serve` and, if so, adds to the message the same
command through it: `quiesce resume --service http://127.0.0.1:8470 ID`.

- PostgreSQL: the live lease's holder carries the address the service advertises
  (`quiesce.coordinator.lease.advertised_address`).
- SQLite: the writer lock's holder is a process of this host (`/proc/locks`); its command line
  says whether it is `quiesce serve` (and its `--advertise`), its listening socket where it serves.
- A holder that is known and is no service leaves the message as it was; when nothing can be
  known, the message says a `quiesce serve` may hold it and to rerun with `--service URL`.

Best effort and read-only: nothing here may fail the command again (every lookup that fails
means "unknown").
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio

from quiesce.coordinator.errors import FencedError, QuiesceError
from quiesce.coordinator.lease import advertised_address

__all__ = ["Holder", "name_the_service", "sqlite_holder"]

_MARK: Final = "already has a writer"
_LISTEN_STATE: Final = "0A"


@dataclass(frozen=True)
class Holder:
    """What is known of a ledger's writer: `service` True/False/None (unknown), its `url` if known."""

    service: bool | None
    url: str | None = None
    pid: str | None = None


def name_the_service(error: FencedError, args: argparse.Namespace, argv: Sequence[str]) -> FencedError:
    """`error` with the way through the service added when its writer is (or may be) a service."""
    if _MARK not in str(error):
        return error
    holder = Holder(None)
    with contextlib.suppress(Exception):  # a lookup that fails: the holder stays unknown
        holder = _find(args)
    if holder.service is False:
        return error
    command = str(getattr(args, "command", "") or "")
    url = holder.url
    rerun = rerun_with_service(argv, command, url or "URL") if "service" in args else None
    if rerun is not None:
        how = f"rerun through it: {rerun}" if url else f"rerun with --service URL (its address): {rerun}"
    elif command == "recover":
        at = url or "URL"
        how = (
            "a service recovers what was left when it takes the ledger; see what holds the servers with"
            f" `quiesce status --service {at}`, free them with `quiesce resume --service {at}`"
        )
    else:
        how = "stop it first"
    if holder.service is None:
        who = "A `quiesce serve` may hold it"
    elif url is None:
        who = "It is a `quiesce serve`" + (f" (process {holder.pid})" if holder.pid else "")
    else:
        who = f"It is the `quiesce serve` at {url}"
    told = f"{error}. {who}: {how}"
    fenced = FencedError(told)
    fenced.service = url  # type: ignore[attr-defined]  # the --json error's `service`
    fenced.command = rerun  # type: ignore[attr-defined]  # ... and its `command`
    return fenced


def rerun_with_service(argv: Sequence[str], command: str, url: str) -> str:
    """`argv` as `quiesce ... COMMAND --service URL ...`: `--config FILE` dropped (the service has
    its own), everything else kept."""
    words = list(argv)
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word == "--config":
            skip = True
            continue
        if word.startswith("--config="):
            continue
        kept.append(word)
    at = kept.index(command) + 1 if command in kept else len(kept)
    return shlex.join(["quiesce", *kept[:at], "--service", url, *kept[at:]])


def _ledger_url(args: argparse.Namespace) -> str | None:
    url = getattr(args, "ledger", None)
    if isinstance(url, str):
        return url
    config = getattr(args, "config", None)
    if config is None:
        return None
    from quiesce.coordinator.config import load_config

    return load_config(config).ledger


def _find(args: argparse.Namespace) -> Holder:
    url = _ledger_url(args)
    if url is None:
        return Holder(None)
    if url.startswith("postgresql"):
        return anyio.run(_lease_holder, url)
    from quiesce.ledger.urls import plain_sqlite_path

    path = plain_sqlite_path(url)
    if path is None:
        from quiesce.ledger.urls import parse

        path = parse(url)[1].database
    return sqlite_holder(Path(path)) if path else Holder(None)


async def _lease_holder(url: str) -> Holder:
    from quiesce.ledger import Ledger

    try:
        async with Ledger.open(url, readonly=True) as ledger:
            lease = await ledger.read_lease()
    except QuiesceError:
        return Holder(None)
    if lease is None or lease.remaining_s <= 0:
        return Holder(None)
    address = advertised_address(lease.holder)
    return Holder(address is not None, address)


def sqlite_holder(path: Path) -> Holder:
    """The process holding the writer lock of the SQLite ledger at `path` (Linux `/proc`)."""
    from quiesce.ledger.sqlitefile import lock_holder

    pid = lock_holder(path.stat())
    if pid is None:
        return Holder(None)
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return Holder(None, pid=pid)
    if not _is_serve(words):
        return Holder(False, pid=pid)
    return Holder(True, _advertised(words) or _listening(pid), pid)


def _is_serve(words: list[str]) -> bool:
    """Whether a command line is `quiesce serve ...` (the script, or `python -m quiesce[...]`)."""
    for i, word in enumerate(words):
        if os.path.basename(word) == "quiesce" or word in (
            "quiesce",
            "quiesce.tools.cli.main",
            "quiesce.__main__",
        ):
            rest = [w for w in words[i + 1 :] if w and not w.startswith("-")]
            return bool(rest) and rest[0] == "serve"
    return False


def _advertised(words: list[str]) -> str | None:
    for i, word in enumerate(words):
        if word == "--advertise" and i + 1 < len(words):
            return words[i + 1].rstrip("/")
        if word.startswith("--advertise="):
            return word.split("=", 1)[1].rstrip("/")
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
    found: list[str] = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[3] == _LISTEN_STATE and parts[9] in inodes:
                    found.append(_address(parts[1]))
    return f"http://{found[0]}" if len(set(found)) == 1 else None


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
