"""Hostile requests to `quiesce serve`: each refused in its error shape, nothing recorded, no traceback.

Against a real `quiesce serve` process and real gymsim servers:

- a cross-site form POST (`application/x-www-form-urlencoded`, `Origin: http://evil.example`),
  on every route that drives servers: 403 `CrossOrigin`; the same form without an `Origin` (an
  old browser, a stripped header): 415 `UnsupportedMediaType`, as is `text/plain`, multipart, or
  no `Content-Type` at all; `Origin: null` and the service's own host at another port or scheme
  are cross-origin too. The ledger holds no attempt and no control call was sent;
- DNS rebinding: `Host: evil.example` (with and without the port) is refused with 421
  `MisdirectedHost` on every kind of route (the page, a read, a save); the listen address,
  `localhost` and a host the operator allows (`QUIESCE_ALLOW_HOSTS`) are served;
- a same-origin JSON POST (with the `Origin` a browser sends) saves; `RemoteCoordinator` works
  through `http://127.0.0.1:PORT` and `http://localhost:PORT` alike;
- a NaN or infinite `deadline_s` is 422 `InvalidRequest` naming the field, on the direct path of a
  save as on every other route; a 20 MB string field is 413 `BodyTooLarge`, with or without a
  `Content-Length`, and the string never reaches the log; a 30-digit `Last-Event-ID` is 400
  `InvalidHeader` before the stream starts;
- in Chromium (skipped without it, unless `QUIESCE_REQUIRE_CHROMIUM=1`): another site's page that
  submits a form to the service is refused and records nothing; the live page's own `fetch` POST
  (same origin) saves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httpx
import pytest

from quiesce.tools.gymsim.cluster import RunningCluster
from quiesce.tools.serve.client import RemoteCoordinator
from quiesce.tools.serve.guard import MAX_BODY_BYTES
from quiesce.tools.serve.hosts import ALLOW_HOSTS_ENV
from tests.coordinator.helpers import loopback, read_events
from tests.serve.conftest import ServiceProcess, spawn_service, wait_ready

__all__ = ["spawn_service"]  # the fixture, used by name

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

#: Every route that drives servers (or lets them go), each with a body it would accept.
DRIVING = [
    ("/v1/checkpoints", {}),
    ("/v1/attempts", {}),
    ("/v1/restore", {}),
    ("/v1/resume", {}),
    ("/v1/abort", {}),
    ("/v1/attempts/e1-0000001/publish", {"resume": True}),
    ("/v1/acknowledge", {"server": "simple_agent", "executions": [["r", 0]]}),
]
JSON = {"Content-Type": "application/json"}


def _config(cluster: RunningCluster, tmp_path: Path, ledger_url: str) -> Path:
    return cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")


def _refusal(reply: httpx.Response, status: int, kind: str) -> str:
    """The message of a refusal in the service's error shape (`{"error": {"type", "message"}}`)."""
    assert reply.status_code == status, (reply.request.method, reply.request.url, reply.text)
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["type"] == kind, error
    assert isinstance(error["message"], str)
    assert error["message"]
    return str(error["message"])


async def _nothing_recorded(ledger_url: str) -> None:
    """No attempt began and no control call was sent (only the service's own start is recorded)."""
    events = await read_events(ledger_url)
    assert [e.kind for e in events if e.checkpoint_id is not None or e.kind.startswith("call.")] == []


def _clean_log(service: ServiceProcess) -> str:
    log = service.log()
    assert "Traceback" not in log, log
    assert "Exception" not in log, log
    return log


async def test_a_cross_site_form_post_is_refused_and_records_nothing(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Callable[..., ServiceProcess]
) -> None:
    service = spawn_service(_config(cluster, tmp_path, sqlite_url))
    await wait_ready(service.url)
    own = service.url  # http://127.0.0.1:PORT: the origin of the service's own page
    port = urlsplit(own).port or 80
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    async with httpx.AsyncClient(base_url=own, trust_env=False, timeout=60) as http:
        for path, _ in DRIVING:
            # what a page on another site sends when it submits a form (no fields, or some)
            for content in (b"", b"deadline_s=60"):
                reply = await http.post(
                    path, content=content, headers={**form, "Origin": "http://evil.example"}
                )
                message = _refusal(reply, 403, "CrossOrigin")
                assert "http://evil.example" in message
            # the same form from a browser that sent no Origin, and the other simple content types
            for headers, content in (
                (form, b""),
                ({"Content-Type": "text/plain"}, b'{"deadline_s": 60}'),
                ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--\r\n"),
                ({}, b""),  # no Content-Type at all (a bodiless fetch or beacon)
            ):
                reply = await http.post(path, content=content, headers=headers)
                message = _refusal(reply, 415, "UnsupportedMediaType")
                assert "application/json" in message
        # origins that are not the service's own, even with a JSON body
        for origin in (
            "null",
            f"http://127.0.0.1:{port + 1}",
            f"https://evil.example:{port}",
            "http://evil.example",
        ):
            reply = await http.post("/v1/checkpoints", json={}, headers={"Origin": origin})
            _refusal(reply, 403, "CrossOrigin")
        # a cross-origin read is refused too (every route)
        _refusal(await http.get("/v1/status", headers={"Origin": "http://evil.example"}), 403, "CrossOrigin")
        _refusal(await http.get("/v1/events", headers={"Origin": "http://evil.example"}), 403, "CrossOrigin")
        await _nothing_recorded(sqlite_url)

        # the service's own origin (what its page's fetch sends) saves
        saved = await http.post("/v1/checkpoints", json={"deadline_s": 60}, headers={"Origin": own})
        assert saved.status_code == 200, saved.text
        assert saved.json()["outcome"] == "published"
        page = await http.get("/", headers={"Origin": own})
        assert page.status_code == 200
    started = [e for e in await read_events(sqlite_url) if e.kind == "attempt.started"]
    assert [e.checkpoint_id for e in started] == [saved.json()["checkpoint_id"]]
    _clean_log(service)


async def test_a_rebinding_host_is_refused_and_the_served_names_work(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Callable[..., ServiceProcess]
) -> None:
    service = spawn_service(
        _config(cluster, tmp_path, sqlite_url),
        env_extra={ALLOW_HOSTS_ENV: "quiesce.example, other.example:7"},
        extra=("--allow-host", "flag.example", "--allow-host", "port.example:8"),
    )
    await wait_ready(service.url)
    port = urlsplit(service.url).port or 80
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        for host in ("evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}",
                     f"127.0.0.1.evil.example:{port}", f"other.example:{port}", "",
                     "127.0.0.1:1", f"port.example:{port}"):  # fmt: skip
            for method, path, body in (
                ("GET", "/", None),
                ("GET", "/v1/status", None),
                ("GET", "/healthz", None),
                ("POST", "/v1/checkpoints", {}),
                ("POST", "/v1/attempts", {}),
                # the origin a rebinding page has: its own, so the same as its Host
                ("POST", "/v1/checkpoints", {"origin": True}),
            ):
                headers = {"Host": host}
                if body is not None and body.pop("origin", False):
                    headers["Origin"] = f"http://{host}"
                reply = await http.request(method, path, json=body, headers=headers)
                message = _refusal(reply, 421, "MisdirectedHost")
                assert ALLOW_HOSTS_ENV in message, message
        await _nothing_recorded(sqlite_url)

        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", "quiesce.example",
                     f"quiesce.example:{port}", "other.example:7", "flag.example", f"flag.example:{port}",
                     "port.example:8"):  # fmt: skip
            reply = await http.get("/v1/status", headers={"Host": host, "Origin": f"http://{host}"})
            assert reply.status_code == 200, (host, reply.text)
        # a proxy that terminates TLS for an allowed name: its page's origin is https://NAME
        reply = await http.get(
            "/v1/status", headers={"Host": "quiesce.example", "Origin": "https://quiesce.example"}
        )
        assert reply.status_code == 200, reply.text

    # the client, through both names of the loopback address
    for url in (service.url, f"http://localhost:{port}"):
        async with RemoteCoordinator(url) as coord:
            found = await coord.discover()
            assert found.participants
            assert {m.name for m in found.participants} <= set(cluster.urls)
            attempt = await coord.checkpoint(deadline_s=60)
            assert attempt.state == "completed"
            async with coord.save(deadline_s=60) as two_step:
                assert two_step.staging_dir is not None
                (two_step.staging_dir / "trainer").mkdir()
            assert two_step.snapshot is not None
            assert (await coord.resume()).outcome == "none"
    _clean_log(service)


async def test_nan_deadlines_huge_bodies_and_overlong_event_ids(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Callable[..., ServiceProcess]
) -> None:
    service = spawn_service(_config(cluster, tmp_path, sqlite_url))
    await wait_ready(service.url)
    huge = "q" * (20 * 2**20)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=120) as http:
        # NaN and infinities as JSON decoders read them (Python's json, Starlette's, pydantic's)
        for path in ("/v1/checkpoints", "/v1/attempts", "/v1/restore"):
            for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
                reply = await http.post(path, content=f'{{"deadline_s": {literal}}}'.encode(), headers=JSON)
                _refusal(reply, 422, "InvalidRequest")
                fields = reply.json()["error"]["fields"]
                assert [f["field"] for f in fields] == ["body.deadline_s"], fields
                assert "finite" in fields[0]["problem"], fields
        for path, text in (("/v1/retire", '{"episodes": [{"rollout_id": "r"}], "deadline_s": NaN}'),
                           ("/v1/forget", '{"rollout_ids": ["r"], "deadline_s": NaN}')):  # fmt: skip
            reply = await http.post(path, content=text.encode(), headers=JSON)
            _refusal(reply, 422, "InvalidRequest")
            assert [f["field"] for f in reply.json()["error"]["fields"]] == ["body.deadline_s"]

        # a 20 MB string field: refused before it is parsed, with a Content-Length and without one
        body = json.dumps({"snapshot": huge, "deadline_s": 60}).encode()
        for path in ("/v1/restore", "/v1/checkpoints", "/v1/attempts", "/v1/acknowledge"):
            reply = await http.post(path, content=body, headers=JSON)
            message = _refusal(reply, 413, "BodyTooLarge")
            assert str(MAX_BODY_BYTES) in message
            assert huge[:100] not in reply.text

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 2**16):
                yield body[start : start + 2**16]

        reply = await http.post("/v1/restore", content=chunks(), headers=JSON)
        assert "content-length" not in reply.request.headers  # sent chunked
        _refusal(reply, 413, "BodyTooLarge")
        # just under the cap is read and validated as usual (the cap is not a smaller one)
        fits = json.dumps({"reason": "r" * (MAX_BODY_BYTES - 100)}).encode()
        reply = await http.post("/v1/abort", content=fits, headers=JSON)
        _refusal(reply, 422, "InvalidRequest")

        # Last-Event-ID: a number the ledger cannot hold, or no number at all
        saved = (await http.post("/v1/checkpoints", json={"deadline_s": 60})).json()["checkpoint_id"]
        for value in ("9" * 30, "-1", "12abc", "1e3", str(2**63)):
            for path in ("/v1/events", f"/v1/attempts/{saved}/events"):
                reply = await http.get(path, headers={"Last-Event-ID": value})
                message = _refusal(reply, 400, "InvalidHeader")
                assert "Last-Event-ID" in message
        # a valid one still resumes the stream where it left off
        events = [e for e in await read_events(sqlite_url, saved)]
        async with http.stream(
            "GET", f"/v1/attempts/{saved}/events", headers={"Last-Event-ID": str(events[-2].seq)}
        ) as stream:
            assert stream.status_code == 200
            text = (await stream.aread()).decode()
        assert f"id: {events[-1].seq}\n" in text
        assert f"id: {events[-2].seq}\n" not in text
        assert "event: end" in text
        assert (await http.get("/healthz")).status_code == 200  # still serving
    log = _clean_log(service)
    assert huge[:1000] not in log
    assert len(log) < 100_000


# -- in a real browser ------------------------------------------------------------------------------


EVIL_PAGE = """<!doctype html><html><body>
<form id="with-field" method="post" action="{action}"><input type="hidden" name="deadline_s"
 value="60"></form>
<form id="empty" method="post" action="{action}"></form>
<script>document.getElementById('{form}').submit();</script>
</body></html>"""


class EvilSite:
    """A page on another site: a plain HTTP server on another loopback port, named `localhost`
    (the service is `127.0.0.1`); `html` is what it serves."""

    def __init__(self) -> None:
        self.html = ""
        self.url = ""

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive()
            body = self.html.encode()
            head = f"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {len(body)}\r\n"
            await stream.send(head.encode() + b"connection: close\r\n\r\n" + body)


async def test_in_chromium_another_sites_form_is_refused_and_the_pages_own_post_works(
    cluster: RunningCluster,
    tmp_path: Path,
    sqlite_url: str,
    spawn_service: Callable[..., ServiceProcess],
) -> None:
    from tests.serve.browser import Browser, chromium

    chromium()
    service = spawn_service(_config(cluster, tmp_path, sqlite_url))
    await wait_ready(service.url)
    evil_site = EvilSite()
    async with loopback(evil_site.handle) as evil_url:
        evil_site.url = evil_url.replace("127.0.0.1", "localhost")  # another site, not only another port
        with Browser(tmp_path / "profile") as browser:
            await _browse(browser, service, evil_site, sqlite_url)
    _clean_log(service)


async def _browse(browser: Any, service: ServiceProcess, evil_site: EvilSite, sqlite_url: str) -> None:
    """Another site's forms, then the service's own page (see the module docstring)."""
    for form in ("with-field", "empty"):
        for path in ("/v1/checkpoints", "/v1/attempts"):
            action = service.url + path
            evil_site.html = EVIL_PAGE.format(action=action, form=form)
            await anyio.to_thread.run_sync(lambda: browser.open(evil_site.url + "/", record=True))
            shown = await anyio.to_thread.run_sync(
                browser.wait_for,
                f"location.href === {json.dumps(action)} && document.body && document.body.innerText",
            )
            assert json.loads(shown.strip().splitlines()[-1])["error"]["type"] == "CrossOrigin", shown
            assert _response_to(browser, action) == 403
    await _nothing_recorded(sqlite_url)

    # the service's own page: its fetch POSTs JSON with its own Origin
    await anyio.to_thread.run_sync(browser.open, f"{service.url}/")
    await anyio.to_thread.run_sync(browser.wait_for, "document.body && document.body.dataset.live === '1'")
    browser.evaluate(
        "window.__saved = null; fetch('/v1/checkpoints', {method: 'POST', headers: {'Content-Type':"
        " 'application/json'}, body: JSON.stringify({deadline_s: 60})}).then(r => r.json().then(j =>"
        " { window.__saved = {status: r.status, body: j}; }))"
    )
    saved = await anyio.to_thread.run_sync(browser.wait_for, "window.__saved")
    assert saved["status"] == 200, saved
    cid = saved["body"]["checkpoint_id"]
    row = f"document.querySelector('tr[data-checkpoint-id=\"{cid}\"]')"
    await anyio.to_thread.run_sync(browser.wait_for, f"{row} && {row}.dataset.outcome === 'published'")
    assert json.loads(browser.evaluate("document.body.getAttribute('data-errors')")) == []
    started = [e.checkpoint_id for e in await read_events(sqlite_url) if e.kind == "attempt.started"]
    assert started == [cid]


def _response_to(browser: Any, url: str) -> int:
    """The status of the browser's response to `url` (from the network events it recorded), after
    checking the request carried the evil site's `Origin`."""
    sent = [e["params"] for e in browser.events if e["method"] == "Network.requestWillBeSent"]
    ids = {p["requestId"] for p in sent if p["request"]["url"] == url}
    assert ids, [p["request"]["url"] for p in sent]
    origins = {p["request"]["headers"].get("Origin") for p in sent if p["requestId"] in ids}
    assert origins, sent
    assert all(o and o.startswith("http://localhost:") for o in origins), origins
    statuses = [
        e["params"]["response"]["status"]
        for e in browser.events
        if e["method"] == "Network.responseReceived" and e["params"]["requestId"] in ids
    ]
    assert len(statuses) == 1, statuses
    return int(statuses[0])
