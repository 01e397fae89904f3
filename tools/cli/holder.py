"""The way that works when a command could not open a ledger as its writer.

When a command fails with the ledger's "already has a writer" (`FencedError`), `name_the_service`
asks `quiesce.coordinator.lease.ledger_writer` whether the writer is a running `quiesce serve`
(PostgreSQL: its live lease; SQLite: the process holding the writer lock) and, if so, adds to the
message the same command through it: `quiesce resume --service http://127.0.0.1:8470 ID`.

- A writer that is known and is no service leaves the message as it was.
- When nothing can be known, the message says a `quiesce serve` may hold it and to rerun with
  `--service URL`.
- A command without `--service` (`recover`, `db upgrade`) is told what works instead.

Best effort and read-only: nothing here may fail the command again.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
from collections.abc import Sequence

import anyio

from quiesce.coordinator.errors import FencedError
from quiesce.coordinator.lease import LedgerWriter, ledger_writer

__all__ = ["name_the_service", "rerun_with_service"]

_MARK = "already has a writer"


def name_the_service(error: FencedError, args: argparse.Namespace, argv: Sequence[str]) -> FencedError:
    """`error` with the way through the service added when its writer is (or may be) a service."""
    if _MARK not in str(error):
        return error
    holder: LedgerWriter | None = None
    with contextlib.suppress(Exception):  # a lookup that fails: the holder stays unknown
        holder = anyio.run(_writer, args)
    holder = holder or LedgerWriter(None)
    if holder.service is False:
        return error
    command = str(getattr(args, "command", "") or "")
    url = holder.address
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


async def _writer(args: argparse.Namespace) -> LedgerWriter | None:
    url = _ledger_url(args)
    if url is None:
        return None
    if not url.startswith("postgresql"):
        return await ledger_writer(url)
    from quiesce.ledger import Ledger

    async with Ledger.open(url, readonly=True) as reader:
        return await ledger_writer(url, reader)
