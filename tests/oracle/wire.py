"""The oracle's hook: which strict model each control request and reply must match, and an ASGI
middleware that checks them on a reference server as they pass.

`OracleMiddleware` wraps a server's whole ASGI app (outside auth, gate and fault injection) and,
for every path under `/ng-control/v1`:
- a request sent by the coordinator (its `User-Agent` starts with `quiesce/`) must match the
  route's request model (POST body) or query model (GET) — the tests' own hand-made requests,
  malformed on purpose, are not the coordinator's and are not judged;
- every 200 reply must match the route's reply model, and every 409 the rejection shape — unless
  a fault was injected into that request (`FAULTED`: a deliberately broken reply). A model restore
  must carry `storage_reference_index` exactly when it was asked for (or the server is a later
  Gym that always returns it: one that refuses the field).

Paths under `/ng-control/v1/checkpoint/` (the unified plane, v2) are judged by `models_v2`:
- a coordinator request must match the route's request model exactly (GET status: no body, no query);
- a 200 must match the route's reply model for the participant's kind (status by its own `kind`,
  commit by its manifest's; the kind a server showed once must never change);
- any other reply must be the refusal envelope with a known code and that code's status, FastAPI's
  validation 422, or the plain 500 real Gym gives a body with a non-finite deadline.

Problems are appended to a `Violations` list; the suite's autouse fixture (tests/conftest.py)
fails the test that produced any.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quiesce.coordinator.protocol import AGENT, CAPABILITIES_PATH, MODEL, PREFIX, RESOURCES, ROUTES
from quiesce.tools.gymsim.base import HostContext, route_path
from quiesce.tools.gymsim.faults import FAULTED
from quiesce.tools.gymsim.spec import ServerSpec
from quiesce.tools.gymsim.v2.server import V2Server
from tests.oracle import models as m
from tests.oracle import models_v2 as m2

#: The coordinator names itself in every control request (calls.py).
COORDINATOR_AGENT: Final = "quiesce/"
#: The unified plane's routes: `<V2_PREFIX>/<operation>`.
V2_PREFIX: Final = "/ng-control/v1/checkpoint/"
V2_METHODS: Final[Mapping[str, str]] = {op: "POST" for op in m2.REQUESTS} | {"status": "GET"}

REQUESTS: Final[Mapping[tuple[str, str], type[BaseModel]]] = {
    (MODEL, "pause"): m.ControlRequest,
    (MODEL, "status"): m.ModelStatusQuery,
    (MODEL, "commit"): m.ModelCommitRequest,
    (MODEL, "restore"): m.ModelRestoreRequest,
    (MODEL, "resume"): m.ControlRequest,
    (AGENT, "prepare"): m.ControlRequest,
    (AGENT, "status"): m.StatusQuery,
    (AGENT, "commit"): m.AgentDirectoryRequest,
    (AGENT, "restore"): m.AgentDirectoryRequest,
    (AGENT, "resume"): m.ControlRequest,
    (AGENT, "acknowledge"): m.AcknowledgeRequest,
    (AGENT, "receipt"): m.ReceiptQuery,
    (AGENT, "discard"): m.DiscardRequest,
    (RESOURCES, "prepare"): m.ControlRequest,
    (RESOURCES, "status"): m.StatusQuery,
    (RESOURCES, "commit"): m.DirectoryRequest,
    (RESOURCES, "restore"): m.DirectoryRequest,
    (RESOURCES, "resume"): m.ControlRequest,
}

_MODEL_STATUS: Final[TypeAdapter[m.SingleWorkerStatus | m.CoordinatorStatus]] = TypeAdapter(
    m.SingleWorkerStatus | m.CoordinatorStatus
)

REPLIES: Final[Mapping[tuple[str, str], Callable[[Any], object]]] = {
    (MODEL, "pause"): m.ModelPauseReply.model_validate,
    (MODEL, "status"): _MODEL_STATUS.validate_python,
    (MODEL, "commit"): m.ModelCommitReply.model_validate,
    (MODEL, "restore"): m.ModelRestoreReply.model_validate,
    (MODEL, "resume"): m.ModelResumeReply.model_validate,
    (AGENT, "prepare"): m.AgentPrepareReply.model_validate,
    (AGENT, "status"): m.AgentStatusReply.model_validate,
    (AGENT, "commit"): m.AgentCommitReply.model_validate,
    (AGENT, "restore"): m.AgentRestoreReply.model_validate,
    (AGENT, "resume"): m.AgentResumeReply.model_validate,
    (AGENT, "acknowledge"): m.AcknowledgeReply.model_validate,
    (AGENT, "receipt"): m.Receipt.model_validate,
    (AGENT, "discard"): m.DiscardReply.model_validate,
    (RESOURCES, "prepare"): m.ResourcesPrepareReply.model_validate,
    (RESOURCES, "status"): m.ResourcesStatusReply.model_validate,
    (RESOURCES, "commit"): m.ResourcesCommitReply.model_validate,
    (RESOURCES, "restore"): m.ResourcesRestoreReply.model_validate,
    (RESOURCES, "resume"): m.ResourcesResumeReply.model_validate,
}

_BY_PATH: Final[dict[str, tuple[str, str]]] = {
    r.full_path: (r.component, r.operation) for r in ROUTES.values()
}
#: Paths shared by two components (none today) would be ambiguous: every route path is unique.
assert len(_BY_PATH) == len(ROUTES)


@dataclass
class Violations:
    """Every drift the oracle saw, and how much it checked (thread-safe: servers run in threads)."""

    problems: list[str] = field(default_factory=list)
    requests_checked: int = 0
    replies_checked: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, problem: str) -> None:
        with self._lock:
            self.problems.append(problem)

    def count(self, *, request: bool) -> None:
        with self._lock:
            if request:
                self.requests_checked += 1
            else:
                self.replies_checked += 1

    def take(self) -> list[str]:
        """The problems seen so far, forgetting them (a test that provokes drift on purpose)."""
        with self._lock:
            taken, self.problems = self.problems, []
            return taken


def _summary(error: ValidationError) -> str:
    items = error.errors()
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in items[:4])


def check_request(key: tuple[str, str], method: str, body: Any, query: Mapping[str, str]) -> str | None:
    """Why a coordinator request on route `key` does not match the anchor's request (None: it does)."""
    model = REQUESTS[key]
    try:
        model.model_validate(body if method == "POST" else dict(query))
    except ValidationError as error:
        return f"request {key[0]} {key[1]} does not match {model.__name__}: {_summary(error)}"
    return None


def check_reply(
    key: tuple[str, str] | None, status: int, body: Any, request: Any, *, always_index: bool = False
) -> str | None:
    """Why a reply does not match the anchor's reply for route `key` (None for capabilities)."""
    what = "capabilities" if key is None else f"{key[0]} {key[1]}"
    try:
        if status == 409:
            m.ControlRejection.model_validate(body)
            return None
        if key is None:
            m.Capabilities.model_validate(body)
            return None
        REPLIES[key](body)
    except ValidationError as error:
        return f"{status} reply of {what} does not match the anchor: {_summary(error)}"
    if key == (MODEL, "restore"):
        asked = isinstance(request, dict) and request.get("include_storage_reference_index") is True
        has = isinstance(body, dict) and "storage_reference_index" in body
        if has != (asked or always_index):
            return (
                f"model restore reply {'has' if has else 'lacks'} storage_reference_index, but the request"
                f" {'asked' if asked else 'did not ask'} for it"
            )
    return None


def check_request_v2(op: str, body: Any, query: Mapping[str, str]) -> str | None:
    """Why a coordinator request on v2 route `op` does not match the spec (None: it does)."""
    if op == "status":
        if body is not None or query:
            return "request v2 status carries a body or a query (Gym's status takes neither)"
        return None
    model = m2.REQUESTS[op]
    try:
        model.model_validate(body)
    except ValidationError as error:
        return f"request v2 {op} does not match {model.__name__}: {_summary(error)}"
    return None


def kind_of_reply_v2(op: str, body: Any) -> str | None:
    """The participant kind a v2 200 reply names (status: `kind`; commit: `manifest.kind`)."""
    if not isinstance(body, dict):
        return None
    found = body.get("kind") if op == "status" else None
    if op == "commit" and isinstance(body.get("manifest"), dict):
        found = body["manifest"].get("kind")
    return found if isinstance(found, str) else None


def check_reply_v2(op: str, status: int, body: Any, request: Any, kind: str | None) -> str | None:
    """Why a v2 reply does not match the spec for route `op` of a `kind` participant (None: it does).
    `request` is the request body as JSON (Python's reader: NaN and Infinity parse)."""
    try:
        if status == 200:
            if op == "status":
                named = kind_of_reply_v2(op, body)
                model: type[BaseModel] = m2.STATUS_BY_KIND.get(named or "", m2.EnvironmentStatus)
            elif op == "commit":
                model = m2.ModelCommitReply if kind == "model" else m2.CommitReply
            else:
                model = m2.REPLIES[op]
            model.model_validate(body)
            return None
        if isinstance(body, dict) and "error" in body:
            refusal = m2.Refusal.model_validate(body)
            wanted = m2.CODE_STATUS.get(refusal.error.code)
            if wanted is None:
                return f"{status} reply of v2 {op}: unknown code {refusal.error.code!r}"
            if wanted != status:
                return f"{status} reply of v2 {op}: code {refusal.error.code} goes with HTTP {wanted}"
            return None
        if status == 422:
            m2.ValidationRefusal.model_validate(body)
            return None
        if status == 500 and _non_finite_deadline(request):
            return None  # real Gym: FastAPI cannot render the error of a non-finite deadline
        if status == 404 and op == "status":
            return None  # real Gym: a server without checkpointing (a judge) mounts no routes
    except ValidationError as error:
        return f"{status} reply of v2 {op} does not match the spec: {_summary(error)}"
    return f"{status} reply of v2 {op} is neither a reply, a refusal nor a validation error"


def _non_finite_deadline(request: Any) -> bool:
    deadline = request.get("deadline_ts") if isinstance(request, dict) else None
    return isinstance(deadline, float) and not math.isfinite(deadline)


class OracleMiddleware:
    """Checks the control traffic of one reference server against the strict models."""

    def __init__(
        self, app: ASGIApp, violations: Violations, name: str, *, always_index: bool = False
    ) -> None:
        self.app = app
        self.violations = violations
        self.name = name
        self.always_index = always_index
        #: The participant kind a v2 server's replies named first (it must never change).
        self.kind_v2: str | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path.startswith(V2_PREFIX) and V2_METHODS.get(path[len(V2_PREFIX) :]) == scope["method"]:
            await self._judge_v2(path[len(V2_PREFIX) :], scope, receive, send)
            return
        if path != CAPABILITIES_PATH and path not in _BY_PATH:
            await self.app(scope, receive, send)
            return
        assert path.startswith(PREFIX)
        key = _BY_PATH.get(path)
        method: str = scope["method"]
        if method != ("GET" if key is None else ROUTES[key].method):
            await self.app(scope, receive, send)  # a wrong method: FastAPI's 405, nothing to judge
            return
        chunks: list[bytes] = []

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        status: list[int] = []
        reply: list[bytes] = []

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                reply.append(message.get("body", b""))
            await send(message)

        await self.app(scope, recording_receive, recording_send)
        request = _json(b"".join(chunks))
        query = dict(parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1")))
        agent = next((v for k, v in scope.get("headers", []) if k == b"user-agent"), b"").decode("latin-1")
        if key is not None and agent.startswith(COORDINATOR_AGENT):
            self.violations.count(request=True)
            problem = check_request(key, method, request, query)
            if problem:
                self.violations.add(f"{self.name}: {problem}")
        if not status or status[0] not in (200, 409) or scope.get(FAULTED):
            return
        self.violations.count(request=False)
        problem = check_reply(key, status[0], _json(b"".join(reply)), request, always_index=self.always_index)
        if problem:
            self.violations.add(f"{self.name} {method} {path}: {problem}")

    async def _judge_v2(self, op: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one v2 control request, then judge what the coordinator sent and what came back."""
        chunks: list[bytes] = []
        status: list[int] = []
        reply: list[bytes] = []

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                reply.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            self._judge_v2_exchange(op, scope, b"".join(chunks), status, b"".join(reply))

    def _judge_v2_exchange(
        self, op: str, scope: Scope, raw_request: bytes, status: list[int], raw_reply: bytes
    ) -> None:
        request = _json(raw_request)
        query = dict(parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1")))
        agent = next((v for k, v in scope.get("headers", []) if k == b"user-agent"), b"").decode("latin-1")
        # a fault that answered without reading the body leaves nothing to judge of the request
        unread = scope.get(FAULTED) and not raw_request
        if agent.startswith(COORDINATOR_AGENT) and not unread:
            self.violations.count(request=True)
            problem = check_request_v2(op, request, query)
            if problem:
                self.violations.add(f"{self.name}: {problem}")
        # No reply (the app raised: uvicorn answers 500 itself), or a fault injected on purpose.
        if scope.get(FAULTED):
            return
        code = status[0] if status else 500
        body = _json(raw_reply)
        self.violations.count(request=False)
        if code == 200:
            named = kind_of_reply_v2(op, body)
            if named is not None and self.kind_v2 is not None and named != self.kind_v2:
                self.violations.add(
                    f"{self.name} v2 {op}: kind {named}, but it answered as {self.kind_v2} before"
                )
            self.kind_v2 = self.kind_v2 or named
        problem = check_reply_v2(op, code, body, request, self.kind_v2)
        if problem:
            self.violations.add(f"{self.name} {scope['method']} {V2_PREFIX}{op}: {problem}")


def _json(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def wrap_v2_maker(
    original: Callable[[ServerSpec, HostContext], V2Server], violations: Violations
) -> Callable[[ServerSpec, HostContext], V2Server]:
    """`gymsim.host.make_v2_server`, with every v2 reference server it makes wrapped by the oracle."""

    def make(spec: ServerSpec, ctx: HostContext) -> V2Server:
        server = original(spec, ctx)
        server.asgi = OracleMiddleware(server.asgi, violations, server.name)
        return server

    return make


@pytest.fixture(autouse=True)
def oracle_v2(wire_oracle: Violations) -> Violations:
    """The suite's oracle list under its v2 name: tests/conftest.py wraps every reference server of
    both planes for the whole session (`wrap_v2_maker`), so v2 drift fails the test like v1's."""
    return wire_oracle
