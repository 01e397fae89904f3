"""What every reference server shares: the middleware stack, auth, control log, admin routes.

Request path through one server (outermost first):

1. `ControlMiddleware` — for every path under `/ng-control/v1`: appends an entry to
   the control log (method, path, checkpoint id, whether the bearer token matched —
   never the token itself — and the status the client got), then enforces the bearer
   token on everything but `GET /capabilities` (401 before any body validation).
2. the component's data-plane gate (the model's admission and in-flight tracking);
3. `FaultMiddleware` — injected faults (see `faults.py`);
4. the FastAPI app: control routes (bodies validated by `coordinator.protocol`
   models → 422 on anything else), data-plane routes, admin routes.

Admin routes (`/gymsim/admin/...`) need no token: they exist for tests and never
touch the fence.
"""

from __future__ import annotations

import hmac
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qs

import httpx
from fastapi import Body, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.protocol import (
    CAPABILITIES_PATH,
    PREFIX,
    SCHEMA_VERSION,
    UNAUTHORIZED_DETAIL,
    Capabilities,
    CommonBody,
    ConcurrencyContract,
    MultiProcess,
)
from tools.gymsim.common import INTERNAL_ERROR, ControlRejection, error_response
from tools.gymsim.faults import UNDELIVERED, Fault, FaultMiddleware, FaultSet
from tools.gymsim.fence import Action, Fence, OpRule
from tools.gymsim.spec import ServerSpec


def route_path(scope: Scope) -> str:
    """The request path as the server sees it (without a hosting prefix in `root_path`)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


class HttpHolder:
    """One shared httpx client per hosting process, created on first use inside the event loop."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    def get(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                trust_env=False,
                timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None),
                limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


@dataclass
class HostContext:
    """What a server gets from its hosting process: the token, peers' URLs, the HTTP client."""

    token: str | None
    peers: dict[str, str] = field(default_factory=dict)
    http: HttpHolder = field(default_factory=HttpHolder)

    def peer_url(self, name_or_url: str) -> str:
        if name_or_url.startswith(("http://", "https://")):
            return name_or_url.rstrip("/")
        try:
            return self.peers[name_or_url]
        except KeyError:
            raise RuntimeError(f"unknown peer server {name_or_url!r}") from None


def bearer_ok(headers: list[tuple[bytes, bytes]], token: str | None) -> bool:
    """Constant-time check of `Authorization: Bearer <token>`; no configured token → never ok."""
    if not token:
        return False
    value = next((v for k, v in headers if k == b"authorization"), None)
    if value is None or value[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(value[7:].strip(), token.encode("utf-8"))


class ControlMiddleware:
    """Auth and the control log for every `/ng-control/v1` path of one server."""

    def __init__(self, server: GymServer, app: ASGIApp) -> None:
        self.server = server
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        authorized = bearer_ok(scope.get("headers", []), self.server.ctx.token)
        checkpoint_id: str | None = None
        replay = receive
        if method == "POST":
            body, replay = await _buffer_body(receive)
            try:
                document = json.loads(body) if body else None
            except ValueError:
                document = None
            if isinstance(document, dict) and isinstance(document.get("checkpoint_id"), str):
                checkpoint_id = document["checkpoint_id"]
        else:
            values = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1")).get("checkpoint_id")
            checkpoint_id = values[0] if values else None
        entry: dict[str, Any] = {
            "method": method,
            "path": path,
            "checkpoint_id": checkpoint_id,
            "authorized": authorized,
            "status": None,
        }
        self.server.control_log.append(entry)
        if path != CAPABILITIES_PATH and not authorized:
            entry["status"] = 401
            await JSONResponse(status_code=401, content={"detail": UNAUTHORIZED_DETAIL})(scope, replay, send)
            return

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, replay, logged_send)
        finally:
            if scope.get(UNDELIVERED):
                entry["status"] = None


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by its text (JSON has no NaN/Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


async def _buffer_body(receive: Receive) -> tuple[bytes, Receive]:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


class GymServer(ABC):
    """Base of the model, agent and resources servers: fence, capabilities, admin routes."""

    component: ClassVar[str]
    concurrency_contract: ClassVar[ConcurrencyContract] = "stateless"
    features: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: ServerSpec, ctx: HostContext) -> None:
        self.spec = spec
        self.name = spec.name
        self.ctx = ctx
        self.latency_s = spec.latency_s
        self.fence = Fence(self.fence_rules())
        self.faults = FaultSet()
        self.faults.set(list(spec.faults))
        self.control_log: list[dict[str, Any]] = []
        self.app = FastAPI(title=f"gymsim {self.name}", openapi_url=None, docs_url=None, redoc_url=None)
        self._add_common_routes()
        self.add_routes()
        self.asgi: ASGIApp = ControlMiddleware(
            self, self.wrap_gate(FaultMiddleware(self.app, self.faults, path_of=route_path))
        )

    # -- hooks -------------------------------------------------------------------------------

    @abstractmethod
    def fence_rules(self) -> dict[str, OpRule]:
        """The phase table of this component (spec §1.1): operation → allowed phases and outcome."""

    @abstractmethod
    def add_routes(self) -> None:
        """Mount this component's data-plane and control routes on `self.app`."""

    def wrap_gate(self, app: ASGIApp) -> ASGIApp:
        return app

    def checkpoint_mode(self) -> str:
        return self.spec.checkpoint_mode

    def instance_role(self) -> str | None:
        return None

    def admission_state(self) -> str:
        return "accepting"

    def debug_state(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        """Stop background work (rollout tasks) before the process exits."""
        self.faults.clear()

    # -- shared ------------------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        workers = self.spec.workers
        return Capabilities.model_validate(
            {
                "component": self.component,
                "name": self.name,
                "schema_version": SCHEMA_VERSION,
                "admission_states": ["accepting", "draining", "paused"],
                "checkpoint_mode": self.checkpoint_mode(),
                "concurrency_contract": self.concurrency_contract,
                "multi_process": MultiProcess(
                    mode="unmanaged" if workers > 1 else "single_worker", num_workers=workers
                ),
                "instance_role": self.instance_role(),
                "features": list(self.features),
                **self.fence.snapshot(),
            }
        )

    async def control(self, operation: str, body: CommonBody, action: Action) -> JSONResponse:
        """Run one POST control operation through the fence and answer it."""
        try:
            result = await self.fence.run(operation, body, action)
        except ControlRejection as rejection:
            return rejection.response()
        except Exception as exc:
            return error_response(500, INTERNAL_ERROR, f"{operation} failed: {exc!r}")
        return JSONResponse(result)

    async def query(self, build: Callable[[], Awaitable[dict[str, Any]]]) -> JSONResponse:
        """Answer a status GET; `build` raises `ControlRejection` for refusals."""
        try:
            return JSONResponse(await build())
        except ControlRejection as rejection:
            return rejection.response()

    def _add_common_routes(self) -> None:
        app = self.app

        @app.exception_handler(RequestValidationError)
        async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
            # FastAPI's default body, made renderable when the input held NaN or infinity.
            return JSONResponse(status_code=422, content={"detail": _finite(jsonable_encoder(exc.errors()))})

        @app.get(CAPABILITIES_PATH)
        async def capabilities() -> JSONResponse:
            return JSONResponse(self.capabilities().model_dump(mode="json"))

        @app.get("/gymsim/admin/faults")
        async def list_faults() -> JSONResponse:
            return JSONResponse({"faults": self.faults.describe()})

        @app.post("/gymsim/admin/faults")
        async def set_faults(
            faults: list[Fault] = Body(embed=True),  # noqa: B008
            replace: bool = Body(default=True, embed=True),
        ) -> JSONResponse:
            self.faults.set(faults, replace=replace)
            return JSONResponse({"faults": self.faults.describe()})

        @app.delete("/gymsim/admin/faults")
        async def clear_faults() -> JSONResponse:
            self.faults.clear()
            return JSONResponse({"faults": []})

        @app.get("/gymsim/admin/control-log")
        async def control_log() -> JSONResponse:
            return JSONResponse(list(self.control_log))

        @app.post("/gymsim/admin/reset-log")
        async def reset_log() -> JSONResponse:
            self.control_log.clear()
            return JSONResponse({"ok": True})

        @app.post("/gymsim/admin/options")
        async def set_options(latency_s: float = Body(embed=True, ge=0, allow_inf_nan=False)) -> JSONResponse:
            self.latency_s = latency_s
            return JSONResponse({"latency_s": self.latency_s})

        @app.get("/gymsim/admin/state")
        async def state() -> JSONResponse:
            return JSONResponse(
                {
                    "name": self.name,
                    "component": self.component,
                    "admission_state": self.admission_state(),
                    "latency_s": self.latency_s,
                    **self.fence.snapshot(),
                    **self.debug_state(),
                }
            )
