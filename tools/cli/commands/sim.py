"""`quiesce sim [--spec FILE | --plane v1|v2] [--config-out PATH] [--json]` — a local reference Gym
cluster to try quiesce on.

Runs the reference servers (`tools/gymsim/launcher.py`) until Ctrl-C or SIGTERM; the config it
writes exists exactly while they run (written once every server accepts connections, removed
when they stop), so a script can wait for the file. The help speaks to users: what it starts,
where the config goes, which token to set and what to run next. `--ledger` takes a file path or a
URL, as everywhere.

`sim` owns the folder of the SQLite ledger the config names (relative to the config, as the
config is read) and creates it; every other command refuses a ledger whose folder does not exist.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from quiesce.coordinator.protocol import TOKEN_ENV, TOKEN_ENV_FALLBACK
from quiesce.ledger.urls import plain_sqlite_path
from quiesce.tools.cli.flags import UsageError, ledger_url
from quiesce.tools.gymsim import launcher

DESCRIPTION = f"""\
Start a local reference NeMo Gym cluster that speaks the checkpoint control plane v1 — by default
a policy model, a judge, two agents and a resources server on loopback ports — and write a cluster
config for it to {launcher.DEFAULT_CONFIG_OUT} (--config-out). The config appears once every
server accepts connections and is removed when the cluster stops (Ctrl-C or SIGTERM), so its
presence means "ready". With --plane v2 the servers speak NeMo Gym's unified checkpoint plane
(/ng-control/v1/checkpoint/*) instead: an environment, a policy model, an agent and a resources server.

Set the control token first, in this shell and in the one you run quiesce from:
  export {TOKEN_ENV}=<a secret>     (or {TOKEN_ENV_FALLBACK})
It is never printed or written; without it every control request is refused (401).
"""

EPILOG = f"""\
then, in another shell:
  quiesce discover   --config {launcher.DEFAULT_CONFIG_OUT}
  quiesce checkpoint --config {launcher.DEFAULT_CONFIG_OUT}
  quiesce restore    --config {launcher.DEFAULT_CONFIG_OUT} --resume
"""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="start a local reference Gym cluster and write its config",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launcher.add_arguments(parser)
    parser.set_defaults(handler=handle)


def _make_ledger_folder(args: argparse.Namespace) -> None:
    """Create the folder of the SQLite ledger the written config will name (if it is a plain path)."""
    url = args.ledger
    if url is None:
        with contextlib.suppress(Exception):  # a bad spec is reported by launcher.run
            url = launcher.build_spec(args).ledger
    path = plain_sqlite_path(url) if url else None
    if path is None:
        return
    ledger = Path(path)
    if not ledger.is_absolute():
        ledger = Path(args.config_out).resolve().parent / ledger
    ledger.parent.mkdir(parents=True, exist_ok=True)


def handle(args: argparse.Namespace) -> int:
    if args.ledger is not None:
        try:
            args.ledger = ledger_url(args.ledger, must_exist=False)  # a file path, as everywhere
        except argparse.ArgumentTypeError as error:
            raise UsageError(f"--ledger: {error}") from None
    _make_ledger_folder(args)
    return launcher.run(args)
