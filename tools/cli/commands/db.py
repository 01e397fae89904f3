"""`quiesce db upgrade --ledger URL|FILE | --config C` — bring a ledger's schema to the head revision.

It also restores the append-only triggers of the events table if someone dropped them (a writer
refuses such a ledger). Exit 0 when the schema is at head afterwards, 1 when it cannot be (a
schema newer than this quiesce, an unreachable database, another writer holding the ledger).
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from quiesce.ledger import restore_triggers, upgrade_schema
from quiesce.ledger.urls import safe
from quiesce.tools.cli.flags import Commands, add_ledger
from quiesce.tools.cli.output import console, emit_json


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "db", help="ledger database administration", description="Ledger database administration."
    )
    sub = Commands(parser.add_subparsers(dest="db_command", metavar="SUBCOMMAND", required=True))
    upgrade = sub.add_parser(
        "upgrade",
        help="upgrade the ledger schema to the head revision",
        description=(
            "Apply the ledger's alembic migrations up to head. Creates the tables in an empty database "
            "and restores append-only triggers someone dropped. "
            "Takes the ledger's writer lock while it runs, so stop the coordinator first."
        ),
    )
    add_ledger(upgrade, must_exist=False)
    upgrade.set_defaults(handler=handle_upgrade)


def handle_upgrade(args: argparse.Namespace) -> int:
    before, after = anyio.run(upgrade_schema, args.ledger)
    restored = anyio.run(restore_triggers, args.ledger)
    where = safe(args.ledger)
    if args.json:
        emit_json(
            {
                "ledger": where,
                "before": before,
                "after": after,
                "changed": before != after or bool(restored),
                "restored_triggers": restored,
            }
        )
        return 0
    if before == after:
        console.print(f"ledger {where} is already at revision {after}")
    else:
        console.print(f"ledger {where} upgraded: {before or 'empty'} -> {after}")
    if restored:
        console.print(
            f"restored the append-only trigger{'s' if len(restored) > 1 else ''} {', '.join(restored)}"
            " of its events table"
        )
    return 0
