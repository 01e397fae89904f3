"""Ledger URLs: which backend a URL names, and how to show it without its password.

URLs are parsed by SQLAlchemy's ``make_url``, except the plain SQLite form
``sqlite[+DRIVER]:///PATH`` whose path holds only letters, digits and ``_.~/ +-``: that one
(``plain_sqlite_path``) is read without importing SQLAlchemy, since opening a SQLite ledger at head
needs nothing else from it. For such a URL both ways give the same path and the same text
(``tests/ledger/test_urls.py`` checks them against each other); anything else — a query string,
a host, ``%``-escapes, ``:memory:`` — goes to SQLAlchemy.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final, Literal

from quiesce.ledger.errors import LedgerUrlError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

Backend = Literal["sqlite", "postgresql"]

#: The async-driver prefix of every SQLite ledger URL (``PREFIX + path``).
SQLITE_PREFIX: Final = "sqlite+aiosqlite:///"
# A subset of what SQLAlchemy reads as drivername "sqlite[+DRIVER]", no user, host, port or query,
# database = the rest; the path's characters are those `quote`/`unquote` leave as they are.
_PLAIN_SQLITE: Final = re.compile(r"sqlite(?:\+[A-Za-z0-9_]+)?:///([A-Za-z0-9_.~/ +-]+)")


def plain_sqlite_path(url: str) -> str | None:
    """The file path of a plain ``sqlite[+DRIVER]:///PATH`` URL (relative unless PATH starts
    with ``/``), or None when ``url`` is anything else (then use ``parse``).

    For such a URL, ``parse(url)`` returns ``("sqlite", make_url(SQLITE_PREFIX + path))``, and
    ``safe`` of that URL is ``SQLITE_PREFIX + path``.
    """
    match = _PLAIN_SQLITE.fullmatch(url)
    return match.group(1) if match is not None else None


def parse(url: str | URL) -> tuple[Backend, URL]:
    """The backend and the async-driver URL (``sqlite+aiosqlite`` / ``postgresql+asyncpg``)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise LedgerUrlError(
            f"not a database URL: {safe(url)!r}; use sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB"
        ) from None
    parts = (parsed.database, parsed.username, parsed.password, parsed.host, *map(str, parsed.query.values()))
    if any("\x00" in part for part in parts if part):
        raise LedgerUrlError(
            f"the ledger URL {safe(parsed)!r} holds a NUL byte (%00), which no file or database name"
            " can hold; check how the URL was written or escaped"
        )
    name = parsed.get_backend_name()
    if name == "sqlite":
        if not parsed.database or parsed.database == ":memory:" or parsed.database.startswith("file:"):
            raise LedgerUrlError(
                f"a SQLite ledger needs a file path: {safe(parsed)!r} (sqlite+aiosqlite:///PATH)"
            )
        if parsed.query:
            options = ", ".join(sorted(parsed.query))
            raise LedgerUrlError(
                f"a SQLite ledger URL takes no options, but {safe(parsed)!r} has {options}: quiesce opens"
                " the file itself (read-only for the read commands, with its writer lock for the"
                " others), so such options would be ignored; remove everything from the '?'"
            )
        return "sqlite", parsed.set(drivername="sqlite+aiosqlite")
    if name == "postgresql":
        return "postgresql", parsed.set(drivername="postgresql+asyncpg")
    raise LedgerUrlError(f"unsupported ledger database {safe(parsed)!r}: use SQLite or PostgreSQL")


def safe(url: str | URL) -> str:
    """``url`` with any password hidden; for messages and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"
