"""The lean control path (`LeanControl`) answers exactly as the FastAPI app does.

Two clusters of the same spec get the same requests in the same order: one serves
its control routes through `LeanControl`, the other has it switched off (every
request goes to FastAPI). Status, content type and body must match request by
request — valid calls through a whole cycle, and every kind of input FastAPI
rejects or reads its own way. The lean cluster's fallback is watched too: valid
control calls must be answered by the lean path itself, everything else by FastAPI.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Query
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from quiesce.coordinator.protocol import CAPABILITIES_PATH, CommonBody, StatusQuery, route
from quiesce.tools.gymsim.base import LeanControl, lean_route
from quiesce.tools.gymsim.cluster import RunningCluster, start_cluster
from tests.gymsim.conftest import SPEC, TOKEN, auth

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

COMPONENTS = {
    "policy_model": "responses_api_models",
    "judge": "responses_api_models",
    "simple_agent": "responses_api_agents",
    "math_agent": "responses_api_agents",
    "tools": "resources_servers",
}
JSON = {"content-type": "application/json"}
#: Marks where a request body holds the cluster's own checkpoint folder.
DIR = "@DIR@"


class FallbackLog:
    """Wraps a `LeanControl`'s fallback and records the (method, path) of each request it gets."""

    def __init__(self, lean: LeanControl) -> None:
        self.inner = lean.fallback
        self.seen: list[tuple[str, str]] = []
        lean.fallback = self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append((scope["method"], scope["path"]))
        await self.inner(scope, receive, send)


@pytest.fixture
def clusters() -> Iterator[tuple[RunningCluster, RunningCluster]]:
    with start_cluster(SPEC, token=TOKEN) as lean, start_cluster(SPEC, token=TOKEN) as plain:
        for server in plain.servers.values():
            server.lean.routes.clear()
        yield lean, plain


def _requests(component: str, deadline: float) -> list[tuple[str, str, dict[str, str], bytes | str]]:
    """(method, path + query, headers, body) of one server's sequence; `str` bodies may hold DIR."""
    post = {
        "responses_api_models": ("pause", "commit", "resume"),
        "responses_api_agents": ("prepare", "commit", "resume"),
        "resources_servers": ("prepare", "commit", "resume"),
    }[component]
    begin, commit, resume = (route(component, op).full_path for op in post)
    status = route(component, "status").full_path
    restore = route(component, "restore").full_path

    def doc(cid: str = "c1", **extra: Any) -> str:
        return json.dumps({"checkpoint_id": cid, "deadline_ts": deadline, **extra})

    with_dir = doc(checkpoint_dir=DIR)
    if component == "responses_api_models":
        with_dir = doc(checkpoint_dir=DIR, continuation_indexes=[])
    bad_inputs: list[tuple[dict[str, str], bytes | str]] = [
        (JSON, b""),
        (JSON, b"{"),
        (JSON, b"[]"),
        (JSON, b'"c1"'),
        (JSON, b"\xff\xfe{"),
        (JSON, json.dumps({"checkpoint_id": "c1"})),
        (JSON, doc(schema_version=True)),
        (JSON, doc(schema_version=2)),
        (JSON, doc("bad id!")),
        (JSON, doc(unknown_field=1)),
        (JSON, '{"checkpoint_id": "c1", "deadline_ts": NaN}'),
        (JSON, '{"checkpoint_id": "c1", "deadline_ts": Infinity}'),
        ({"content-type": "text/plain"}, doc()),
        ({}, doc()),
        ({"content-type": "application/vnd.gym+json"}, doc()),
        ({"content-type": "application/x-www-form-urlencoded"}, "checkpoint_id=c1&deadline_ts=1"),
    ]
    sequence: list[tuple[str, str, dict[str, str], bytes | str]] = [
        ("GET", CAPABILITIES_PATH, {}, b""),
        ("GET", CAPABILITIES_PATH + "?checkpoint_id=c1&checkpoint_id=c2", {}, b""),
        ("GET", f"{status}?checkpoint_id=c1", {}, b""),
        ("GET", status, {}, b""),
        ("GET", f"{status}?checkpoint_id=c1&checkpoint_id=c2", {}, b""),
        ("GET", f"{status}?checkpoint_id=bad%20id", {}, b""),
        ("GET", f"{status}?checkpoint_id=c1&timeout_s=-1", {}, b""),
        ("GET", f"{status}?checkpoint_id=c1&deadline_ts=nan", {}, b""),
        ("GET", f"{status}?checkpoint_id=c1&wait_state=draining", {}, b""),
        ("GET", f"{status}?checkpoint_id=c1&other=1&timeout_s=", {}, b""),
        ("PUT", begin, JSON, doc()),
        ("GET", begin, {}, b""),
        ("POST", status, JSON, doc()),
        ("POST", begin + "/", JSON, doc()),
        *(("POST", begin, headers, body) for headers, body in bad_inputs),
        ("POST", commit, JSON, doc()),  # no checkpoint_dir / invalid phase
        ("POST", begin, {"content-type": "application/json; charset=utf-8"}, doc()),
        ("POST", begin, {"content-type": "Application/JSON"}, doc()),  # replayed
        ("POST", begin, JSON, doc("c2")),  # another id is active
        ("GET", f"{status}?checkpoint_id=c1&timeout_s=0", {}, b""),
        ("GET", f"{status}?checkpoint_id=c2&timeout_s=0", {}, b""),
        ("POST", restore, JSON, doc(checkpoint_dir=DIR)),
        ("POST", commit, JSON, with_dir),
        ("POST", commit, JSON, with_dir),  # replayed
        ("POST", resume, JSON, doc()),
        ("POST", resume, JSON, doc()),  # replayed after retirement
        ("POST", begin, JSON, doc()),  # stale
        ("GET", f"{status}?checkpoint_id=c1", {}, b""),
        ("POST", restore, JSON, doc("c3", checkpoint_dir=DIR + "/nothing-here")),
        ("POST", resume, JSON, doc("c3")),
        ("GET", CAPABILITIES_PATH, {}, b""),
    ]
    return sequence


def _answer(reply: httpx.Response) -> tuple[int, str | None, bytes]:
    return reply.status_code, reply.headers.get("content-type"), reply.content


async def test_lean_and_fastapi_answer_every_control_request_alike(
    clusters: tuple[RunningCluster, RunningCluster], tmp_path: Path
) -> None:
    lean, plain = clusters
    logs = {name: FallbackLog(server.lean) for name, server in lean.servers.items()}
    deadline = time.time() + 600
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        for name, component in COMPONENTS.items():
            for method, path, headers, body in _requests(component, deadline):
                answers = []
                for side, running in (("lean", lean), ("plain", plain)):
                    content = body.replace(DIR, str(tmp_path / side)) if isinstance(body, str) else body
                    reply = await http.request(
                        method, running.urls[name] + path, content=content, headers={**headers, **auth()}
                    )
                    answers.append(_answer(reply))
                assert answers[0] == answers[1], (name, method, path, headers, body)
    for name, component in COMPONENTS.items():
        # both paths were exercised on every server
        assert 0 < len(logs[name].seen) < len(_requests(component, deadline)), name


async def test_valid_control_calls_never_reach_fastapi(tmp_path: Path) -> None:
    with start_cluster(SPEC, token=TOKEN) as running:
        logs = {name: FallbackLog(server.lean) for name, server in running.servers.items()}
        deadline = time.time() + 600
        async with httpx.AsyncClient(trust_env=False, timeout=60, headers=auth()) as http:
            for name in ("policy_model", "simple_agent", "tools"):
                component = COMPONENTS[name]
                url = running.urls[name]
                common = {"checkpoint_id": "c1", "deadline_ts": deadline}
                with_dir = {**common, "checkpoint_dir": str(tmp_path)}
                begin = "pause" if name == "policy_model" else "prepare"
                calls: list[tuple[str, str, dict[str, Any] | None]] = [
                    ("GET", CAPABILITIES_PATH, None),
                    ("POST", route(component, begin).full_path, common),
                    ("GET", route(component, "status").full_path + "?checkpoint_id=c1&timeout_s=0", None),
                    ("POST", route(component, "commit").full_path, with_dir),
                    ("POST", route(component, "resume").full_path, common),
                ]
                for method, path, document in calls:
                    reply = await http.request(method, url + path, json=document)
                    assert reply.status_code == 200, (name, path, reply.text)
        assert all(log.seen == [] for log in logs.values())


def test_lean_route_reads_only_the_endpoint_shapes_fastapi_reads_the_same_way() -> None:
    async def no_args() -> JSONResponse:
        return JSONResponse({})

    async def body(body: CommonBody) -> JSONResponse:
        return JSONResponse({})

    async def query(q: Annotated[StatusQuery, Query()]) -> JSONResponse:
        return JSONResponse({})

    async def bare_query(q: StatusQuery) -> JSONResponse:  # FastAPI reads this from the body
        return JSONResponse({})

    async def two(body: CommonBody, other: int) -> JSONResponse:
        return JSONResponse({})

    assert lean_route("GET", no_args).body is None
    assert lean_route("POST", body).body is CommonBody
    assert lean_route("GET", query).query is StatusQuery
    for method, endpoint in (("GET", bare_query), ("POST", two), ("POST", no_args), ("GET", body)):
        with pytest.raises(TypeError):
            lean_route(method, endpoint)  # type: ignore[arg-type]
