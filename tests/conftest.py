"""Fixtures shared by every test suite.

- ``anyio_backend``: async tests (``@pytest.mark.anyio``) run on asyncio.
- ``postgres``: one throwaway PostgreSQL cluster for the session (``tools/pgtemp.py``). Skips
  when PostgreSQL is not installed, unless ``QUIESCE_REQUIRE_POSTGRES=1``, which makes it fail.
- ``ledger_url``: a fresh, empty ledger database, once per backend: ``sqlite`` (a file in
  ``tmp_path``) and ``postgres`` (a new database in the session cluster).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from tools.pgtemp import PostgresUnavailable, TempPostgres


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _require_postgres() -> bool:
    return os.environ.get("QUIESCE_REQUIRE_POSTGRES", "") not in ("", "0")


@pytest.fixture(scope="session")
def postgres() -> Iterator[TempPostgres]:
    """A running PostgreSQL cluster (server ``fsync`` off: these tests kill clients, never the server)."""
    try:
        cluster = TempPostgres(fsync=False)
    except PostgresUnavailable as error:
        if _require_postgres():
            pytest.fail(f"QUIESCE_REQUIRE_POSTGRES=1 but {error}")
        pytest.skip(str(error))
    with cluster:
        yield cluster


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a fresh, empty ledger database on each backend."""
    if request.param == "sqlite":
        folder = tmp_path_factory.mktemp("ledger")
        return f"sqlite+aiosqlite:///{folder / 'ledger.db'}"
    cluster: TempPostgres = request.getfixturevalue("postgres")
    return cluster.create_database(f"t_{uuid.uuid4().hex[:20]}")
