"""`hot_route`: the direct path of a save's two requests, narrow (an in-process FastAPI app).

Each case sends the same request to a hot route and to its twin, the same endpoint declared as a
plain FastAPI route, and compares the replies byte for byte. Shown:
- an ordinary request (right token, a JSON body or none) is served directly — the route's
  dependencies are not solved — with FastAPI's status, headers and body bytes;
- every other request (no, a wrong or two bearer tokens, a body the model refuses, malformed
  JSON, JSON `null`, another content type) gets FastAPI's own reply, byte for byte (401, 422);
- an error the endpoint raises reaches the app's exception handler on both paths alike;
- the OpenAPI operation of the hot route is the twin's.
The same routes against a real service: tests/serve/test_api.py (two-step save, 401, 409).
"""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from quiesce.tools.serve.auth import BearerCheck
from quiesce.tools.serve.fastpath import hot_route

pytestmark = pytest.mark.anyio

TOKEN = "api-token-for-the-test"


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(default=1, gt=0)


class Item(BaseModel):
    item_id: str
    n: int
    tags: list[str]
    note: str | None = None


class Refused(Exception):
    pass


def _app() -> tuple[FastAPI, dict[str, int]]:
    counts = {"dependency": 0, "endpoint": 0}
    check = BearerCheck(TOKEN)
    app = FastAPI()

    async def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        counts["dependency"] += 1
        if not check.allows(authorization):
            raise HTTPException(
                401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=409)

    async def endpoint(item_id: str, request: Body | None = None) -> Item:
        counts["endpoint"] += 1
        if item_id == "refused":
            raise Refused(f"item {item_id} refused")
        return Item(item_id=item_id, n=request.n if request else 0, tags=["ü", '"quoted"'])

    for path, route_class in (
        ("/hot/{item_id}", hot_route(endpoint, body=Body, check=check, status_code=201)),
        ("/twin/{item_id}", None),
    ):
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            status_code=201,
            dependencies=[Depends(authorized)],
            route_class_override=route_class,
        )
    return app, counts


def _same(hot: httpx.Response, twin: httpx.Response) -> None:
    assert hot.status_code == twin.status_code
    assert hot.content == twin.content
    assert dict(hot.headers) == dict(twin.headers)


async def _client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_an_ordinary_request_is_served_directly_with_fastapis_reply() -> None:
    app, counts = _app()
    right = {"Authorization": f"Bearer {TOKEN}"}
    async with await _client(app) as http:
        charset = {"Content-Type": "application/json; charset=utf-8"}
        requests: list[tuple[dict[str, str], dict[str, Any]]] = [
            ({}, {"json": {"n": 7}}),
            ({}, {"json": {}}),
            ({}, {}),
            (charset, {"content": b'{"n": 3}'}),
        ]
        for extra, request in requests:
            headers = {**right, **extra}
            before = dict(counts)
            hot = await http.post("/hot/a1", headers=headers, **request)
            assert counts["dependency"] == before["dependency"]  # served directly: nothing solved
            assert counts["endpoint"] == before["endpoint"] + 1
            twin = await http.post("/twin/a1", headers=headers, **request)
            assert counts["dependency"] == before["dependency"] + 1
            assert hot.status_code == 201, hot.text
            _same(hot, twin)
        assert (await http.post("/hot/a1", headers=right, json={"n": 7})).json()["n"] == 7
        assert (await http.post("/hot/a1", headers=right)).json()["n"] == 0


async def test_every_other_request_gets_fastapis_own_reply() -> None:
    app, counts = _app()
    right = f"Bearer {TOKEN}"
    cases: list[dict[str, Any]] = [
        {},  # no token
        {"headers": {"Authorization": "Bearer wrong"}},
        {"headers": {"Authorization": f"Basic {TOKEN}"}},
        {"headers": [("Authorization", right), ("Authorization", "Bearer wrong")]},
        {"headers": {"Authorization": right}, "json": {"n": 0}},  # the model refuses it
        {"headers": {"Authorization": right}, "json": {"n": 1, "extra": True}},
        {"headers": {"Authorization": right, "Content-Type": "application/json"}, "content": b"{nope"},
        {"headers": {"Authorization": right, "Content-Type": "application/json"}, "content": b"null"},
        {"headers": {"Authorization": right, "Content-Type": "application/vnd.test+json"}, "content": b"{}"},
        {"headers": {"Authorization": right, "Content-Type": "text/plain"}, "content": b'{"n": 2}'},
    ]
    async with await _client(app) as http:
        statuses = []
        for request in cases:
            before = dict(counts)
            hot = await http.post("/hot/b2", **request)
            between = dict(counts)
            twin = await http.post("/twin/b2", **request)
            # FastAPI's own handler on both: the same work done (dependencies solved, or not
            # reached when the JSON is malformed), the same reply
            for key in counts:
                assert between[key] - before[key] == counts[key] - between[key], (key, request)
            _same(hot, twin)
            statuses.append(hot.status_code)
    # what FastAPI answers: no/wrong/non-bearer token 401; two headers: it reads the first; a
    # refused body 422; JSON null: no body; a +json type is JSON to it; text/plain is not
    assert statuses == [401, 401, 401, 201, 422, 422, 422, 201, 201, 422]


async def test_an_error_the_endpoint_raises_reaches_the_apps_handler() -> None:
    app, counts = _app()
    async with await _client(app) as http:
        right = {"Authorization": f"Bearer {TOKEN}"}
        hot, twin = (
            await http.post("/hot/refused", headers=right),
            await http.post("/twin/refused", headers=right),
        )
    assert counts["dependency"] == 1  # the twin only: the hot route raised from its direct path
    assert hot.status_code == 409
    _same(hot, twin)


def test_the_openapi_operation_is_the_declared_routes() -> None:
    app, _ = _app()
    paths = app.openapi()["paths"]
    hot, twin = dict(paths["/hot/{item_id}"]["post"]), dict(paths["/twin/{item_id}"]["post"])
    for operation in (hot, twin):
        del operation["operationId"], operation["summary"]  # named for the path
    assert hot == twin
    assert "requestBody" in hot
    assert "201" in hot["responses"]
