"""Fixtures shared by every test suite.

- ``anyio_backend``: async tests (``@pytest.mark.anyio``) run on asyncio.
- ``postgres``: one throwaway PostgreSQL cluster for the session (``tools/pgtemp.py``). Skips
  when PostgreSQL is not installed, unless ``QUIESCE_REQUIRE_POSTGRES=1``, which makes it fail.
- ``ledger_url``: a fresh, empty ledger database, once per backend: ``sqlite`` (a file in
  ``tmp_path``) and ``postgres`` (a new database in the session cluster).
- the wire oracle (``tests/oracle``), always on: every reference server started in this process
  (``start_cluster``) is wrapped so that each request the coordinator sends and each reply the
  server gives is checked against strict models of the RL anchor's wire; a test during which any
  drift was seen fails (``wire_oracle`` yields the `Violations`, for a test that provokes drift
  on purpose and takes it back).
- ``crash_matrices``: when the session selects a crash-matrix test, both crash matrices start as
  child processes at its first test and run beside the suite (``tests/recovery/matrices.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from quiesce.tools.gymsim import host as gymsim_host
from quiesce.tools.gymsim.base import GymServer, HostContext
from quiesce.tools.gymsim.spec import ServerSpec
from quiesce.tools.pgtemp import PostgresUnavailable, TempPostgres
from tests.oracle.wire import OracleMiddleware, Violations, wrap_v2_maker
from tests.recovery.matrices import MODULE, Running, start_matrices


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


@pytest.fixture(scope="session", autouse=True)
def crash_matrices(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Running]]:
    """The crash matrices, started with the session when a crash-matrix test is selected (else
    none); PostgreSQL's only where the session's cluster runs (its test skips otherwise)."""
    if not any(item.path.name == MODULE for item in request.session.items):
        yield {}
        return
    cluster: TempPostgres | None
    try:
        cluster = request.getfixturevalue("postgres")
    except pytest.skip.Exception:
        cluster = None
    running = start_matrices(tmp_path_factory.mktemp("crashmatrix"), cluster)
    yield running
    for child in running.values():
        child.kill()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ledger_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a fresh, empty ledger database on each backend."""
    if request.param == "sqlite":
        folder = tmp_path_factory.mktemp("ledger")
        return f"sqlite+aiosqlite:///{folder / 'ledger.db'}"
    cluster: TempPostgres = request.getfixturevalue("postgres")
    return cluster.create_database(f"t_{uuid.uuid4().hex[:20]}")


@pytest.fixture(scope="session")
def _oracle_session() -> Iterator[Violations]:
    """Wrap every reference server this process starts, for the whole session (module-scoped
    clusters included)."""
    violations = Violations()
    original = gymsim_host.make_server

    def make(spec: ServerSpec, ctx: HostContext) -> GymServer:
        server = original(spec, ctx)
        always = spec.kind == "model" and spec.restore_index == "always"
        server.asgi = OracleMiddleware(server.asgi, violations, server.name, always_index=always)
        return server

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gymsim_host, "make_server", make)
        patch.setattr(gymsim_host, "make_v2_server", wrap_v2_maker(gymsim_host.make_v2_server, violations))
        yield violations


@pytest.fixture(autouse=True)
def wire_oracle(_oracle_session: Violations) -> Iterator[Violations]:
    """Fail the test during which a reference server or the coordinator drifted from the real wire."""
    _oracle_session.take()
    yield _oracle_session
    problems = _oracle_session.take()
    assert not problems, "drift from the real wire (tests/oracle):\n  " + "\n  ".join(problems[:20])
