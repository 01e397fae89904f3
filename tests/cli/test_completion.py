"""`quiesce completion bash|zsh`: scripts generated from the real parser that complete commands,
flags and `-o` choices in the real shells; `quiesce --help` does not load the generator."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import child_env, quiesce

_BASH = """
source "$1"
complete_words() {
  COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
  _shtab_quiesce; echo "${COMPREPLY[*]}"
}
complete_words quiesce hist
complete_words quiesce history -o ''
complete_words quiesce resume --ser
complete_words quiesce snapshots --dry
"""

_ZSH = """
compdef() { :; }
_describe() { print -l -- ${(P)2}; }
source "$1"
_shtab_quiesce_commands
print -- "HISTORY ${_shtab_quiesce_history_options[*]}"
"""


def test_bash_completes_commands_flags_and_output_formats(tmp_path: Path) -> None:
    done = quiesce("completion", "bash", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (tmp_path / "quiesce.bash").write_text(done.stdout)
    ran = subprocess.run(
        ["bash", "-c", _BASH, "bash", str(tmp_path / "quiesce.bash")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["history", "table wide json jsonl", "--service", "--dry-run"]


def test_zsh_completes_commands_and_output_formats(tmp_path: Path) -> None:
    done = quiesce("completion", "zsh", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert script.startswith("#compdef quiesce\n")
    if shutil.which("zsh") is None:  # no zsh here: the script still names every command
        for name in ("history", "snapshots", "completion", "verify-bundle"):
            assert f"\n    {name}:" in script
        return
    (tmp_path / "_quiesce").write_text(script)
    ran = subprocess.run(
        ["zsh", "-f", "-c", _ZSH, "zsh", str(tmp_path / "_quiesce")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    commands = [line.split(":", 1)[0] for line in ran.stdout.splitlines() if not line.startswith("HISTORY ")]
    assert {"history", "snapshots", "checkpoint", "completion", "verify-bundle"} <= set(commands)
    options = next(line for line in ran.stdout.splitlines() if line.startswith("HISTORY "))
    assert "(table wide json jsonl)" in options
    assert "--ledger" in options


def test_an_unknown_shell_is_bad_usage(tmp_path: Path) -> None:
    done = quiesce("completion", "fish", cwd=tmp_path)
    assert done.returncode == 2
    assert "unknown value for SHELL 'fish'; choose from bash, zsh" in done.stderr


_HELP = """
import sys
from quiesce.tools.cli.main import main

try:
    main(["--help"])
except SystemExit:
    pass
print("MODULES", *sorted(sys.modules))
"""


def test_help_does_not_load_the_completion_generator(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _HELP],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _, _, modules = done.stdout.partition("MODULES ")
    assert "completion" in done.stdout  # the command is listed
    assert [m for m in modules.split() if m.split(".")[0] == "shtab"] == []


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_script_lists_the_commands_of_this_cli(shell: str, tmp_path: Path) -> None:
    script = quiesce("completion", shell, cwd=tmp_path).stdout
    listed = quiesce("--help", cwd=tmp_path).stdout
    for name in ("abort", "history", "status", "snapshots", "conformance"):
        assert name in listed
        assert name in script
