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
- ``crash_matrices``: when the session selects a crash-matrix test, the crash matrices start once,
  as child processes, and run beside the suite (``tests/recovery/matrices.py``): at the session's
  first test when run serially; under pytest-xdist, started by the controller when the first worker
  has collected, and judged on whichever worker runs their tests.
- under pytest-xdist (the README's test command: ``-n 2 --dist loadgroup``), each test module is
  one group, run whole on one worker (its module-scoped clusters start once), and ``tests/rl`` is
  one group (one local Ray, not one per worker).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quiesce.tools.gymsim import host as gymsim_host
from quiesce.tools.gymsim.base import GymServer, HostContext
from quiesce.tools.gymsim.spec import ServerSpec
from quiesce.tools.pgtemp import PostgresUnavailable, TempPostgres
from tests.oracle.wire import OracleMiddleware, Violations, wrap_v2_maker
from tests.recovery.matrices import MODULE, WORKER_KEY, Matrices, start_matrices


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
) -> Iterator[Matrices | None]:
    """The session's crash matrices when a crash-matrix test is selected (else None): the
    controller's under pytest-xdist; else started here, PostgreSQL's only where the session's
    cluster runs (their tests skip otherwise)."""
    if not any(item.path.name == MODULE for item in request.session.items):
        yield None
        return
    workerinput: dict[str, Any] | None = getattr(request.config, "workerinput", None)
    if workerinput is not None:
        yield Matrices(Path(workerinput[WORKER_KEY]))
        return
    cluster: TempPostgres | None
    try:
        cluster = request.getfixturevalue("postgres")
    except pytest.skip.Exception:
        cluster = None
    matrices = start_matrices(tmp_path_factory.mktemp("crashmatrix"), cluster)
    yield matrices
    matrices.kill()


# -- pytest-xdist: the controller runs the crash matrices once for every worker -----------------


class _ControllerMatrices:
    """The controller's crash matrices: a folder every worker is told, the matrices once started
    there, and the PostgreSQL cluster they use (its own: each worker's session has another)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="quiesce-crashmatrix-"))
        self.matrices: Matrices | None = None
        self.cluster: TempPostgres | None = None

    def start(self) -> None:
        try:
            self.cluster = TempPostgres(fsync=False).start()
        except (PostgresUnavailable, RuntimeError):
            self.cluster = None  # the PostgreSQL matrices' tests skip or fail in the worker
        self.matrices = start_matrices(self.folder, self.cluster)

    def stop(self) -> None:
        if self.matrices is not None:
            self.matrices.kill()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


_CONTROLLER = pytest.StashKey[_ControllerMatrices]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(controller) Tell every worker the folder of the crash matrices."""
    stash = node.config.stash
    if _CONTROLLER not in stash:
        stash[_CONTROLLER] = _ControllerMatrices()
    node.workerinput[WORKER_KEY] = str(stash[_CONTROLLER].folder)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """(controller) Start the crash matrices once, when the first worker to have collected
    selected a crash-matrix test."""
    run = node.config.stash.get(_CONTROLLER, None)
    if run is not None and run.matrices is None and any(MODULE in nodeid for nodeid in ids):
        run.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    """(controller) Kill the crash matrices still running and stop their cluster."""
    run = config.stash.get(_CONTROLLER, None)
    if run is not None:
        run.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """(xdist worker) One group per test module, and one for `tests/rl`: pytest-xdist's
    `loadgroup` runs a group whole on one worker. Runs before xdist's own hook reads the marks."""
    if not hasattr(config, "workerinput"):
        return
    root = Path(__file__).parent
    for item in items:
        relative = item.path.relative_to(root)
        group = "rl" if relative.parts[0] == "rl" else relative.as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


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
