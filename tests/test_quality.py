"""House rules checked on every run: ruff, ruff format, mypy strict, and the layer direction.

DESIGN.md: `tools -> coordinator -> ledger`, never the other way; SQL only in `ledger/`;
`tools/gymsim` imports only `coordinator.protocol` from the coordinator.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ledger", "coordinator", "tools", "migrations")


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_check() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy_strict() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_layer_direction() -> None:
    offenders: list[str] = []
    for path in _files("ledger"):
        for name in _imports(path):
            if name.split(".")[0] in ("coordinator", "tools"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in _files("coordinator"):
        for name in _imports(path):
            if name.split(".")[0] == "tools":
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in _files("tools/gymsim"):
        for name in _imports(path):
            top = name.split(".")[0]
            # the wire models, and OS durability calls (no coordinator logic): nothing else
            if top == "ledger" or (
                top == "coordinator" and name not in ("coordinator.protocol", "coordinator.durable")
            ):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_sql_only_in_ledger() -> None:
    offenders: list[str] = []
    for package in ("coordinator", "tools"):
        for path in _files(package):
            # Exempt: the throwaway test cluster, and benchmarks whose baselines are raw drivers.
            if path.name == "pgtemp.py" or "bench" in path.relative_to(ROOT).parts:
                continue
            for name in _imports(path):
                if name.split(".")[0] in ("sqlalchemy", "sqlite3", "asyncpg", "aiosqlite", "alembic"):
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_py_typed_shipped() -> None:
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package


def test_lazy_exports_do_not_shadow_submodules() -> None:
    """`ledger` and `coordinator` export names lazily; a name equal to a submodule's would
    resolve to the module or the function depending on import order."""
    import importlib
    import pkgutil

    for name in ("ledger", "coordinator"):
        package = importlib.import_module(name)
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        exports = set(package._EXPORTS)
        assert submodules & exports == set(), name
        for export in exports:
            assert getattr(package, export) is not None
