"""Words of quiesce's messages — the command line's, the service's, a bad config's: counts with
the right plural, and validation errors in plain words (one wording everywhere).

- `count(1, "server")` is `1 server`, `count(2, "server")` `2 servers`: never `1 servers`, never
  `server(s)` (`plain` turns another module's `1 result(s)` into `1 result`, `2 call(s)` into
  `2 calls`).
- `plain(message)` rewrites pydantic's wording (`Input should be a valid integer`, `Field
  required`, `Value error, ...`, `[type=..., input_value=...]`, its documentation links) into what
  is wrong, so a bad config or reply reads `servers[0].url: required`, not pydantic's report.
  Anything else is left as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["count", "field_path", "plain"]


def field_path(loc: Iterable[Any]) -> str:
    """A validation error's location as one path: `("servers", 0, "url")` → `servers[0].url`
    (empty for the top level)."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n noun` with the noun in the plural unless n is 1 (`plural` for the irregular ones)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


#: pydantic v2's templates (pydantic_core error messages), most specific first, and their plain words.
_PLAIN: Final = tuple(
    (re.compile(pattern), words)
    for pattern, words in (
        (r"\s*\[type=[a-z_]+(?:, input_value=.*?, input_type=\w+|, input_value=[^\]\n]*)?\]", ""),
        (r"\s*For further information visit https://errors\.pydantic\.dev/\S+", ""),
        (r"\b(?:Value|Assertion) error, ", ""),
        (r"\bField required\b", "required"),
        (r"\bExtra inputs are not permitted\b", "unknown key (not allowed here)"),
        (
            r"\bInput should be a valid (?:number|integer), unable to parse string as an? (?:number|integer)",
            "must be a number",
        ),
        (r"\bInput should be a valid integer, got a number with a fractional part", "must be a whole number"),
        (r"\bInput should be a finite number\b", "must be a finite number"),
        (r"\bInput should be a valid integer\b", "must be a whole number"),
        (r"\bInput should be a valid number\b", "must be a number"),
        (r"\bInput should be a valid string\b", "must be text"),
        (r"\bInput should be a valid boolean, unable to interpret input\b", "must be true or false"),
        (r"\bInput should be a valid boolean\b", "must be true or false"),
        (r"\bInput should be a valid list\b", "must be a list"),
        (r"\bInput should be a valid (?:dictionary|mapping)(?: or instance of \w+)?", "must be a mapping"),
        (r"\bInput should be a valid URL, ", "must be a URL: "),
        (r"\bInput should be greater than or equal to\b", "must be at least"),
        (r"\bInput should be greater than\b", "must be more than"),
        (r"\bInput should be less than or equal to\b", "must be at most"),
        (r"\bInput should be less than\b", "must be less than"),
        (r"\bInput should be\b", "must be"),
        (r"\bString should have at least (\d+) characters?\b", r"must be at least \1 characters long"),
        (r"\bString should have at most (\d+) characters?\b", r"must be at most \1 characters long"),
        (r"\bString should match pattern\b", "must match the pattern"),
        (
            r"\b(?:List|Tuple|Set|Dictionary) should have at least (\d+) items? after validation, not \d+",
            r"must hold at least \1 item",
        ),
        (
            r"\b(?:List|Tuple|Set|Dictionary) should have at most (\d+) items? after validation, not \d+",
            r"must hold at most \1 items",
        ),
        (r"\bat least 1 items\b", "at least 1 item"),
        (r"\bat most 1 items\b", "at most 1 item"),
        (r"\bvalue_error\b", "bad value"),
    )
)


#: `str(ValidationError)`: a title, then per error its location on one line and the message
#: indented on the next.
_REPORT: Final = re.compile(
    r"\d+ validation errors? for (\w+)\n((?:[^\n]+\n  [^\n]+(?:\n|$)(?:    [^\n]*(?:\n|$))?)+)"
)
_ENTRY: Final = re.compile(r"([^\n]+)\n  ([^\n]+)(?:\n    [^\n]*)?")


def _entries(match: re.Match[str]) -> str:
    lines = [f"{where.strip()}: {what.strip()}" for where, what in _ENTRY.findall(match.group(2))]
    return f"invalid {match.group(1)}:\n  " + "\n  ".join(lines) + "\n"


_MAYBE_PLURAL: Final = re.compile(r"\b(\d+)((?: [a-z]+)*? [a-z]+)\(s\)")


def _counted(match: re.Match[str]) -> str:
    return f"{match.group(1)}{match.group(2)}" + ("" if match.group(1) == "1" else "s")


def plain(message: str) -> str:
    """`message` with pydantic's wording replaced by plain words, and `N thing(s)` counted (see
    the module docstring)."""
    message = _REPORT.sub(_entries, message).rstrip("\n") if "validation error" in message else message
    for pattern, words in _PLAIN:
        message = pattern.sub(words, message)
    return _MAYBE_PLURAL.sub(_counted, message) if "(s)" in message else message
