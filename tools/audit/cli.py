"""Pieces the audit commands share: the `--ledger` / `--json` arguments and the ledger-wide check."""

from __future__ import annotations

import argparse

from tools.audit.check import CheckReport, ProtocolChecker
from tools.audit.source import open_readonly


def add_ledger_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ledger",
        metavar="URL",
        required=True,
        help="ledger database URL (sqlite+aiosqlite:///PATH or postgresql+asyncpg://...); opened read-only",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


async def check_ledger(url: str) -> CheckReport:
    """The protocol check over every event of the ledger at `url`, streamed (read-only)."""
    checker = ProtocolChecker()
    async with open_readonly(url) as ledger:
        async for event in ledger.read():
            checker.feed(event)
    return checker.finish()
