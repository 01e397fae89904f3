"""Episodes named on the command line: an episodes file (`--episodes FILE|-`) and `ROLLOUT[:ATTEMPT]`
arguments, read into `EpisodeId`s before anything is sent.

Rules:
- An episodes file is JSON lines: one `{"rollout_id": ..., "attempt": ...}` per line (`attempt`
  defaults to 0), each validated by `EpisodeId.model_validate`; blank lines are skipped. `-` reads
  standard input.
- A bad line, an unreadable file or a bad argument is bad usage (`UsageError`, code `episodes`,
  exit 2) naming the file and line number (or the argument) and what is wrong — no traceback, and
  nothing has been sent.
- `ROLLOUT[:ATTEMPT]`: a rollout id, optionally `:N` for attempt N (default 0); a capture key
  (`r0-a1`) is refused with the form to write instead (`r0:1`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from pydantic import ValidationError

from quiesce.coordinator.protocol_v2 import EpisodeId, episode_of_key
from quiesce.coordinator.wording import field_path, plain
from quiesce.tools.cli.flags import UsageError

__all__ = ["FILE_HELP", "episode_arg", "read_episodes"]

#: The help text of `--episodes`.
FILE_HELP: Final = (
    'JSON lines, one {"rollout_id": ..., "attempt": ...} per line (attempt defaults to 0); - reads'
    " standard input"
)


def _problem(error: ValidationError) -> str:
    first = error.errors()[0]
    where = field_path(first["loc"])
    what = plain(str(first["msg"]))
    return f"{where}: {what}" if where else what


def read_episodes(source: str, *, flag: str = "--episodes") -> list[EpisodeId]:
    """The episodes of the file `source` (`-`: standard input), in file order; `UsageError` naming
    the line of the first bad one."""
    name = "standard input" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {name}: not UTF-8 text; give JSON lines", code="episodes") from None
    except OSError as error:
        why = error.strerror or str(error)
        raise UsageError(
            f"{flag} {name}: cannot read it ({why}); give a JSON-lines file, or - for standard input",
            code="episodes",
        ) from None
    episodes: list[EpisodeId] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except ValueError as error:
            raise UsageError(
                f"{flag} {name} line {number}: not JSON ({error.args[0] if error.args else error});"
                ' write one {"rollout_id": ..., "attempt": ...} object per line',
                code="episodes",
                line=number,
            ) from None
        try:
            episodes.append(EpisodeId.model_validate(document))
        except ValidationError as error:
            raise UsageError(
                f"{flag} {name} line {number}: {_problem(error)}"
                ' (each line is {"rollout_id": ..., "attempt": N})',
                code="episodes",
                line=number,
            ) from None
    return episodes


def episode_arg(text: str) -> EpisodeId:
    """The episode `ROLLOUT[:ATTEMPT]` names; `UsageError` when it names none."""
    rollout_id, colon, attempt_text = text.rpartition(":")
    if not colon:
        rollout_id, attempt_text = text, "0"
    try:
        attempt = int(attempt_text)
    except ValueError:
        raise UsageError(
            f"{text!r}: the attempt after ':' must be a whole number (ROLLOUT[:ATTEMPT], e.g. r0:1)",
            code="episodes",
        ) from None
    try:
        return EpisodeId(rollout_id=rollout_id, attempt=attempt)
    except ValidationError as error:
        hint = ""
        try:
            named = episode_of_key(text)
        except (ValueError, ValidationError):
            named = None
        if not colon and named is not None and named.attempt > 0:
            rollout, n = named.rollout_id, named.attempt
            hint = f"; to name attempt {n} of {rollout}, write {rollout}:{n}"
        raise UsageError(f"{text!r}: {_problem(error)}{hint}", code="episodes") from None


def episodes_of(args: Sequence[str], source: str | None) -> list[EpisodeId]:
    """The episodes of `--episodes source` (if given), then of the `ROLLOUT[:ATTEMPT]` arguments."""
    found = read_episodes(source) if source is not None else []
    return found + [episode_arg(a) for a in args]
