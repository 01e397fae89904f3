"""House rules checked on every run: ruff, ruff format, mypy strict, and the layer direction.

The layers: `tools -> coordinator -> ledger`, never the other way; SQL only in `ledger/`;
`tools/gymsim` imports only `quiesce.coordinator.protocol` from the coordinator.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ledger", "coordinator", "tools", "migrations")
#: A module path as a string names one (`tools.gymsim`, `tools.gymsim.launch:app`).
DOTTED = re.compile(r"[A-Za-z_]\w*(\.\w+)+(:\w+)?")


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
    """The modules `path` imports, with quiesce's own named inside the package (`ledger.x` for
    `quiesce.ledger.x`), so the layer rules below read as the layers are named."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {name.removeprefix("quiesce.") for name in names}


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_layer_direction() -> None:
    offenders: list[str] = []
    for path in _files("ledger"):
        for name in _imports(path):
            if name.split(".")[0] in ("coordinator", "tools", "rl"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in _files("coordinator"):
        for name in _imports(path):
            if name.split(".")[0] in ("tools", "rl"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    # the NeMo RL backend sits beside tools, above the coordinator: the tools never reach into it
    # (but the benchmarks, which measure it)
    for path in _files("tools"):
        if "bench" in path.relative_to(ROOT).parts:
            continue
        for name in _imports(path):
            if name.split(".")[0] == "rl":
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    # Ray is the optional `ray` extra: only quiesce.rl (and its tests) may import it
    for package in ("ledger", "coordinator", "tools", "migrations"):
        for path in _files(package):
            for name in _imports(path):
                if name.split(".")[0] == "ray":
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in _files("tools/gymsim"):
        for name in _imports(path):
            top = name.split(".")[0]
            # the wire models, and OS durability calls (no coordinator logic): nothing else
            if top == "ledger" or (
                top == "coordinator"
                and name not in ("coordinator.protocol", "coordinator.protocol_v2", "coordinator.durable")
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
    for package in ("quiesce", *PACKAGES):
        assert (ROOT / package / "py.typed").is_file(), package


def _bare_names(path: Path) -> list[tuple[int, str]]:
    """Each place `path` imports one of quiesce's folders by its bare name, or names one of its
    modules in a string (`-m tools.x`, `import_module("ledger.x")`, `"tools.x:app"`)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            dotted = node.value.split(":")[0]
            module = ROOT.joinpath(*dotted.split("."))
            if module.with_suffix(".py").is_file() or (module / "__init__.py").is_file():
                found.append((node.lineno, dotted))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def test_one_import_name() -> None:
    """Every folder is installed under `quiesce` (quiesce/ holds a link to each), and no code imports
    or runs one by its bare name: `ledger`, `coordinator`, `tools` and `migrations` are taken by
    other distributions and by users' own projects, and a bare import would load a second copy."""
    for package in PACKAGES:
        link = ROOT / "quiesce" / package
        assert link.is_symlink(), package
        assert link.resolve() == ROOT / package, package
    files = [ROOT / "quiesce" / "__init__.py", ROOT / "quiesce" / "__main__.py"]
    for top in (*PACKAGES, "tests"):
        files += sorted(p for p in (ROOT / top).rglob("*.py") if p != Path(__file__).resolve())
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name}" for path in files for line, name in _bare_names(path)
    ]
    assert offenders == []


def test_lazy_exports_do_not_shadow_submodules() -> None:
    """`ledger` and `coordinator` export names lazily; a name equal to a submodule's would
    resolve to the module or the function depending on import order."""
    import importlib
    import pkgutil

    for name in ("quiesce", "quiesce.ledger", "quiesce.coordinator"):
        package = importlib.import_module(name)
        submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
        exports = set(package._EXPORTS)
        assert submodules & exports == set(), name
        for export in exports:
            assert getattr(package, export) is not None


#: Documents a docstring or a comment may cite only when the repository has them (the team's
#: design notes live outside it): a markdown file by name, or those notes by their short names.
_CITED = re.compile(r"(?<![\w/.-])([\w/.-]*\.md|gym-control-v\d|rl-integration|DESIGN|STYLE)(?![\w-])")


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    """The comments and docstrings (triple-quoted strings) of `path`, with their line numbers."""
    with path.open("rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.type == tokenize.COMMENT or (
                token.type == tokenize.STRING and token.string.lstrip("rbuRBU").startswith('"""')
            ):
                yield token.start[0], token.string


def test_no_document_cited_that_the_repository_lacks() -> None:
    offenders: list[str] = []
    for path in [ROOT / "quiesce" / "__init__.py", *(p for top in (*PACKAGES, "tests") for p in _files(top))]:
        if path == Path(__file__).resolve():
            continue
        for number, text in _prose(path):
            for cited in _CITED.findall(text):
                if not cited.endswith(".md") or not any(ROOT.rglob(cited.split("/")[-1])):
                    offenders.append(f"{path.relative_to(ROOT)}:{number} cites {cited}")
    assert offenders == []
