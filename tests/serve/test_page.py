"""The live page at `/`, in headless Chromium against a real service and real gymsim servers.

- The page is loaded once. An attempt started through the API (`POST /v1/attempts`) appears in
  the table as open, and once published through the API it shows as published, with its timeline
  (one lane per server, a bar per call) — all without a reload (a marker set on `window` before
  the attempt is still there at the end), with no script error and no CSP violation.
- With an API token set, the page without one says only that it needs the token and how to give
  it (not "no attempt yet"); a wrong token is refused and forgotten; the right one shows the data.
- The servers panel shows what `GET /v1/status` says — each held server's phase, the checkpoint id
  holding it, since when, the command that frees it — and goes back to idle once the save
  publishes; the snapshots panel lists `GET /v1/snapshots` newest first with `LATEST` marked;
  each attempt links to `#attempt=ID`, which shows its timeline, also when opened afresh.
- In a Chromium that reaches loopback only, nothing is requested from another origin.
- `GET /v1/snapshots` and `RemoteCoordinator.snapshots()` are `list_published` of the folder.

Screenshots are written for a person to look at.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from quiesce.tools.gymsim.cluster import RunningCluster
from tests.serve.browser import Browser, chromium
from tests.serve.conftest import ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def _row(cid: str) -> str:
    return f"document.querySelector('tr[data-checkpoint-id=\"{cid}\"]')"


async def test_an_attempt_appears_and_ends_on_the_page_without_a_reload(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    chromium()
    config = cluster.write_config(tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config)
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        page = await http.get("/")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        with Browser(tmp_path / "profile") as browser:
            await anyio.to_thread.run_sync(browser.open, f"{service.url}/")
            await anyio.to_thread.run_sync(
                browser.wait_for, "!!document.body && document.body.getAttribute('data-live') === '1'"
            )
            assert browser.evaluate("document.querySelectorAll('#attempts tr').length") == 0
            browser.evaluate("window.__loadedOnce = 'yes'")

            started = (await http.post("/v1/attempts", json={"deadline_s": 60})).json()
            cid = started["checkpoint_id"]
            outcome = await anyio.to_thread.run_sync(
                browser.wait_for, f"{_row(cid)} && {_row(cid)}.getAttribute('data-outcome')"
            )
            assert outcome == "open"  # it appeared while it runs

            assert (await http.post(f"/v1/attempts/{cid}/publish", json={"resume": True})).status_code == 200
            await anyio.to_thread.run_sync(
                browser.wait_for, f"{_row(cid)}.getAttribute('data-outcome') === 'published'"
            )
            await anyio.to_thread.run_sync(
                browser.wait_for,
                f"document.body.getAttribute('data-timeline') === '{cid}'"
                " && document.querySelectorAll('#timeline rect.bar.outcome-acknowledged').length >= 10",
            )
            lanes = browser.evaluate(
                "Array.from(document.querySelectorAll('#timeline g.lane')).map(g => g.dataset.server)"
            )
            assert lanes == ["policy_model", "simple_agent", "tools"]
            assert browser.evaluate("window.__loadedOnce") == "yes"  # never reloaded
            assert json.loads(browser.evaluate("document.body.getAttribute('data-errors')")) == []
            assert int(browser.evaluate("document.body.getAttribute('data-events')")) > 0
            cells = browser.evaluate(f"Array.from({_row(cid)}.children).map(td => td.textContent)")
            assert cells[:3] == [cid, "save", "published"]
            browser.screenshot(tmp_path / "live-page.png")
    assert (tmp_path / "live-page.png").stat().st_size > 0


API_TOKEN = "api-page-5e1f0c7d2b9a"


def _text(browser: Browser, selector: str) -> list[list[str]]:
    """The cells of every row under `selector`, as the page shows them."""
    value: list[list[str]] = browser.evaluate(
        f"Array.from(document.querySelectorAll('{selector} tr'))"
        ".map(tr => Array.from(tr.children).map(td => td.textContent))"
    )
    return value


async def test_without_a_token_the_page_says_it_needs_one_and_takes_it(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    chromium()
    config = cluster.write_config(tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config, api_token=API_TOKEN)
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        page = await http.get("/")  # the page itself needs no token: it holds no ledger data
        assert page.status_code == 200
        saved = await http.post("/v1/checkpoints", headers={"Authorization": f"Bearer {API_TOKEN}"}, json={})
        assert saved.status_code == 200, saved.text
    cid = saved.json()["checkpoint_id"]
    with Browser(tmp_path / "profile", loopback_only=True) as browser:
        await anyio.to_thread.run_sync(lambda: browser.open(f"{service.url}/", record=True))
        await anyio.to_thread.run_sync(browser.wait_for, "document.body.dataset.auth === 'needed'")
        shown = browser.evaluate("document.body.innerText")
        assert "needs the service's API token" in shown
        assert "QUIESCE_API_TOKEN" in shown
        assert "no attempt yet" not in shown  # it does not pretend the ledger is empty
        assert "loading" not in shown
        assert browser.evaluate("getComputedStyle(document.getElementById('live')).display") == "none"
        browser.screenshot(tmp_path / "page-needs-token.png")

        def give(token: str) -> None:
            browser.evaluate(
                f"document.getElementById('token').value = {json.dumps(token)};"
                " document.getElementById('token-form').requestSubmit()"
            )

        await anyio.to_thread.run_sync(give, "wrong-token")
        await anyio.to_thread.run_sync(browser.wait_for, "document.body.dataset.auth === 'refused'")
        assert "refused that token" in browser.evaluate("document.body.innerText")
        assert browser.evaluate("sessionStorage.getItem('quiesce-token')") is None  # forgotten

        await anyio.to_thread.run_sync(give, API_TOKEN)
        await anyio.to_thread.run_sync(
            browser.wait_for,
            "document.body.dataset.auth === 'ok' && document.body.dataset.live === '1'"
            f" && document.body.dataset.timeline === '{cid}'"
            f" && document.querySelectorAll('#servers tr').length === {len(cluster.urls)}"
            " && document.querySelectorAll('#snapshots tr').length === 1",
        )
        assert "needs the service's API token" not in browser.evaluate("document.body.innerText")
        assert [r[:3] for r in _text(browser, "#attempts")] == [[cid, "save", "published"]]
        assert json.loads(browser.evaluate("document.body.getAttribute('data-errors')")) == []
        origin = service.url.rstrip("/")
        assert [u for u in browser.requested if not u.startswith(origin + "/")] == []
        assert [p for p in browser.problems if "status of 401" not in p] == []  # the refusals only


async def test_servers_attempt_links_and_snapshots_on_the_page(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    chromium()
    config = cluster.write_config(tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snaps")
    service: ServiceProcess = spawn_service(config)
    await wait_ready(service.url)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        first = (await http.post("/v1/checkpoints", json={"deadline_s": 60})).json()
        with Browser(tmp_path / "profile", loopback_only=True) as browser:
            await anyio.to_thread.run_sync(lambda: browser.open(f"{service.url}/", record=True))
            await anyio.to_thread.run_sync(
                browser.wait_for,
                "document.body.dataset.live === '1' && document.body.dataset.status === 'idle'"
                " && document.querySelectorAll('#snapshots tr').length === 1",
            )
            # a two-step save waiting for its caller holds every participant
            started = (await http.post("/v1/attempts", json={"deadline_s": 120})).json()
            cid, held = started["checkpoint_id"], len(started["participants"])
            status = (await http.get("/v1/status")).json()  # steady while the save waits
            assert sum(s["held_by"] == cid for s in status["servers"]) == held
            phases = json.dumps([s["phase"] for s in status["servers"]], separators=(",", ":"))
            shown = "[...document.querySelectorAll('#servers tr')].map(tr => tr.children[1].textContent)"
            await anyio.to_thread.run_sync(  # once the page has read the same
                browser.wait_for, f"JSON.stringify({shown}) === '{phases}'"
            )
            rows = _text(browser, "#servers")
            browser.resize(1400, 1000)
            browser.screenshot(tmp_path / "page-held.png")
            assert [r[0] for r in rows] == [s["name"] for s in status["servers"]]
            for row, server in zip(rows, status["servers"], strict=True):
                if not server["held"]:  # configured, not a participant (skipped by discovery)
                    assert row[1:4] == [server["phase"], "-", "-"]
                    continue
                _, phase, held_by, kind, since, _, frees, plane = row
                assert plane == server["plane"] == "v1"
                assert (phase, held_by, kind) == (server["phase"], cid, "save"), row
                assert since.startswith(server["since"].replace("T", " ")[:19]), (since, server["since"])
                assert frees == server["frees"]
                assert cid in frees
            summary = browser.evaluate("document.getElementById('servers-summary').textContent")
            assert summary.startswith(f"{held} of {len(cluster.urls)} servers held")

            published = await http.post(f"/v1/attempts/{cid}/publish", json={"resume": True})
            assert published.status_code == 200, published.text
            await anyio.to_thread.run_sync(
                browser.wait_for,
                "document.body.dataset.status === 'idle'"
                " && document.querySelectorAll('#snapshots tr').length === 2"
                f" && document.body.dataset.timeline === '{cid}'",
            )
            assert {r[1] for r in _text(browser, "#servers")} == {"idle"}
            assert all(r[2] == "-" and r[6] == "-" for r in _text(browser, "#servers"))
            listed = (await http.get("/v1/snapshots")).json()
            snapshots = _text(browser, "#snapshots")
            assert [r[0] for r in snapshots] == [s["id"] for s in reversed(listed)]  # newest first
            assert [r[5] for r in snapshots] == ["LATEST", "-"]
            assert snapshots[0][0] == Path(published.json()["snapshot"]).name
            assert [r[3] for r in snapshots] == [str(s["files"]) for s in reversed(listed)]

            # each attempt links to its timeline: following the older one's link shows it
            link = f"#attempt={first['checkpoint_id']}"
            assert browser.evaluate(
                "Array.from(document.querySelectorAll('#attempts a')).map(a => a.getAttribute('href'))"
            ) == [f"#attempt={cid}", link]
            browser.evaluate(f"document.querySelector('#attempts a[href=\"{link}\"]').click()")
            await anyio.to_thread.run_sync(
                browser.wait_for, f"document.body.dataset.timeline === '{first['checkpoint_id']}'"
            )
            assert browser.evaluate("location.hash") == link
            assert browser.evaluate("document.getElementById('timeline-title').textContent").endswith(
                first["checkpoint_id"]
            )
            assert browser.evaluate("document.getElementById('timeline-svg').download") == (
                f"{first['checkpoint_id']}.svg"
            )
            assert browser.evaluate("document.querySelectorAll('#timeline svg.gantt').length") == 1
            browser.screenshot(tmp_path / "page-idle.png")
            assert json.loads(browser.evaluate("document.body.getAttribute('data-errors')")) == []
            assert browser.problems == []
            origin = service.url.rstrip("/")
            assert [u for u in browser.requested if not u.startswith(origin + "/")] == []

        # a link is a URL: opened afresh, the page shows that attempt's timeline
        with Browser(tmp_path / "profile2", loopback_only=True) as browser:
            await anyio.to_thread.run_sync(browser.open, f"{service.url}/{link}")
            await anyio.to_thread.run_sync(
                browser.wait_for,
                f"document.body.dataset.timeline === '{first['checkpoint_id']}'"
                " && document.querySelectorAll('#attempts tr').length === 2",
            )
            await anyio.sleep(0.5)  # a refresh after the first keeps the attempt the link named
            assert browser.evaluate("document.body.dataset.timeline") == first["checkpoint_id"]


async def test_snapshots_route_and_client_list_what_the_folder_holds(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    from quiesce.coordinator.snapshots import list_published
    from quiesce.tools.serve.client import RemoteCoordinator

    config = cluster.write_config(tmp_path / "cluster.yaml", sqlite_url, tmp_path / "snaps", keep_latest=2)
    service: ServiceProcess = spawn_service(config, api_token=API_TOKEN)
    await wait_ready(service.url)
    async with RemoteCoordinator(service.url, token=API_TOKEN) as coord:
        assert await coord.snapshots() == []
        saved = [await coord.checkpoint(deadline_s=60) for _ in range(3)]
        listed = await coord.snapshots()
    expected = list_published(tmp_path / "snaps")
    assert listed == expected
    assert [s.path for s in listed] == [a.snapshot for a in saved[1:]]  # keep_latest=2: the oldest pruned
    assert [s.latest for s in listed] == [False, True]
    assert all(s.size > 0 and s.files > 0 and s.created for s in listed)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        assert (await http.get("/v1/snapshots")).status_code == 401
        reply = await http.get("/v1/snapshots", headers={"Authorization": f"Bearer {API_TOKEN}"})
        assert reply.json() == [s.as_json() for s in expected]
        page = await http.get("/")
        assert re.findall(r"https?://", page.text) == []  # the page names no host: nothing to fetch elsewhere
        schema = (await http.get("/openapi.json")).json()
        declared = schema["paths"]["/v1/snapshots"]["get"]["responses"]["200"]["content"]["application/json"]
        assert declared["schema"]["items"] == {"$ref": "#/components/schemas/SnapshotModel"}
        properties = schema["components"]["schemas"]["SnapshotModel"]["properties"]
        assert set(properties) == set(expected[0].as_json())
