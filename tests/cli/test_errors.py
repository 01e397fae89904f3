"""How the real CLI reports an error: one JSON document on stdout with `--json` / `-o json|jsonl`
(argparse's usage errors too), the human line on stderr otherwise, the same exit code either way;
`did you mean` for a mistyped command or choice; validation errors as `field.path: what is wrong`
lines in plain words; counts with the right plural."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from quiesce.ledger import Ledger
from tests.audit.handmade import Script
from tests.cli.helpers import json_of, quiesce

#: pydantic's own wording, which no message of the CLI may show.
PYDANTIC = ("Input should", "Field required", "Extra inputs", "value_error", "[type=", "errors.pydantic.dev")

BAD_CONFIG = """\
ledger: sqlite+aiosqlite:///q.db
deadline_s: soon
lease_s: -1
servers:
  - {name: a, url: 'http://127.0.0.1:9', colour: blue}
  - {name: b}
  - {name: c, url: 5}
"""


async def _one_attempt(url: str) -> None:
    async with Ledger.open(url) as ledger:
        script = Script(ledger)
        await script.start()
        await script.good_save("qee4118882e-0000000089-e4")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A ledger `q.db` with one published save, and a bad config `bad.yaml`."""
    anyio.run(_one_attempt, f"sqlite+aiosqlite:///{tmp_path / 'q.db'}")
    (tmp_path / "bad.yaml").write_text(BAD_CONFIG)
    return tmp_path


def test_a_mistyped_command_or_choice_is_answered_with_the_nearest(folder: Path) -> None:
    done = quiesce("histroy", cwd=folder)
    assert done.returncode == 2
    assert "error: unknown command 'histroy'; did you mean 'history'?" in done.stderr
    assert done.stdout == ""
    error = json_of(quiesce("histroy", "--json", cwd=folder))["error"]
    assert (error["code"], error["exit_code"]) == ("usage", 2)
    assert error["message"] == "unknown command 'histroy'; did you mean 'history'?"
    nested = quiesce("db", "upgarde", "--ledger", "q.db", cwd=folder)
    assert (nested.returncode, "did you mean 'upgrade'?" in nested.stderr) == (2, True)
    choice = quiesce("history", "--ledger", "q.db", "--outcome", "publishd", cwd=folder)
    assert choice.returncode == 2
    assert "unknown value for --outcome 'publishd'; did you mean 'published'?" in choice.stderr
    far = quiesce("zzzzzz", cwd=folder)
    assert far.returncode == 2
    assert "unknown command 'zzzzzz'; choose from " in far.stderr
    assert "history" in far.stderr


@pytest.mark.parametrize(
    ("argv", "code", "exit_code", "said"),
    [
        # argparse's own error (a bad --ledger value)
        (["history", "--ledger", "nope.db"], "usage", 2, "'nope.db': no such ledger file"),
        # bad usage found after parsing
        (["history"], "usage", 2, "name the ledger: --ledger URL|FILE"),
        (["snapshots", "--config", "bad.yaml", "--dry-run"], "usage", 2, "--dry-run goes with --prune K"),
        # a bad config (ConfigError)
        (["discover", "--config", "bad.yaml"], "config", 2, "servers[1].url: required"),
        # the ledger has no such attempt (LedgerError)
        (["show", "nope", "--ledger", "q.db"], "ledger", 1, "no attempt 'nope'"),
        # a file that cannot be written (OSError)
        (["report", "--ledger", "q.db", "--out", "/proc/r.html"], "io", 1, "/proc/"),
    ],
)
def test_every_error_is_one_json_document_with_json_and_a_line_without(
    folder: Path, argv: list[str], code: str, exit_code: int, said: str
) -> None:
    plain = quiesce(*argv, cwd=folder)
    assert plain.returncode == exit_code, plain.stderr
    assert plain.stdout == ""
    assert said in plain.stderr
    assert plain.stderr.startswith(("error:", "usage:"))
    assert "Traceback" not in plain.stderr

    as_json = [*argv, "--json"] if "--json" not in argv else argv
    done = quiesce(*as_json, cwd=folder)
    assert done.returncode == exit_code
    error = json_of(done)["error"]
    assert (error["code"], error["exit_code"]) == (code, exit_code)
    assert said in error["message"]
    assert "Traceback" not in done.stderr

    if argv[0] == "history":
        lines = quiesce(*argv, "-o", "jsonl", cwd=folder)  # the same document, on one line
        assert lines.returncode == exit_code
        assert lines.stdout.count("\n") == 1, lines.stdout
        assert json.loads(lines.stdout)["error"]["code"] == code


def test_an_error_document_names_what_its_error_carries(folder: Path) -> None:
    both = json_of(quiesce("history", "--ledger", "q.db", "-o", "wide", "--json", cwd=folder))["error"]
    assert both["code"] == "usage"
    assert "give either --json or -o wide" in both["message"]
    error = json_of(quiesce("discover", "--config", "bad.yaml", "--json", cwd=folder))["error"]
    assert error["type"] == "ConfigError"
    io = json_of(quiesce("report", "--ledger", "q.db", "--out", "/proc/r.html", "--json", cwd=folder))[
        "error"
    ]
    assert io["files"] == ["/proc/.r.html.tmp"]
    assert io["errno"] == 2


def test_a_bad_config_reads_as_plain_field_lines(folder: Path) -> None:
    done = quiesce("status", "--config", "bad.yaml", cwd=folder)
    assert done.returncode == 2
    lines = [line.strip() for line in done.stderr.splitlines()]
    assert "deadline_s: must be a number" in lines
    assert "lease_s: must be more than 0" in lines
    assert "servers[1].url: required" in lines
    assert "servers[2].url: must be text" in lines
    assert any(line.startswith("servers[0].colour: unknown key") for line in lines)
    assert not [word for word in PYDANTIC if word in done.stderr]
    (folder / "empty.yaml").write_text("servers: []\n")
    empty = quiesce("discover", "--config", "empty.yaml", cwd=folder)
    assert "servers: must hold at least 1 item" in empty.stderr
    assert not [word for word in PYDANTIC if word in empty.stderr]


def test_counts_are_singular_for_one(folder: Path) -> None:
    checked = quiesce("check", "--ledger", "q.db", cwd=folder)
    assert checked.returncode == 0, checked.stderr
    assert "protocol: 1 attempt (1 ended, 0 open)" in checked.stdout
    assert "1 attempts" not in checked.stdout
    exported = quiesce("export", "--ledger", "q.db", "--checkpoint", "latest", "--out", "b.jsonl", cwd=folder)
    assert exported.returncode == 0
    report = quiesce("report", "--ledger", "q.db", "--out", "r.html", cwd=folder)
    assert "wrote r.html: 1 attempt, " in report.stdout
