"""What every reference server shares: the middleware stack, auth, control log, admin routes.

Request path through one server (outermost first):

1. `ControlMiddleware` — for every path under `/ng-control/v1`: appends an entry to
   the control log (method, path, checkpoint id, whether the bearer token matched —
   never the token itself — and the status the client got), then enforces the bearer
   token on everything but `GET /capabilities` (401 before any body validation; with the spec's
   `body_before_auth`, as Gym's own routes, the control endpoint answers the 401 once its body or
   query validated, so a request with neither a valid token nor a valid body gets 422).
2. the component's data-plane gate (the model's admission and in-flight tracking);
3. `FaultMiddleware` — injected faults (see `faults.py`);
4. `LeanControl` — the control routes' fast path: a request FastAPI would hand to a
   control endpoint with a valid argument is handed to that same endpoint here,
   without FastAPI's per-request machinery; every other request goes on to
5. the FastAPI app: control routes (bodies validated by `quiesce.coordinator.protocol`
   models → 422 on anything else), data-plane routes, admin routes.

Admin routes (`/gymsim/admin/...`) need no token: they exist for tests and never
touch the fence.
"""

from __future__ import annotations

import functools
import hmac
import inspect
import json
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin, get_type_hints
from urllib.parse import parse_qs, parse_qsl

import httpx
from fastapi import Body, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.params import Query
from pydantic import BaseModel
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quiesce.coordinator.protocol import (
    CAPABILITIES_PATH,
    PREFIX,
    SCHEMA_VERSION,
    UNAUTHORIZED_DETAIL,
    Capabilities,
    CommonBody,
    ConcurrencyContract,
    MultiProcess,
)
from quiesce.tools.gymsim.common import INTERNAL_ERROR, ControlRejection, error_response
from quiesce.tools.gymsim.faults import UNDELIVERED, Fault, FaultMiddleware, FaultSet
from quiesce.tools.gymsim.fence import Action, Fence, OpRule
from quiesce.tools.gymsim.spec import ServerSpec

#: Scope key: `(body, json.loads(body))` of a control POST, so the body is parsed once per request.
PARSED_BODY = "gymsim.parsed_body"


#: Set by `ControlMiddleware` for a request without a valid token that its control endpoint refuses
#: (with 401) only once its argument validated (`body_before_auth`).
_REFUSE_AFTER_VALIDATION: ContextVar[bool] = ContextVar("gymsim_refuse_after_validation", default=False)


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
    #: each peer's instance name (what it reports and writes under; its spec name by default)
    instances: dict[str, str] = field(default_factory=dict)
    http: HttpHolder = field(default_factory=HttpHolder)
    #: replace the named server by a fresh one, as a restarted process would be (set by the host)
    restart: Callable[[str], None] | None = None

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
            else:
                scope[PARSED_BODY] = (body, document)
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
        deferred = False
        if path != CAPABILITIES_PATH and not authorized:
            if not self.server.spec.body_before_auth:
                entry["status"] = 401
                await JSONResponse(status_code=401, content={"detail": UNAUTHORIZED_DETAIL})(
                    scope, replay, send
                )
                return
            deferred = True

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)

        refusal = _REFUSE_AFTER_VALIDATION.set(deferred)
        try:
            await self.app(scope, replay, logged_send)
        finally:
            _REFUSE_AFTER_VALIDATION.reset(refusal)
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


Endpoint = Callable[..., Awaitable[Response]]
E = TypeVar("E", bound=Endpoint)


@dataclass(frozen=True)
class LeanRoute:
    """A control endpoint and the model of its one argument: the JSON body (POST) or the query (GET)."""

    endpoint: Endpoint
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None


def lean_route(method: Literal["GET", "POST"], endpoint: Endpoint) -> LeanRoute:
    """The `LeanRoute` of a FastAPI endpoint of one of the shapes FastAPI reads the same way.

    POST: one parameter annotated with a pydantic model (FastAPI: the whole JSON body).
    GET: no parameter, or one annotated `Annotated[Model, Query()]` (FastAPI: a query model).
    Any other shape raises `TypeError`: its arguments would not be read as FastAPI reads them.
    """
    hints = get_type_hints(endpoint, include_extras=True)
    parameters = list(inspect.signature(endpoint).parameters)
    if method == "GET" and not parameters:
        return LeanRoute(endpoint)
    if len(parameters) == 1:
        hint = hints.get(parameters[0])
        if method == "POST" and isinstance(hint, type) and issubclass(hint, BaseModel):
            return LeanRoute(endpoint, body=hint)
        if method == "GET" and get_origin(hint) is Annotated:
            model, *marks = get_args(hint)
            if (
                isinstance(model, type)
                and issubclass(model, BaseModel)
                and any(isinstance(mark, Query) for mark in marks)
            ):
                return LeanRoute(endpoint, query=model)
    raise TypeError(f"{method} endpoint {endpoint.__name__} has no shape the lean control path reads")


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """True when the request's content type is exactly `application/json` (parameters allowed)."""
    for key, value in headers:
        if key == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class LeanControl:
    """Serves the control routes without FastAPI's per-request routing, dependency and exception stack.

    Invariant: a request is answered here only when FastAPI would call the same endpoint
    with an equal argument — exact method and route path; for a POST, a non-empty body
    with content type `application/json` that parses as JSON and validates against the
    endpoint's model; for a GET, a query string with no repeated name that validates
    against the query model. Every other request (unknown route, wrong method, any input
    FastAPI would reject or read differently) goes to `fallback`, the FastAPI app, so
    every status code and error body stays FastAPI's own. An endpoint that raises is
    answered as FastAPI's outermost middleware answers it (500, `Internal Server Error`)
    and the exception goes on to the server; control endpoints raise no `HTTPException`.
    """

    def __init__(self, routes: dict[tuple[str, str], LeanRoute], fallback: ASGIApp) -> None:
        self.routes = routes
        self.fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lean = self.routes.get((scope["method"], route_path(scope))) if scope["type"] == "http" else None
        if lean is None:
            await self.fallback(scope, receive, send)
            return
        args: tuple[BaseModel, ...] = ()
        if lean.body is not None:
            body, receive = await _buffer_body(receive)
            try:
                if not body or not _is_json(scope.get("headers", [])):
                    raise ValueError("not a JSON body")
                parsed = scope.get(PARSED_BODY)
                document = parsed[1] if parsed is not None and parsed[0] == body else json.loads(body)
                args = (lean.body.model_validate(document),)
            except Exception:  # whatever FastAPI makes of this input, it makes it itself
                await self.fallback(scope, receive, send)
                return
        elif lean.query is not None:
            pairs = parse_qsl(bytes(scope.get("query_string", b"")).decode("latin-1"), keep_blank_values=True)
            values = dict(pairs)
            try:
                if len(values) != len(pairs):
                    raise ValueError("a repeated query parameter")
                args = (lean.query.model_validate(values),)
            except Exception:
                await self.fallback(scope, receive, send)
                return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            response = await lean.endpoint(*args)
            await response(scope, receive, tracked_send)
        except Exception:
            if not started:
                await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
            raise


#: Control requests a server remembers for `/gymsim/admin/control-log` (the oldest go first).
CONTROL_LOG_MAX = 10_000


class GymServer(ABC):
    """Base of the model, agent and resources servers: fence, capabilities, admin routes."""

    component: ClassVar[str]
    concurrency_contract: ClassVar[ConcurrencyContract] = "stateless"
    features: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: ServerSpec, ctx: HostContext) -> None:
        self.spec = spec
        self.name = spec.name
        #: the name it reports in its capabilities and writes its files under (spec `instance`,
        #: else its name): replicas of one Gym config repeat it
        self.instance = spec.instance_name
        self.ctx = ctx
        self.latency_s = spec.latency_s
        self.fence = Fence(self.fence_rules())
        self.faults = FaultSet()
        self.faults.set(list(spec.faults))
        #: the last CONTROL_LOG_MAX control requests (a long benchmark must not grow the heap)
        self.control_log: deque[dict[str, Any]] = deque(maxlen=CONTROL_LOG_MAX)
        self.app = FastAPI(title=f"gymsim {self.name}", openapi_url=None, docs_url=None, redoc_url=None)
        self.lean = LeanControl({}, self.app)
        self._add_common_routes()
        self.add_routes()
        self.asgi: ASGIApp = ControlMiddleware(
            self, self.wrap_gate(FaultMiddleware(self.lean, self.faults, path_of=route_path))
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

    def feature_list(self) -> list[str]:
        """The capability `features` this server declares (the class's, unless a server adds some)."""
        return list(self.features)

    def worker_mode(self) -> str:
        """`multi_process.mode`: the spec's `worker_mode`, else unmanaged for more than one worker."""
        if self.spec.worker_mode is not None:
            return self.spec.worker_mode
        return "unmanaged" if self.spec.workers > 1 else "single_worker"

    def debug_state(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        """Stop background work (rollout tasks) before the process exits."""
        self.faults.clear()

    # -- shared ------------------------------------------------------------------------------

    def control_route(self, method: Literal["GET", "POST"], path: str) -> Callable[[E], E]:
        """Decorator: serve `endpoint` at `method path` from the FastAPI app and from `LeanControl`."""

        def register(endpoint: E) -> E:
            @functools.wraps(endpoint)
            async def guarded(*args: Any, **kwargs: Any) -> Any:
                if _REFUSE_AFTER_VALIDATION.get():  # its argument validated: now the token's 401
                    return JSONResponse(status_code=401, content={"detail": UNAUTHORIZED_DETAIL})
                return await endpoint(*args, **kwargs)

            self.lean.routes[(method, path)] = lean_route(method, guarded)
            self.app.add_api_route(path, guarded, methods=[method])
            return endpoint

        return register

    def capabilities(self) -> Capabilities:
        workers = self.spec.workers
        return Capabilities.model_validate(
            {
                "component": self.component,
                "name": self.instance,
                "schema_version": SCHEMA_VERSION,
                "admission_states": ["accepting", "draining", "paused"],
                "checkpoint_mode": self.checkpoint_mode(),
                "concurrency_contract": self.concurrency_contract,
                "multi_process": MultiProcess.model_validate(
                    {"mode": self.worker_mode(), "num_workers": workers}
                ),
                "instance_role": self.instance_role(),
                "features": self.feature_list(),
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

        @self.control_route("GET", CAPABILITIES_PATH)
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

        @app.post("/gymsim/admin/restart")
        async def restart() -> JSONResponse:
            # a process restart: the fence, admission and every rollout, session and capture of
            # this server are gone; the next request reaches a fresh server on the same port
            if self.ctx.restart is None:
                return JSONResponse({"error": "this host cannot restart a server"}, status_code=501)
            self.ctx.restart(self.name)
            return JSONResponse({"restarted": self.name})

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
