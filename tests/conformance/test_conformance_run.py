"""The machinery both conformance checkers share (`tools/conformance_run.py`): a request sent once
more after a closed connection, each outcome of a check as one row, the token redacted.

Narrow unit tests (an `httpx.MockTransport` plays the server); the checkers themselves run against
real servers in `test_checker.py`, `test_checker_v2.py` and the reference-server tests.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from quiesce.coordinator.protocol_v2 import EpisodeId
from quiesce.tools.conformance_report import ConformanceReport
from quiesce.tools.conformance_run import (
    CheckRun,
    Fail,
    Reply,
    Skip,
    Warn,
    expect,
    send,
    validated,
)

TOKEN = "s3cret-token-value"
CHECKS = {"a.pass", "a.fail", "a.skip", "a.warn", "a.timeout", "a.transport"}

pytestmark = pytest.mark.anyio


def _closing_once(seen: list[httpx.Request], failures: int) -> httpx.MockTransport:
    """A transport whose first `failures` requests meet a connection the server closed."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) <= failures:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={"echo": json.loads(request.content or b"null")})

    return httpx.MockTransport(handle)


async def test_a_request_on_a_closed_connection_is_sent_once_more() -> None:
    seen: list[httpx.Request] = []
    async with httpx.AsyncClient(transport=_closing_once(seen, 1)) as client:
        reply = await send(client, "POST", "http://gym/x", token=TOKEN, json_body={"n": 1})
    assert (reply.status, reply.body) == (200, {"echo": {"n": 1}})
    assert len(seen) == 2
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in seen)
    assert all(r.headers["content-type"] == "application/json" for r in seen)


async def test_a_second_closed_connection_is_the_checks_failure() -> None:
    seen: list[httpx.Request] = []
    async with httpx.AsyncClient(transport=_closing_once(seen, 2)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await send(client, "POST", "http://gym/x", token=TOKEN, json_body={})
    assert len(seen) == 2


async def test_raw_bytes_go_as_they_are_and_no_token_sends_no_header() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b"<" + request.content + b">")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        reply = await send(
            client, "POST", "http://gym/x", token=None, raw=b'{"a": NaN}', json_body={"ignored": 1}
        )
    assert seen[0].content == b'{"a": NaN}'
    assert "authorization" not in seen[0].headers
    assert (reply.body, reply.text) == (None, '<{"a": NaN}>')  # not JSON: no body, the text kept


def test_expect_and_validated_name_what_was_wrong() -> None:
    conflict = Reply(409, {"error": {"code": "invalid_phase"}}, '{"error": {"code": "invalid_phase"}}')
    expect(conflict, 409, "invalid_phase")
    with pytest.raises(
        Fail, match=r"^commit at idle: expected 409 stale_checkpoint, got HTTP 409 invalid_phase$"
    ):
        expect(conflict, 409, "stale_checkpoint", "commit at idle")
    with pytest.raises(Fail, match=r"^status reply is not JSON: HTTP 200 <html>"):
        validated(EpisodeId, Reply(200, None, "<html>"), "status")
    with pytest.raises(Fail, match=r"^status reply does not match EpisodeId: "):
        validated(EpisodeId, Reply(200, {"attempt": 1}, "{}"), "status")
    parsed = validated(EpisodeId, Reply(200, {"rollout_id": "r", "attempt": 2}, "{}"), "status")
    assert (parsed.rollout_id, parsed.attempt) == ("r", 2)
    long = Reply(500, None, "x" * 400)
    assert long.describe() == "HTTP 500 " + "x" * 160 + "…"


async def test_each_outcome_of_a_check_is_one_row_and_the_token_never_reaches_one() -> None:
    report = ConformanceReport(url="http://gym")
    run = CheckRun(report, TOKEN, 35.0, CHECKS)

    def raising(error: BaseException) -> Callable[[], Awaitable[str | None]]:
        async def fn() -> str | None:
            raise error

        return fn

    async def passing() -> str | None:
        return f"saw {TOKEN}"

    assert await run.check("a.pass", passing) is True
    assert await run.check("a.fail", raising(Fail(f"echoed Bearer {TOKEN}"))) is False
    assert await run.check("a.skip", raising(Skip("not a model"))) is False
    assert await run.check("a.warn", raising(Warn("slow"))) is True
    assert await run.check("a.timeout", raising(httpx.ReadTimeout("timed out"))) is False
    assert await run.check("a.transport", raising(httpx.ConnectError("refused"))) is False
    rows = [(r.name, r.status, r.detail) for r in report.results]
    assert rows[:4] == [
        ("a.pass", "pass", "saw ***"),
        ("a.fail", "fail", "echoed Bearer ***"),
        ("a.skip", "skip", "not a model"),
        ("a.warn", "warn", "slow"),
    ]
    assert rows[4] == ("a.timeout", "fail", "no reply within 35s (ReadTimeout)")
    assert rows[5][:2] == ("a.transport", "fail")
    assert rows[5][2].startswith("request failed: ")
    assert all(TOKEN not in r.detail for r in report.results)
    with pytest.raises(AssertionError, match="undocumented check"):
        run.add("not.a.check", "pass")
