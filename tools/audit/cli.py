"""What the audit commands share beyond their flags (`tools/cli/flags.py`): the ledger-wide check."""

from __future__ import annotations

from tools.audit.check import CheckReport, ProtocolChecker
from tools.audit.source import open_readonly


async def check_ledger(url: str) -> CheckReport:
    """The protocol check over every event of the ledger at `url`, streamed (read-only)."""
    checker = ProtocolChecker()
    async with open_readonly(url) as ledger:
        async for event in ledger.read():
            checker.feed(event)
    return checker.finish()
