"""A throwaway PostgreSQL cluster: ``initdb`` into a temporary folder, a free loopback port.

    with TempPostgres() as pg:
        url = pg.create_database("t1")      # "postgresql+asyncpg://quiesce@127.0.0.1:PORT/t1"

- Binaries: ``initdb``/``pg_ctl`` from PATH, else the newest ``/usr/lib/postgresql/*/bin``;
  ``PostgresUnavailable`` when there are none (callers decide whether that skips or fails).
- Running as root (initdb refuses root), the cluster runs as an unprivileged OS user
  (``postgres`` by default) that owns the temporary folder.
- Auth is ``trust`` for the superuser ``quiesce`` on loopback TCP and the cluster's own socket
  directory (inside the temporary folder); nothing listens beyond 127.0.0.1.
- ``fsync=False`` trades crash safety of the *server* for speed (test suites that only kill
  clients); keep the default for benchmarks and power-loss style crash tests.
- ``stop()`` (or leaving the ``with``) stops the server immediately and deletes the folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

SUPERUSER = "quiesce"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries were found on this machine."""


def find_bindir() -> Path:
    """The folder holding ``initdb``, ``pg_ctl`` and ``psql``."""
    candidates: list[Path] = []
    initdb = shutil.which("initdb")
    if initdb is not None:
        candidates.append(Path(initdb).resolve().parent)
        candidates.append(Path(initdb).parent)

    def version(path: str) -> tuple[int, ...]:
        match = re.search(r"/postgresql/([\d.]+)/bin", path)
        return tuple(int(p) for p in match.group(1).split(".")) if match else ()

    candidates.extend(
        Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    )
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    raise PostgresUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in /usr/lib/postgresql/*/bin; "
        "install them (Debian: apt-get install postgresql)"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TempPostgres:
    """A PostgreSQL cluster that lives as long as this object is started."""

    def __init__(
        self, *, base_dir: str | Path | None = None, fsync: bool = True, os_user: str = "postgres"
    ) -> None:
        self.bindir = find_bindir()
        self.fsync = fsync
        self._base_dir = base_dir
        self._os_user = os_user if os.geteuid() == 0 else None
        self.root: Path | None = None
        self.port = 0
        self.host = "127.0.0.1"

    # -- paths ---------------------------------------------------------------------------------

    @property
    def datadir(self) -> Path:
        assert self.root is not None, "not started"
        return self.root / "data"

    @property
    def sockdir(self) -> Path:
        assert self.root is not None, "not started"
        return self.root / "sock"

    @property
    def logfile(self) -> Path:
        assert self.root is not None, "not started"
        return self.root / "postgres.log"

    # -- processes -----------------------------------------------------------------------------

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        user = self._os_user
        result = subprocess.run(
            list(args),
            user=user,
            capture_output=True,
            text=True,
            cwd=self.root,
            env={**os.environ, "LC_ALL": "C", "PGTZ": "UTC"},
            check=False,
        )
        if check and result.returncode != 0:
            log = ""
            with contextlib.suppress(OSError):
                log = self.logfile.read_text()[-2000:]
            raise RuntimeError(
                f"{Path(args[0]).name} failed ({result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}" + (f"\nserver log:\n{log}" if log else "")
            )
        return result

    def start(self) -> TempPostgres:
        self.root = Path(tempfile.mkdtemp(prefix="quiesce-pg-", dir=self._base_dir))
        self.sockdir.mkdir()
        if self._os_user is not None:
            entry = pwd.getpwnam(self._os_user)
            for path in (self.root, self.sockdir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        try:
            self._run(
                str(self.bindir / "initdb"),
                "-D",
                str(self.datadir),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            )
            for _ in range(5):
                self.port = free_port()
                options = (
                    f"-p {self.port} -k {self.sockdir} -c listen_addresses={self.host} "
                    f"-c fsync={'on' if self.fsync else 'off'} -c max_connections=200"
                )
                if not self.fsync:
                    options += " -c synchronous_commit=off -c full_page_writes=off"
                started = self._run(
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(self.datadir),
                    "-l",
                    str(self.logfile),
                    "-o",
                    options,
                    "-w",
                    "-t",
                    "60",
                    "start",
                    check=False,
                )
                if started.returncode == 0:
                    return self
                if "could not bind" not in self.logfile.read_text(errors="replace"):
                    raise RuntimeError(f"pg_ctl start failed: {started.stderr.strip()}")
            raise RuntimeError("pg_ctl start failed: no free port after 5 tries")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server immediately and delete its folder. Idempotent."""
        if self.root is None:
            return
        if (self.datadir / "postmaster.pid").exists():
            self._run(
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-m",
                "immediate",
                "-w",
                "stop",
                check=False,
            )
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> TempPostgres:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- databases -----------------------------------------------------------------------------

    def url(self, database: str = "postgres", *, driver: str = "asyncpg") -> str:
        """A SQLAlchemy URL for ``database`` over loopback TCP."""
        return f"postgresql+{driver}://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` with ``psql`` as the superuser; returns its unaligned output."""
        result = self._run(
            str(self.bindir / "psql"),
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            str(self.sockdir),
            "-p",
            str(self.port),
            "-U",
            SUPERUSER,
            "-d",
            database,
            "-c",
            sql,
        )
        return result.stdout

    def create_database(self, name: str) -> str:
        """Create an empty database ``name``; returns its ``postgresql+asyncpg://`` URL."""
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
            raise ValueError(f"database name must be a plain identifier: {name!r}")
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
