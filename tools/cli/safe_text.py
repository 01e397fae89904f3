"""Text from outside quiesce — a server's error reply, a name or code it sent, a record of a
snapshot, a ledger's rows — made safe to print on a terminal. Every place the command line prints
such text for people goes through here.

- Control characters never reach the terminal raw: C0 (ESC, CR, BEL, backspace, tab...), DEL, C1,
  and the invisible bidirectional and line-separator characters (U+061C, U+200E/F, U+202A–E,
  U+2066–9, U+2028/9) are written as visible escapes (`\\x1b`, `\\r`, `\\u202e`). A newline is
  one too in a one-line field (`one_line`); in a message (`block`) it is kept, and every line after
  the first starts indented, so no text can begin a line of its own and pass for one the
  command printed.
- A URL's password (`scheme://user:PASSWORD@host`, say in a server URL of the config) is shown
  as `<redacted>`, as the ledger stores it.
- Length is capped: `LINE_MAX` characters for a field, `MESSAGE_MAX` for a message; what is cut
  is counted (`… [N more characters]`). `--json` keeps the whole text (JSON escapes it).
- `markup` / `block_markup`: the same, with rich markup escaped too (`[red]` prints literally),
  for text put into a string rich reads as markup.
- `json_text(encoded)`: JSON output written with `ensure_ascii=False` gets the characters JSON
  leaves raw (DEL, C1, bidi) as `\\u` escapes.
- `cleaned(obj)`: a copy of a dataclass tree (lists, tuples, dicts) whose every string is
  `one_line`, for renderers that take whole objects (`quiesce show`).
- `safe_segments()`: a render hook every console of the command line carries — the last guard, it
  escapes the control characters of any text segment rich is about to write (its own styling and
  cursor control are not text and pass).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from quiesce.ledger.redact import mask_url_passwords

if TYPE_CHECKING:
    from rich.console import (
        Console,
        ConsoleOptions,
        ConsoleRenderable,
        RenderableType,
        RenderHook,
        RenderResult,
    )

T = TypeVar("T")

#: Longest field (a server's code, a reason in a progress line, a table cell) shown whole.
LINE_MAX: Final = 300
#: Longest message (an error) shown whole.
MESSAGE_MAX: Final = 4000

#: DEL, C1, and the invisible characters that reorder or break a line (bidi marks and overrides,
#: the Unicode line and paragraph separators).
_OTHERS: Final = "\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNSAFE: Final = re.compile(f"[\x00-\x1f{_OTHERS}]")
_UNSAFE_BUT_NEWLINE: Final = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHERS}]")
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _capped(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


def one_line(text: object, limit: int = LINE_MAX) -> str:
    """`text` on one line: every control character (newline included) escaped, at most `limit`
    characters kept, URL passwords hidden."""
    value = mask_url_passwords(text if isinstance(text, str) else str(text))
    if len(value) <= limit and _UNSAFE.search(value) is None:
        return value
    return _UNSAFE.sub(_visible, _capped(value, limit))


def block(text: object, limit: int = MESSAGE_MAX) -> str:
    """`text` as a message: control characters escaped but the newline, every line after the first
    indented (at least two spaces), at most `limit` characters kept, URL passwords hidden."""
    value = _capped(mask_url_passwords(text if isinstance(text, str) else str(text)), limit)
    if _UNSAFE.search(value) is None:
        return value
    lines = _UNSAFE_BUT_NEWLINE.sub(_visible, value).split("\n")
    return "\n".join([lines[0], *(line if line.startswith("  ") else "  " + line for line in lines[1:])])


def markup(text: object, limit: int = LINE_MAX) -> str:
    """`one_line(text)` with rich markup escaped, to put into a rich markup string."""
    from rich.markup import escape

    return escape(one_line(text, limit))


def escape(text: object) -> str:
    """`markup` for a whole line the command composed around outside fields: capped at
    `MESSAGE_MAX` (what the command line uses where rich's own `escape` would be)."""
    return markup(text, MESSAGE_MAX)


def block_markup(text: object, limit: int = MESSAGE_MAX) -> str:
    """`block(text)` with rich markup escaped."""
    from rich.markup import escape

    return escape(block(text, limit))


def joined(names: Iterable[object], limit: int = LINE_MAX) -> str:
    """Names (servers, rollouts) as one safe `a, b, c` field, each name `one_line`."""
    return one_line(", ".join(one_line(n, limit) for n in names), limit * 4)


_JSON_UNSAFE: Final = re.compile(f"[{_OTHERS}]")


def json_text(encoded: str) -> str:
    """JSON text (`ensure_ascii=False`, which leaves DEL, C1 and the bidi characters raw) with
    those written as `\\uXXXX` escapes: the same JSON, nothing in it a terminal acts on. They
    can only be inside strings, where an escape means the same character."""
    if _JSON_UNSAFE.search(encoded) is None:
        return encoded
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", encoded)


def cleaned(obj: T) -> T:
    """A copy of `obj` — dataclasses, lists, tuples, sets, dicts and strings, nested — whose every
    string is `one_line` (equal strings stay equal: lookups between its parts still match)."""
    return _clean(obj, {})  # type: ignore[no-any-return]


def _clean(obj: Any, seen: dict[int, Any]) -> Any:
    if isinstance(obj, str):
        return one_line(obj)
    if isinstance(obj, bool | int | float) or obj is None:
        return obj
    if id(obj) in seen:
        return seen[id(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _clean(getattr(obj, f.name), seen) for f in dataclasses.fields(obj) if f.init}
        made: Any = dataclasses.replace(obj, **changes)
    elif isinstance(obj, list):
        made = [_clean(item, seen) for item in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        made = tuple(_clean(item, seen) for item in obj)
    elif isinstance(obj, set | frozenset):
        made = type(obj)(_clean(item, seen) for item in obj)
    elif isinstance(obj, dict):
        made = {_clean(k, seen): _clean(v, seen) for k, v in obj.items()}
    else:
        return obj
    seen[id(obj)] = made
    return made


def safe_segments() -> RenderHook:
    """The render hook every console of the command line carries (`Console.push_render_hook`):
    every renderable printed is rendered, then its text segments have their control characters
    (but the newline, which rich itself lays out) escaped; rich's own control segments pass."""
    from rich.console import RenderHook
    from rich.segment import Segment

    class Escaped:
        def __init__(self, inner: RenderableType) -> None:
            self.inner = inner

        def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
            for segment in console.render(self.inner, options):
                text = segment.text
                if segment.control or _UNSAFE_BUT_NEWLINE.search(text) is None:
                    yield segment
                else:
                    yield Segment(_UNSAFE_BUT_NEWLINE.sub(_visible, text), segment.style)

    class SafeSegments(RenderHook):
        def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
            return [Escaped(r) for r in renderables]

    return SafeSegments()
