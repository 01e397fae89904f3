"""The terminal-safety helper (`tools/cli/safe_text.py`) and what the command line builds on it, in
process: control characters escaped, length capped, markup escaped, whole objects cleaned, JSON
lines escaped; a progress line and the live line fed a hostile reason stay one safe line; a signal's
error line says which signal and what became of the attempt.
"""

from __future__ import annotations

import io
import json
import signal
from dataclasses import dataclass, field

from rich.console import Console

from quiesce.coordinator import Progress
from quiesce.ledger import Event
from quiesce.tools.cli.progress import ProgressLine, reason_text
from quiesce.tools.cli.safe_text import (
    LINE_MAX,
    block,
    cleaned,
    json_text,
    markup,
    one_line,
    safe_segments,
)
from quiesce.tools.cli.signals import SignalStop, abandoned, exit_code_of, interrupted

HOSTILE = "ok\x1b[2K\r\x1b[32mpublished forged\x1b[0m\n[red]x[/red]\u202eevil\x07\x9b\t"
RAW = ("\x1b", "\r", "\u202e", "\x07", "\x9b", "\t")


def test_one_line_escapes_every_control_and_caps_the_length() -> None:
    shown = one_line(HOSTILE)
    assert shown == "ok\\x1b[2K\\r\\x1b[32mpublished forged\\x1b[0m\\n[red]x[/red]\\u202eevil\\x07\\x9b\\t"
    assert one_line("plain text — ünïcode") == "plain text — ünïcode"
    long = one_line("a" * 1000)
    assert long == "a" * LINE_MAX + "… [700 more characters]"
    assert one_line("x" * 50, 10).endswith("… [40 more characters]")


def test_block_keeps_newlines_but_indents_every_line_after_the_first() -> None:
    assert block("invalid config:\n  a: b\n  c: d") == "invalid config:\n  a: b\n  c: d"
    shown = block("failed: x\npublished forged\r\x1b[31m")
    assert shown == "failed: x\n  published forged\\r\\x1b[31m"
    assert not any(line.startswith("published") for line in shown.splitlines())


def test_markup_is_escaped() -> None:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(f"error: {markup('[red]ALERT[/red] [bold]b[/]')}")
    assert console.file.getvalue() == "error: [red]ALERT[/red] [bold]b[/]\n"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Inner:
    name: str
    tags: tuple[str, ...] = ()


@dataclass
class _Outer:
    title: str
    items: list[_Inner] = field(default_factory=list)
    by: dict[str, _Inner] = field(default_factory=dict)
    count: int = 0


def test_cleaned_copies_a_tree_with_every_string_safe() -> None:
    inner = _Inner("srv\x1b[31m", ("a\nb",))
    original = _Outer(HOSTILE, [inner], {"k\r": inner}, 3)
    made = cleaned(original)
    assert made is not original
    assert original.title == HOSTILE  # the original is untouched
    assert made.title == one_line(HOSTILE)
    assert made.items[0].name == "srv\\x1b[31m"
    assert made.items[0].tags == ("a\\nb",)
    assert made.by == {"k\\r": made.items[0]}
    assert made.count == 3


def test_json_lines_escape_what_json_leaves_raw() -> None:
    encoded = json.dumps({"detail": "x\u202ey\x9b—z"}, ensure_ascii=False)
    assert "\u202e" in encoded  # JSON itself leaves it raw
    safe = json_text(encoded)
    assert not any(ch in safe for ch in ("\u202e", "\x9b"))
    assert json.loads(safe) == {"detail": "x\u202ey\x9b—z"}


def test_the_render_hook_escapes_what_reaches_a_console_raw() -> None:
    from rich.text import Text

    console = Console(file=io.StringIO(), width=300, color_system="truecolor", force_terminal=True)
    console.push_render_hook(safe_segments())
    console.print(Text("cell \x1b[31mred\x07 \u202e"), style="bold")
    written = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\\x1b[31mred" in written  # (rich drops the BEL itself)
    assert "\\u202e" in written
    assert "\x1b[31mred" not in written
    assert "\x1b[1m" in written  # rich's own styling still works


def test_a_progress_line_fed_a_hostile_reason_is_one_safe_line() -> None:
    stream = io.StringIO()
    line = ProgressLine(live=False, stream=stream)
    line(Progress("q1", "commit", step="phase", servers=3))
    line(Progress("q1", "commit", "tools\x1b[2K", step="failed", error=HOSTILE + "A" * 5000))
    written = stream.getvalue()
    assert len(written.splitlines()) == 2, written
    failed = written.splitlines()[1]
    assert "commit FAILED at tools\\x1b[2K after" in failed
    assert not any(raw in written for raw in RAW)
    assert "more characters]" in failed
    assert len(failed) < LINE_MAX + 200


def test_the_live_line_shows_a_hostile_server_safely() -> None:
    line = ProgressLine(live=True)
    line(Progress("q1", "prepare", step="phase", servers=1))
    line(Progress("q1", "prepare", "srv\r\x1b[2Kforged", step="call"))
    status = line.board.status()
    assert "calling srv\\r\\x1b[2Kforged" in status
    assert not any(raw in status for raw in RAW)


def test_a_cancellation_by_a_signal_reads_as_such() -> None:
    text = (
        "interrupted by CancelledError: Cancelled via cancel scope 7f00ab12; reason: SIGTERM received"
        " by the command"
    )
    assert reason_text(text) == "interrupted: SIGTERM received by the command"
    assert reason_text(None) == "no reason given"


def _event(seq: int, what: str, cid: str, **data: object) -> Event:
    return Event(
        seq=seq,
        at="2026-12-04T00:00:00.000000Z",
        epoch=1,
        kind=what,
        checkpoint_id=cid,
        server=None,
        call_id=None,
        data=dict(data),
        prev_hash="0" * 64,
        hash="0" * 64,
    )


def test_the_signal_line_names_the_signal_its_exit_code_and_the_outcome() -> None:
    assert (exit_code_of(signal.SIGTERM), exit_code_of(signal.SIGHUP), exit_code_of(signal.SIGINT)) == (
        143,
        129,
        130,
    )
    none = interrupted(signal.SIGHUP, [], "--config c.yaml")
    assert str(none) == "interrupted by SIGHUP (exit 129) before any attempt started: no server was paused"
    assert none.exit_code == 129
    rolled = interrupted(
        signal.SIGTERM,
        [
            _event(1, "attempt.started", "q1", kind="save"),
            _event(2, "attempt.aborted", "q1", resumed=["a", "b"], left_paused=["c"]),
        ],
        "--config c.yaml",
    )
    assert str(rolled).startswith("interrupted by SIGTERM (exit 143): checkpoint q1 rolled back")
    assert "still paused: c — run `quiesce abort --config c.yaml q1` once reachable" in str(rolled)
    assert rolled.fields == {
        "signal": "SIGTERM",
        "checkpoint_id": "q1",
        "kind": "save",
        "outcome": "aborted",
        "resumed": ["a", "b"],
        "left_paused": ["c"],
    }
    open_one = interrupted(signal.SIGINT, [_event(1, "attempt.started", "q2", kind="save")], "--config c")
    assert "run `quiesce recover --config c`" in str(open_one)
    assert open_one.exit_code == 130
    through = abandoned(signal.SIGTERM, "http://127.0.0.1:8470")
    assert "quiesce status --service http://127.0.0.1:8470" in str(through)


def test_a_signal_before_the_operation_cancels_it_at_once_and_a_held_one_waits() -> None:
    import anyio

    async def main() -> tuple[bool, bool]:
        stop = SignalStop()
        stop.take(signal.SIGTERM)  # before any operation: remembered
        ran_early = True
        with stop.operation():
            await anyio.sleep(5)
            ran_early = False  # never reached: cancelled at once
        held = SignalStop()
        finished = False
        with held.operation(lambda: "its resume is finished first"):
            held.take(signal.SIGTERM)
            await anyio.sleep(0.01)
            finished = True
        return ran_early, finished and held.received == signal.SIGTERM

    assert anyio.run(main) == (True, True)
