"""What every v2 reference server shares: the FastAPI app, the control plane, faults, admin routes.

Request path (outermost first): the control log (method, path, checkpoint id, status of every
`/ng-control/v1` request) → `FaultMiddleware` (`faults.py`, path suffixes such as
`/checkpoint/restore`) → the FastAPI app (v2 control routes, data plane, admin routes).

A server whose participant is None (an auxiliary model: a judge) serves no control routes, so
`GET /checkpoint/status` is 404 there: "not a participant". Admin routes (`/gymsim/admin/...`) need
no token and never touch the phase machine (except `restart`, which replaces the whole server).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any, ClassVar

import httpx
from fastapi import Body, FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quiesce.coordinator.protocol import ROLLOUT_ID_HEADER
from quiesce.coordinator.protocol_v2 import DEFAULT_LEASE_GRACE_S, EpisodeId
from quiesce.tools.gymsim.base import HostContext, route_path
from quiesce.tools.gymsim.common import ControlRejection
from quiesce.tools.gymsim.faults import Fault, FaultMiddleware, FaultSet
from quiesce.tools.gymsim.spec import ServerSpec
from quiesce.tools.gymsim.v2.plane import ControlPlane, Participant, install_routes

CONTROL_PREFIX = "/ng-control/v1"
CONTROL_LOG_MAX = 10_000


class ControlLog:
    """Appends `{method, path, checkpoint_id, status}` for every control-plane request."""

    def __init__(self, app: ASGIApp, log: deque[dict[str, Any]]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(CONTROL_PREFIX):
            await self.app(scope, receive, send)
            return
        entry: dict[str, Any] = {"method": scope["method"], "path": route_path(scope), "checkpoint_id": None}
        entry["status"] = None
        self.log.append(entry)
        chunks: list[bytes] = []

        async def reading() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    try:
                        document = json.loads(b"".join(chunks) or b"null")
                    except ValueError:
                        document = None
                    if isinstance(document, dict) and isinstance(document.get("checkpoint_id"), str):
                        entry["checkpoint_id"] = document["checkpoint_id"]
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)

        await self.app(scope, reading, sending)


class DownstreamError(Exception):
    """A peer answered a data-plane call with an error: passed on with its status and body."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body)


class V2Server:
    """Base of the v2 environment, model, agent and resources servers."""

    kind: ClassVar[str]

    def __init__(self, spec: ServerSpec, ctx: HostContext) -> None:
        self.spec = spec
        self.name = spec.name
        self.ctx = ctx
        self.latency_s = spec.latency_s
        self.faults = FaultSet()
        self.faults.set(list(spec.faults))
        self.control_log: deque[dict[str, Any]] = deque(maxlen=CONTROL_LOG_MAX)
        self.app = FastAPI(title=f"gymsim v2 {self.name}", openapi_url=None, docs_url=None, redoc_url=None)
        self.participant: Participant | None = self.make_participant()
        self.plane: ControlPlane | None = None
        if self.participant is not None:
            grace = spec.lease_grace_s if spec.lease_grace_s is not None else DEFAULT_LEASE_GRACE_S
            self.plane = ControlPlane(self.participant, instance=spec.instance_name, lease_grace_s=grace)
            install_routes(self.app, self._plane, ctx.token)
        self._add_admin_routes()
        self.add_routes()
        self.asgi: ASGIApp = ControlLog(
            FaultMiddleware(self.app, self.faults, path_of=route_path), self.control_log
        )

    def _plane(self) -> ControlPlane:
        assert self.plane is not None
        return self.plane

    # -- hooks -------------------------------------------------------------------------------

    def make_participant(self) -> Participant | None:
        return None

    def add_routes(self) -> None:
        """Mount the data plane (and the kind's own admin routes)."""

    def debug_state(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        """Stop background work before the process exits."""
        self.faults.clear()
        if self.plane is not None:
            await self.plane.aclose()

    # -- shared ------------------------------------------------------------------------------

    async def call(
        self, peer: str, path: str, document: dict[str, Any], episode: EpisodeId
    ) -> httpx.Response:
        """POST a data-plane call to a peer; a non-200 answer, or none (a transport error: 502 naming
        it), raises `DownstreamError`."""
        try:
            reply = await self.ctx.http.get().post(
                self.ctx.peer_url(peer) + path,
                json=document,
                headers={ROLLOUT_ID_HEADER: episode.rollout_id},
                timeout=None,
            )
        except httpx.HTTPError as error:
            detail = f"{peer}{path}: {type(error).__name__}: {error}"[:300]
            raise DownstreamError(502, {"error": {"code": "bad_gateway", "detail": detail}}) from None
        if reply.status_code != 200:
            try:
                body = reply.json()
            except ValueError:
                body = {"error": {"code": "bad_gateway", "detail": reply.text[:200]}}
            raise DownstreamError(reply.status_code, body)
        return reply

    async def latency(self) -> None:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)

    def _add_admin_routes(self) -> None:
        app = self.app

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

        @app.get("/gymsim/admin/state")
        async def state() -> JSONResponse:
            document: dict[str, Any] = {"name": self.name, "kind": self.kind, "plane": "v2"}
            if self.plane is not None:
                document.update(self.plane.status())
                document["lease_expirations"] = self.plane.lease_expirations
                assert self.participant is not None
                document["stopped_for_shutdown"] = self.participant.stopped_for_shutdown
                document["retire_marks"] = dict(self.participant.marks.marks)
            document.update(self.debug_state())
            return JSONResponse(document)

        @app.post("/gymsim/admin/restart")
        async def restart() -> JSONResponse:
            if self.ctx.restart is None:
                return JSONResponse({"error": "this host cannot restart a server"}, status_code=501)
            self.ctx.restart(self.name)
            return JSONResponse({"restarted": self.name})


def rejection(exc: ControlRejection | DownstreamError) -> Response:
    return exc.response()
