"""Fault injection for the reference servers (tests, crash matrix, conformance of the coordinator).

A fault is switched on by the launcher spec (`faults:` of a server) or at run time by
the control-free admin route `POST /gymsim/admin/faults`. It matches requests by
path (exact route path, or a suffix such as `/model-admission/pause` or
`/v1/responses`), optionally by method and by the `x-nemo-gym-rollout-id` header,
and fires `times` times (None: every match). Kinds:

- `delay`: sleep `seconds` before running the route (`when: before`), after running
  it and before replying (`when: after` — the operation is applied, the reply is late), or
  inside the fenced control operation it matched (`when: during` — the fence shows the
  operation's own phase, e.g. `committing`, the whole time: a slow commit or restore);
- `fail`: reply `status` with `{"error": {"code", "detail"}}` without running the route;
- `drop`: run the route (the operation is applied), then drop the connection
  before the body is sent (a lost reply);
- `hang`: never run nor answer the request until the faults are cleared — on a
  model data-plane route the request counts as in flight, so a drain never ends;
- `malformed`: run the route, then answer 200 with truncated JSON;
- `wrong_schema`: run the route, then answer 200 with JSON that matches no reply model;
- `wrong_digest`: run the route, then answer its own reply with every `manifest_digest` replaced
  by a digest of nothing (a commit whose files do not match what it reports);
- `foreign_id`: run the route, then answer its own reply with the checkpoint id it names
  (`checkpoint_id`, `source_checkpoint_id`) replaced by `FOREIGN_ID` (a server answering for
  another checkpoint).

Admin routes (`/gymsim/admin/...`) are never faulted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextvars import ContextVar
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quiesce.coordinator.protocol import ROLLOUT_ID_HEADER

FaultKind = Literal[
    "delay", "fail", "drop", "hang", "malformed", "wrong_schema", "wrong_digest", "foreign_id"
]
ADMIN_PREFIX = "/gymsim/admin"
#: Scope key set when a reply was deliberately not delivered (drop, hang).
UNDELIVERED = "gymsim.undelivered"
#: Scope key set to the fault's kind when a fault fired for the request (its reply is not the server's own).
FAULTED = "gymsim.faulted"

#: Seconds a `delay` fault with `when: during` adds inside the fenced operation of the request it
#: matched (`Fence.run` sleeps them in the operation's phase, before the operation itself).
OPERATION_DELAY: ContextVar[float] = ContextVar("gymsim_operation_delay", default=0.0)

MALFORMED_BODY = b'{"state": "accepting", "workers": {"acknowledged": '
WRONG_SCHEMA_BODY = {"gymsim_fault": "wrong_schema", "schema_version": 1}
#: sha256 of the empty string: what `wrong_digest` reports instead of the real manifest digest.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
#: The checkpoint id a `foreign_id` reply names.
FOREIGN_ID = "foreign-checkpoint"


class Fault(BaseModel):
    """One fault rule (spec files and `POST /gymsim/admin/faults` use this shape)."""

    model_config = ConfigDict(extra="forbid")

    kind: FaultKind
    path: str = Field(min_length=1)
    method: Literal["GET", "POST"] | None = None
    seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    when: Literal["before", "after", "during"] = "before"
    status: int = Field(default=500, ge=400, le=599)
    code: str = "injected_fault"
    times: int | None = Field(default=None, ge=1)
    rollout_id: str | None = None

    def matches(self, method: str, path: str, rollout_id: str | None) -> bool:
        if self.method is not None and self.method != method:
            return False
        if self.rollout_id is not None and self.rollout_id != rollout_id:
            return False
        return path == self.path or path.endswith(self.path if self.path.startswith("/") else "/" + self.path)


class FaultSet:
    """The armed faults of one server; `clear()` also releases every hung request."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._left: list[int | None] = []
        self._release: asyncio.Event | None = None

    def set(self, faults: list[Fault], *, replace: bool = True) -> None:
        if replace:
            self.clear()
        for fault in faults:
            self._faults.append(fault)
            self._left.append(fault.times)

    @property
    def armed(self) -> bool:
        """True while any fault is set (fired out or not)."""
        return bool(self._faults)

    def clear(self) -> None:
        self._faults.clear()
        self._left.clear()
        if self._release is not None:
            self._release.set()
            self._release = None

    def describe(self) -> list[dict[str, Any]]:
        return [
            {**fault.model_dump(mode="json"), "left": left}
            for fault, left in zip(self._faults, self._left, strict=True)
        ]

    def take(self, method: str, path: str, rollout_id: str | None) -> Fault | None:
        """The first armed fault matching the request; counts one firing."""
        for index, fault in enumerate(self._faults):
            left = self._left[index]
            if (left is None or left > 0) and fault.matches(method, path, rollout_id):
                if left is not None:
                    self._left[index] = left - 1
                return fault
        return None

    async def wait_released(self) -> None:
        if self._release is None:
            self._release = asyncio.Event()
        await self._release.wait()


class DroppedConnection(Exception):
    """Raised after the response start so that uvicorn closes the connection (a lost reply)."""


class _QuietDrops(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, DroppedConnection)


def install_log_filter() -> None:
    """Keep deliberate drops out of uvicorn's error log."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietDrops) for f in logger.filters):
        logger.addFilter(_QuietDrops())


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class FaultMiddleware:
    """Applies the server's `FaultSet` to every request but the admin routes."""

    def __init__(self, app: ASGIApp, faults: FaultSet, *, path_of: Any) -> None:
        self.app = app
        self.faults = faults
        self.path_of = path_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.faults.armed:
            await self.app(scope, receive, send)
            return
        path: str = self.path_of(scope)
        if path.startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        fault = self.faults.take(scope["method"], path, _header(scope, ROLLOUT_ID_HEADER.encode()))
        if fault is None:
            await self.app(scope, receive, send)
            return
        scope[FAULTED] = fault.kind
        if fault.kind == "fail":
            await _send_json(send, fault.status, {"error": {"code": fault.code, "detail": "injected fault"}})
            return
        if fault.kind == "hang":
            scope[UNDELIVERED] = True
            await self.faults.wait_released()
            scope[UNDELIVERED] = False
            await self.app(scope, receive, send)
            return
        if fault.kind == "delay" and fault.when == "during":
            token = OPERATION_DELAY.set(fault.seconds)
            try:
                await self.app(scope, receive, send)
            finally:
                OPERATION_DELAY.reset(token)
            return
        if fault.kind == "delay" and fault.when == "before":
            await asyncio.sleep(fault.seconds)
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []

        async def capture(message: Message) -> None:
            messages.append(message)

        await self.app(scope, receive, capture)
        if fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            for message in messages:
                await send(message)
        elif fault.kind == "drop":
            scope[UNDELIVERED] = True
            start = next((m for m in messages if m["type"] == "http.response.start"), None)
            await send(start or {"type": "http.response.start", "status": 200, "headers": []})
            raise DroppedConnection("gymsim drop fault: reply not delivered")
        elif fault.kind == "malformed":
            await _send_raw(send, 200, MALFORMED_BODY)
        elif fault.kind in ("wrong_digest", "foreign_id"):
            start = next((m for m in messages if m["type"] == "http.response.start"), None)
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
            document = json.loads(body) if body else None
            keys = ("manifest_digest",) if fault.kind == "wrong_digest" else _ID_KEYS
            if isinstance(document, dict):
                for key in keys:
                    if key in document:
                        document[key] = EMPTY_SHA256 if fault.kind == "wrong_digest" else FOREIGN_ID
            await _send_json(send, start["status"] if start else 200, document)
        else:  # wrong_schema
            await _send_json(send, 200, WRONG_SCHEMA_BODY)


_ID_KEYS = ("checkpoint_id", "source_checkpoint_id")


async def _send_raw(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, document: Any) -> None:
    await _send_raw(send, status, json.dumps(document).encode("utf-8"))
