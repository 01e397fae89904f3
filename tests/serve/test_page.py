"""The live page at `/`, in headless Chromium against a real service and real gymsim servers.

The page is loaded once. An attempt started through the API (`POST /v1/attempts`) appears in the
table as open, and once published through the API it shows as published, with its timeline (one
lane per server, a bar per call) — all without a reload (a marker set on `window` before the
attempt is still there at the end), with no script error and no CSP violation. A screenshot is
written for a person to look at.
"""

from __future__ import annotations

import json
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
