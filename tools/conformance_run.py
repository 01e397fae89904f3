"""The machinery of one conformance run, whichever plane it checks (`conformance.py` for v1,
`conformance_v2.py` for the unified plane): requests and their replies, the verdicts a check
raises, and the rows a run adds.

- A check is a coroutine that returns a detail (it passed) or raises `Fail`, `Skip` or `Warn`;
  `CheckRun.check` makes each outcome one row. A timeout or a transport error is a failed row:
  nothing a check raises escapes the run.
- A request that met a kept-alive connection the server had closed is sent once more, on a fresh
  one (FastAPI closes one after a 500 its error handler raised, without `connection: close`);
  a second failure is the check's.
- The token never reaches a row: `CheckRun.add` redacts it from every detail.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from quiesce.tools.conformance_report import (
    CheckResult,
    CheckStatus,
    ConformanceReport,
    first_error,
    transport_error,
)

__all__ = [
    "CheckRun",
    "Fail",
    "Reply",
    "Skip",
    "Warn",
    "expect",
    "send",
    "validated",
    "work_dir",
]

#: How much of a reply body a row quotes.
BODY_PREVIEW: Final = 160

_T = TypeVar("_T", bound=BaseModel)


@dataclass(frozen=True)
class Reply:
    """A server's answer: the status, the body parsed as JSON (None when it is not), the text."""

    status: int
    body: Any
    text: str

    @property
    def code(self) -> str | None:
        """The envelope's rejection code (`{"error": {"code": ...}}`), if the body has one."""
        if isinstance(self.body, dict):
            error = self.body.get("error")
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                return str(error["code"])
        return None

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def describe(self) -> str:
        """`HTTP 409 stale_checkpoint` or `HTTP 200 {"state": ...}`: short, for a row's detail."""
        if self.code is not None:
            return f"HTTP {self.status} {self.code}"
        text = self.text if len(self.text) <= BODY_PREVIEW else self.text[:BODY_PREVIEW] + "…"
        return f"HTTP {self.status} {text}".rstrip()


class Fail(Exception):
    """Raised inside a check: it failed, with this reason."""


class Skip(Exception):
    """Raised inside a check: it does not apply, with this reason."""


class Warn(Exception):
    """Raised inside a check: the rule holds, in a way worth a warning (this reason)."""


def expect(reply: Reply, status: int, code: str | None = None, what: str = "") -> None:
    """`Fail` unless `reply` has `status` (and, when given, the envelope's `code`)."""
    if reply.status != status or (code is not None and reply.code != code):
        wanted = f"{status} {code}" if code else str(status)
        raise Fail(f"{what}{': ' if what else ''}expected {wanted}, got {reply.describe()}")


def validated(model: type[_T], reply: Reply, what: str) -> _T:
    """A 200 reply's body as `model`; `Fail` naming `what` when it is another status, not JSON, or
    does not match."""
    expect(reply, 200, what=what)
    if reply.body is None:
        raise Fail(f"{what} reply is not JSON: {reply.describe()}")
    try:
        return model.model_validate(reply.body)
    except ValidationError as exc:
        raise Fail(f"{what} reply does not match {model.__name__}: {first_error(exc)}") from exc


@contextmanager
def work_dir(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A folder for the run's checkpoint dirs: a new one under `parent` (kept), or a temporary one
    (removed afterwards)."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=parent))
        return
    with tempfile.TemporaryDirectory(prefix=f"quiesce-{prefix}-") as tmp:
        yield Path(tmp)


async def send(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    token: str | None,
    json_body: Any = None,
    raw: bytes | None = None,
    params: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> Reply:
    """One request (a bearer `token` unless None; `raw` bytes as they are, else `json_body` as
    JSON), sent once more on a fresh connection when the server had closed the one it went on."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    content = raw
    if content is None and json_body is not None:
        content = json.dumps(json_body, allow_nan=True).encode("utf-8")
    if content is not None:
        headers["Content-Type"] = "application/json"
    timeout: Any = timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
    for attempt in (1, 2):
        try:
            response = await client.request(
                method, url, headers=headers, content=content, params=params, timeout=timeout
            )
            break
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            if attempt == 2:
                raise
    try:
        parsed: Any = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = None
    return Reply(response.status_code, parsed, response.text)


class CheckRun:
    """The rows of one run: each check's outcome appended to `report.results` in order, under a
    name from `checks` (the plane's documented checks), the token redacted."""

    def __init__(
        self, report: ConformanceReport, token: str, reply_timeout_s: float, checks: Collection[str]
    ) -> None:
        self.report = report
        self.token = token
        self.reply_timeout_s = reply_timeout_s  # the client's: named when a request timed out
        self._checks = checks

    def add(self, name: str, status: CheckStatus, detail: str = "") -> CheckResult:
        assert name in self._checks, f"undocumented check {name!r}"
        result = CheckResult(name, status, detail.replace(self.token, "***") if self.token else detail)
        self.report.results.append(result)
        return result

    def skip(self, names: Iterable[str], why: str) -> None:
        for name in names:
            self.add(name, "skip", why)

    async def check(self, name: str, fn: Callable[[], Awaitable[str | None]]) -> bool:
        """Run one check; True when it passed (or warned). Nothing it raises escapes."""
        try:
            detail = await fn()
        except Fail as exc:
            self.add(name, "fail", str(exc))
            return False
        except Skip as exc:
            self.add(name, "skip", str(exc))
            return False
        except Warn as exc:
            self.add(name, "warn", str(exc))
            return True
        except httpx.TimeoutException as exc:
            self.add(name, "fail", f"no reply within {self.reply_timeout_s:g}s ({type(exc).__name__})")
            return False
        except httpx.HTTPError as exc:
            self.add(name, "fail", f"request failed: {transport_error(exc)}")
            return False
        self.add(name, "pass", detail or "")
        return True
