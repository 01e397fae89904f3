"""A request that does not validate, and `latest` in the event stream, against a real service.

- every 422 is `{"error": {"type": "InvalidRequest", "message", "fields"}}` — body, query, bad JSON,
  not an object, an unknown field, a save's two fast-path requests alike — with each field's
  problem in words and nothing of pydantic's `input`/`url`/`type`, nor the API token sent in the
  body (as a value or as a field name); the OpenAPI document declares that shape for 422;
- `RemoteCoordinator` raises `InvalidRequest` (a `ConfigError`) with those fields;
- `GET /v1/attempts/latest/events` is the newest attempt's stream (404 in that shape before any),
  the same as by its id, and `RemoteCoordinator.events("latest")` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.coordinator import ConfigError
from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.errors import InvalidRequest, NotFound
from tests.coordinator.helpers import read_events
from tests.serve.conftest import ServiceProcess, wait_ready
from tests.serve.test_api import _sse

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

API_TOKEN = "api-0f3c9b7e5d1a4c2b8e6f"
POSITIVE = "must be more than 0"


def _config(cluster: RunningCluster, tmp_path: Path, ledger_url: str) -> Path:
    return cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")


async def test_every_422_has_the_error_shape_and_echoes_nothing(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, sqlite_url), api_token=API_TOKEN)
    await wait_ready(service.url)
    right = {"Authorization": f"Bearer {API_TOKEN}"}
    as_json = {**right, "Content-Type": "application/json"}
    cases: list[tuple[str, str, dict[str, Any], list[tuple[str, str]]]] = [
        # (method, path, request, the fields expected)
        ("POST", "/v1/checkpoints", {"json": {"deadline_s": 0}}, [("body.deadline_s", POSITIVE)]),
        ("POST", "/v1/attempts", {"json": {"deadline_s": -1}}, [("body.deadline_s", POSITIVE)]),
        ("POST", "/v1/attempts/e1-1/publish", {"json": {"resume": "perhaps"}},
         [("body.resume", "must be true or false")]),
        ("POST", "/v1/restore", {"json": {"snapshot": "latest", "typo": 1}},
         [("body.typo", "not a field of this request")]),
        ("POST", "/v1/restore", {"content": b'{"snapshot": ', "headers": as_json},
         [("body", "not valid JSON at character 13: Expecting value")]),
        ("POST", "/v1/abort", {"json": [1, 2]}, [("body", "must be a JSON object")]),
        ("GET", "/v1/attempts?limit=-1", {}, [("query.limit", "must be at least 0")]),
        ("POST", "/v1/acknowledge", {"json": {"server": "simple_agent", "executions": [["r"]]}},
         [("body.executions[0][1]", "required")]),
        ("POST", "/v1/acknowledge", {"json": {"executions": [["r", 0], ["r", 0]]}},
         [("body.server", "required"), ("body.executions", "executions: executions must be unique")]),
        # the API token sent where it does not belong: as a value, and as a field's name
        ("POST", "/v1/acknowledge", {"json": {"server": "simple_agent", "executions": [[API_TOKEN, -1]]}},
         [("body.executions", "executions[0].attempt_index: must be at least 0")]),
        ("POST", "/v1/checkpoints", {"json": {API_TOKEN: 1}}, [("body.***", "not a field of this request")]),
    ]  # fmt: skip
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        for method, path, request, fields in cases:
            headers = request.pop("headers", right)
            reply = await http.request(method, path, headers=headers, **request)
            assert reply.status_code == 422, (path, reply.text)
            assert reply.json() == {
                "error": {
                    "type": "InvalidRequest",
                    "message": "; ".join(f"{f}: {p}" for f, p in fields),
                    "fields": [{"field": f, "problem": p} for f, p in fields],
                }
            }, path
            assert API_TOKEN not in reply.text
        # the document says so: 422 is an ErrorReply, FastAPI's own validation shape is gone
        schema = (await http.get("/openapi.json")).json()
        for path, method in (("/v1/checkpoints", "post"), ("/v1/attempts", "post"), ("/v1/attempts", "get")):
            declared = schema["paths"][path][method]["responses"]["422"]["content"]["application/json"]
            assert declared["schema"] == {"$ref": "#/components/schemas/ErrorReply"}, path
        assert "HTTPValidationError" not in schema["components"]["schemas"]
        assert "fields" in schema["components"]["schemas"]["ErrorBody"]["properties"]
        # nothing was started by any of them
        assert (await http.get("/v1/attempts", headers=right)).json() == []
    assert API_TOKEN not in service.log()


async def test_the_client_raises_invalid_request_with_its_fields(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, sqlite_url))
    await wait_ready(service.url)
    async with RemoteCoordinator(service.url) as coord:
        with pytest.raises(InvalidRequest) as caught:
            await coord.checkpoint(deadline_s=0)
        assert isinstance(caught.value, ConfigError)  # what the embedded API raises for bad input
        assert caught.value.fields == [("body.deadline_s", POSITIVE)]
        assert str(caught.value) == f"body.deadline_s: {POSITIVE}"
        with pytest.raises(InvalidRequest) as caught:
            async with coord.save(deadline_s=-5):
                pytest.fail("a save with a negative deadline started")
        assert caught.value.fields == [("body.deadline_s", POSITIVE)]
        with pytest.raises(InvalidRequest, match="executions must be unique") as caught:
            await coord.acknowledge_completed("simple_agent", [("r", 0), ("r", 0)])
        assert [f for f, _ in caught.value.fields] == ["body.executions"]
        assert await coord.history() == []


async def test_latest_events_is_the_newest_attempts_stream(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    service: ServiceProcess = spawn_service(_config(cluster, tmp_path, sqlite_url))
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        none_yet = await http.get("/v1/attempts/latest/events")
        assert none_yet.status_code == 404
        assert none_yet.json()["error"]["type"] == "NotFound"
        async with RemoteCoordinator(service.url) as coord:
            with pytest.raises(NotFound):
                async for _ in coord.events("latest"):
                    pass
            first = await coord.checkpoint(deadline_s=60)
            second = await coord.checkpoint(deadline_s=60)
            by_client = [e async for e in coord.events("latest")]
        latest = await _sse(http, "/v1/attempts/latest/events")
        by_id = await _sse(http, f"/v1/attempts/{second.checkpoint_id}/events")
        shown = (await http.get("/v1/attempts/latest")).json()
    stored = await read_events(sqlite_url, second.checkpoint_id)
    assert latest == by_id
    assert [e["seq"] for e in latest[:-1]] == [e.seq for e in stored]
    assert latest[-1] == {"end": {"checkpoint_id": second.checkpoint_id, "last_seq": stored[-1].seq}}
    assert {e["checkpoint_id"] for e in latest[:-1]} == {second.checkpoint_id} != {first.checkpoint_id}
    assert [e["seq"] for e in by_client] == [e.seq for e in stored]
    assert shown["checkpoint_id"] == second.checkpoint_id
    assert json.dumps(latest).count(first.checkpoint_id) == 0
