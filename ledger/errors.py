"""Errors raised by the ledger.

`QuiesceError` is the root of quiesce's one error hierarchy. It lives here, in the
lowest layer, because `ledger` imports nothing of ours; `coordinator/errors.py`
re-exports it with the rest of the hierarchy, and that is where users import from.
Every message says what was wrong and what to do about it.
"""

from __future__ import annotations


class QuiesceError(Exception):
    """Root of every error quiesce raises on purpose."""


class LedgerError(QuiesceError):
    """The ledger cannot be used as asked: bad URL, schema behind or ahead, broken chain, refused kind."""


class LedgerUrlError(LedgerError):
    """The ledger URL itself cannot be used: not a URL, an unsupported database, options quiesce
    would ignore, a character no file name holds. A setup error: nothing was opened."""


class FencedError(LedgerError):
    """Another writer owns the ledger (a newer epoch, or a concurrent append took our seq).

    A coordinator that sees this must stop acting: it makes no further calls and no further appends.
    """


class BrokenChainError(LedgerError):
    """The stored hash chain does not verify at ``seq``: rows were edited, removed or reordered.

    A writer refuses to append to such a ledger (it would chain new rows onto rows it cannot
    trust); the message names the command that shows where the chain breaks.
    """

    def __init__(self, message: str, seq: int) -> None:
        super().__init__(message)
        self.seq = seq


class MissingExtra(QuiesceError):
    """An optional dependency is not installed. Raised where the code that needs it is reached
    (never at import time of anything a base install runs); the message names the extra to install.
    """

    def __init__(self, *, extra: str, module: str, needed_by: str) -> None:
        super().__init__(
            f"{needed_by} needs the {extra!r} extra ({module} is not installed): "
            f"pip install 'quiesce[{extra}]'"
        )
        self.extra = extra
        self.module = module


def require_extra(module: str, *, extra: str, needed_by: str) -> None:
    """Raise `MissingExtra` unless `module` can be imported (found, not imported: no cost)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingExtra(extra=extra, module=module, needed_by=needed_by)
