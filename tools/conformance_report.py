"""What a conformance run reports, whichever control plane it checked (`conformance.py` for v1,
`conformance_v2.py` for the unified plane).

- A run is a list of `CheckResult` rows: a stable dotted name, a status, a short reason.
- `pass`, `fail`, `skip` (does not apply, with why) and `warn` (the rule holds, in a way worth
  fixing); only `fail` makes a server non-conformant.
- `ServerUnreachable` is the one exception a run raises: the URL answers nothing at all.
- The token never appears in a row: each checker redacts it before adding one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import ValidationError

from quiesce.coordinator.errors import ConfigError

__all__ = [
    "CheckResult",
    "CheckStatus",
    "ConformanceReport",
    "Plane",
    "ServerUnreachable",
    "first_error",
    "transport_error",
]

CheckStatus = Literal["pass", "fail", "skip", "warn"]
#: `v1`: the per-component plane (`/capabilities`); `v2`: Gym's unified `/checkpoint/*` plane.
Plane = Literal["v1", "v2"]


class ServerUnreachable(ConfigError):
    """The URL does not answer at all (bad URL, nothing listening, connection refused): a usage error."""


@dataclass(frozen=True)
class CheckResult:
    """One row of the report: a check's stable dotted name, its status, and a short reason."""

    name: str
    status: CheckStatus
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass
class ConformanceReport:
    """Every check run against one server, and what the server said it is (for v2: `component` is
    the participant kind and `name` its instance)."""

    url: str
    results: list[CheckResult] = field(default_factory=list)
    component: str | None = None
    name: str | None = None
    instance_role: str | None = None
    checkpoint_mode: str | None = None
    plane: Plane = "v1"

    @property
    def passed(self) -> bool:
        """True when no check failed (skips and warnings do not count against the server)."""
        return all(r.status != "fail" for r in self.results)

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "skip": 0, "warn": 0}
        for r in self.results:
            out[r.status] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "plane": self.plane,
            "component": self.component,
            "name": self.name,
            "instance_role": self.instance_role,
            "checkpoint_mode": self.checkpoint_mode,
            "passed": self.passed,
            "summary": self.counts(),
            "checks": [r.to_json() for r in self.results],
        }


def first_error(exc: ValidationError) -> str:
    """`loc: msg (+N more)` of a pydantic error, short enough for a row."""
    errors = exc.errors()
    if not errors:
        return str(exc)
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {first.get('msg', '')}{more}"


def transport_error(exc: httpx.HTTPError) -> str:
    """A transport failure in one phrase (`no reply in time`, `connection closed ...`)."""
    text = str(exc).strip()
    if isinstance(exc, httpx.TimeoutException):
        return f"no reply in time ({type(exc).__name__})"
    if not text and isinstance(exc, httpx.ReadError | httpx.RemoteProtocolError):
        text = "connection closed without a complete reply"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
