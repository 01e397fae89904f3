"""The two requests of every save served without FastAPI's per-request machinery.

A save through the service is `POST /v1/attempts` then `POST /v1/attempts/{id}/publish`. For
each, FastAPI solves the route's dependencies (the bearer check), validates the body, validates
the returned model again and serializes it: measured on the bench machine with the service's own
app and a stub coordinator, about 0.4 ms of CPU per request, most of what one request of a save
cost the service beyond the bare loopback hop. `hot_route` gives such a route a direct path for
the ordinary request, and leaves every other request to FastAPI.

Rules kept here:
- The route stays the declared FastAPI route (`APIRoute`): same path, body and reply models,
  same OpenAPI document. Only its request handler changes.
- The direct path takes a request only when all of this holds: at most one `Authorization`
  header and the service's `BearerCheck` allows it; no body, or a JSON body
  (`Content-Type: application/json`) that `json.loads` reads and the route's body model
  validates (the same validation FastAPI applies to the same decoded value). It then calls the
  route's own endpoint function and sends what it returns as `model_dump_json()` — the bytes
  FastAPI's serializer writes for that model — with the route's success status.
- Anything else (no or a wrong token, a bad body, another content type) goes to FastAPI's own
  handler with the body already read: the 401, the 422 and every other reply are FastAPI's,
  unchanged (in the service, `guard` has already refused another content type). An error the
  endpoint raises propagates as from FastAPI's handler (the app's exception handlers turn it
  into the error reply).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from quiesce.tools.serve.auth import BearerCheck

__all__ = ["hot_route"]

Endpoint = Callable[..., Awaitable[BaseModel]]
Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def hot_route(
    endpoint: Endpoint, *, body: type[BaseModel], check: BearerCheck, status_code: int = 200
) -> type[APIRoute]:
    """An `APIRoute` class for `endpoint` (whose body parameter is `request: body | None`) that
    serves the ordinary request directly (see the module docstring)."""

    async def direct(request: Request) -> Response | None:
        authorization = request.headers.getlist("authorization")
        if len(authorization) > 1 or not check.allows(authorization[0] if authorization else None):
            return None
        raw = await request.body()
        parsed: BaseModel | None = None
        if raw:
            media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != "application/json":
                return None
            try:
                parsed = body.model_validate(json.loads(raw))
            except (ValueError, ValidationError):  # json.JSONDecodeError is a ValueError
                return None
        reply = await endpoint(**request.path_params, request=parsed)
        return Response(reply.model_dump_json(), status_code=status_code, media_type="application/json")

    class HotRoute(APIRoute):
        def get_route_handler(self) -> Handler:
            declared = super().get_route_handler()

            async def handler(request: Request) -> Response:
                reply = await direct(request)
                return reply if reply is not None else await declared(request)

            return handler

    return HotRoute
