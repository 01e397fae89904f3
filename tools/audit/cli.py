"""What the audit commands share beyond their flags (`tools/cli/flags.py`): the ledger-wide check."""

from __future__ import annotations

from quiesce.ledger import event_from_raw
from quiesce.ledger.chain import ChainCheck
from quiesce.tools.audit.check import ChainVerdict, CheckReport, ProtocolChecker
from quiesce.tools.audit.source import open_readonly


async def check_ledger(url: str) -> CheckReport:
    """The protocol check over every event of the ledger at `url`, streamed (read-only), and in
    the same pass the whole hash chain (`quiesce.ledger.chain.ChainCheck`): every row's hash recomputed
    from its content, every link, no seq missing — at the end too."""
    checker = ProtocolChecker()
    chain = ChainCheck()
    async with open_readonly(url) as ledger:
        async for page in ledger.read_pages():
            chain.feed(page)
            for row in page:
                checker.feed(event_from_raw(row))
        problem = chain.finish(await ledger.recorded_last_seq())
    report = checker.finish()
    report.chain = ChainVerdict(
        "chain", problem is None, problem[0] if problem else None, problem[1] if problem else None, chain.rows
    )
    return report
