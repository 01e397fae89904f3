"""Ledger URLs: which backend a URL names, and how to show it without its password."""

from __future__ import annotations

from typing import Literal

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ledger.errors import LedgerError

Backend = Literal["sqlite", "postgresql"]


def parse(url: str | URL) -> tuple[Backend, URL]:
    """The backend and the async-driver URL (``sqlite+aiosqlite`` / ``postgresql+asyncpg``)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise LedgerError(
            f"not a database URL: {safe(url)!r}; use sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB"
        ) from None
    name = parsed.get_backend_name()
    if name == "sqlite":
        if not parsed.database or parsed.database == ":memory:" or parsed.database.startswith("file:"):
            raise LedgerError(
                f"a SQLite ledger needs a file path: {safe(parsed)!r} (sqlite+aiosqlite:///PATH)"
            )
        return "sqlite", parsed.set(drivername="sqlite+aiosqlite")
    if name == "postgresql":
        return "postgresql", parsed.set(drivername="postgresql+asyncpg")
    raise LedgerError(f"unsupported ledger database {safe(parsed)!r}: use SQLite or PostgreSQL")


def safe(url: str | URL) -> str:
    """``url`` with any password hidden; for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"
