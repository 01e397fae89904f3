"""quiesce's fixed top-level names meet a user's project, and the ledger's lock file.

A project with its own `migrations` package (Django, its own alembic) first on `sys.path` must
not break the ledger: alembic finds quiesce's migrations by their location. Through the real
CLI run from such a project, and through `Coordinator.open` in a script of it (where Python puts
the script's folder first on `sys.path`). The writer lock is a lock on the ledger file itself, so
no `*.writer-lock` file is ever left beside it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio

from quiesce.ledger import Ledger
from quiesce.ledger.errors import FencedError
from tests.cli.helpers import child_env, json_of, quiesce

TRAINER = """
import anyio

from quiesce.coordinator import Coordinator


async def main() -> None:
    async with Coordinator.open("cluster.yaml", token="t-0123456789abcdef", recover=False) as coord:
        print("epoch", coord.epoch)


anyio.run(main)
"""


def _project(root: Path) -> Path:
    """A user's project whose own `migrations` package would be found first by its name."""
    project = root / "project"
    (project / "migrations").mkdir(parents=True)
    (project / "run").mkdir()  # quiesce never creates a ledger's folder
    (project / "migrations" / "__init__.py").write_text("")
    (project / "migrations" / "env.py").write_text("raise SystemExit('the project migrations ran')\n")
    (project / "cluster.yaml").write_text(
        "ledger: sqlite+aiosqlite:///run/ledger.db\nservers:\n  - {name: policy_model, url: 'http://127.0.0.1:9'}\n"
    )
    (project / "train.py").write_text(TRAINER)
    return project


def test_a_project_migrations_package_does_not_shadow_quiesce(tmp_path: Path) -> None:
    project = _project(tmp_path)
    # the CLI run from the project (`-m` puts the current folder first on sys.path)
    upgraded = json_of(quiesce("db", "upgrade", "--ledger", "new.db", "--json", cwd=project))
    assert upgraded["before"] is None
    assert upgraded["changed"] is True
    # an embedded coordinator in the project's own script, on a new ledger
    done = subprocess.run(
        [sys.executable, "train.py"],
        cwd=project,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["epoch", "1"]
    assert (project / "run" / "ledger.db").is_file()


def test_the_writer_lock_leaves_no_file_beside_the_ledger(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'q.db'}"
    lock = tmp_path / "q.db.writer-lock"

    async def hold() -> None:
        async with Ledger.open(url) as ledger:
            await ledger.start_epoch({"coordinator": {"host": "t", "pid": 1, "uuid": "u"}, "version": "t"})
            assert not lock.exists()  # the lock is on q.db itself (ledger/sqlitefile.py)
            # another writer is refused while this one holds it (also through the CLI)
            refused = await anyio.to_thread.run_sync(
                lambda: quiesce("replay", "--ledger", "q.db", "--rebuild", cwd=tmp_path)
            )
            assert refused.returncode == 1
            assert "already has a writer" in refused.stderr
            try:
                async with Ledger.open(url):
                    raise AssertionError("a second writer opened the ledger")
            except FencedError:
                pass
        assert not lock.exists()

    anyio.run(hold)
    again = quiesce("replay", "--ledger", "q.db", "--rebuild", "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert not lock.exists()
