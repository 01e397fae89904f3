"""README.md's "Embedded API" example runs as written against a real reference Gym cluster.

The python block under the heading containing "Embedded API" is executed with the working
directory set to a folder holding `cluster.yaml` for a freshly started cluster (ledger and
snapshots in that folder) and the control token in the environment.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import pytest

from quiesce.coordinator.protocol import TOKEN_ENV
from quiesce.tools.gymsim.cluster import start_cluster

README = Path(__file__).resolve().parents[1] / "README.md"


def embedded_api_example(text: str) -> str:
    """The first ```python block after the "Embedded API" heading, before the next heading."""
    match = re.search(r"^#+ [^\n]*Embedded API[^\n]*\n(.*?)(?=^#+ |\Z)", text, flags=re.M | re.S)
    assert match, 'README.md has no section headed "Embedded API"'
    block = re.search(r"^```python\n(.*?)^```", match.group(1), flags=re.M | re.S)
    assert block, 'the "Embedded API" section of README.md has no ```python block'
    return block.group(1)


def test_readme_embedded_api_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = embedded_api_example(README.read_text(encoding="utf-8"))
    token = secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, token)
    monkeypatch.chdir(tmp_path)
    with start_cluster(token=token) as cluster:
        cluster.write_config(tmp_path / "cluster.yaml", "sqlite+aiosqlite:///quiesce.db", "checkpoints")
        exec(compile(code, str(README) + ":Embedded API", "exec"), {"__name__": "__readme__"})
        snapshots = [p for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")]
        assert any((p / "manifest.json").is_file() for p in snapshots), os.listdir(tmp_path / "checkpoints")


def command_table(text: str) -> str:
    """The table of the "Command line" section."""
    match = re.search(r"^## Command line\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert match, 'README.md has no "Command line" section'
    rows = [line for line in match.group(1).splitlines() if line.startswith("| `quiesce")]
    assert rows, 'the "Command line" section of README.md has no command table'
    return "\n".join(rows)


def test_readme_command_table_lists_every_command() -> None:
    """Each command module (`tools/cli/commands/`) has its row, and each row names a command."""
    import pkgutil

    from quiesce.tools.cli import commands

    names = {m.name.replace("_", "-") for m in pkgutil.iter_modules(commands.__path__)}
    table = command_table(README.read_text(encoding="utf-8"))
    listed = set(re.findall(r"`quiesce ([a-z-]+)", table))
    assert names - listed == set(), "commands missing from README's command table"
    assert listed - names == set(), "README's command table names commands that do not exist"
