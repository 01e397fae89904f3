"""`/docs` works on an air-gapped cluster: a real service, plain HTTP and a loopback-only Chromium.

- the page names no host (no `http(s)://` at all: every URL in it is a path of this service), and
  every asset and document it references is served 200 by the service, with its type, without a
  token (with an API token set); its CSP allows this origin only;
- in Chromium that reaches loopback only, the page renders Swagger UI with every operation of the
  OpenAPI document, requests nothing from another origin, and logs no error (no CSP violation,
  no failed load). A screenshot is written for a person to look at.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import anyio
import httpx
import pytest

from quiesce.tools.gymsim.cluster import RunningCluster
from tests.serve.browser import Browser, chromium
from tests.serve.conftest import ServiceProcess, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

API_TOKEN = "api-d0c5-7a1e-93b4"


def _references(html: str) -> list[str]:
    """Every URL the page loads: `src=` and `href=` attributes, and Swagger UI's `url:`."""
    return re.findall(r'(?:src|href)="([^"]*)"', html) + re.findall(r"\burl: '([^']*)'", html)


async def _started(cluster: RunningCluster, tmp_path: Path, ledger_url: str, spawn: Any) -> ServiceProcess:
    config = cluster.write_config(tmp_path / "cluster.yaml", ledger_url, tmp_path / "snaps")
    service: ServiceProcess = spawn(config, api_token=API_TOKEN)
    await wait_ready(service.url)
    return service


async def test_docs_names_no_host_and_every_asset_is_served(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    service = await _started(cluster, tmp_path, sqlite_url, spawn_service)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        page = await http.get("/docs")  # no token: it holds no ledger data
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        html = page.text
        assert re.findall(r"https?://", html) == []  # no host at all: nothing outside the service
        assert '"validatorUrl": null' in html  # Swagger UI's validator badge (a public service) is off
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp
        assert "connect-src 'self';" in csp
        references = _references(html)
        kinds, scripts = {}, []
        for reference in references:
            assert reference.startswith("/"), reference
            asset = await http.get(reference)
            assert asset.status_code == 200, reference
            assert len(asset.content) > 1000, reference
            kinds[reference.rsplit(".", 1)[-1]] = asset.headers["content-type"].split(";")[0]
            scripts += [asset.text] if reference.endswith(".js") else []
        assert kinds == {
            "css": "text/css",
            "png": "image/png",
            "js": "text/javascript",
            "json": "application/json",
        }
        assert len(scripts) == 1
        assert "SwaggerUIBundle" in scripts[0]
        # the API itself still needs the token
        assert (await http.get("/v1/attempts")).status_code == 401
        # every POST takes a JSON body (optional where nothing need be said), so /docs' "Try it
        # out" sends Content-Type: application/json — the only type a state change is taken with
        schema = (await http.get("/openapi.json")).json()
        posts = {
            path: op for path, methods in schema["paths"].items() for m, op in methods.items() if m == "post"
        }
        assert "/v1/attempts/{checkpoint_id}/resume" in posts
        assert [
            p
            for p, op in posts.items()
            if "application/json" not in op.get("requestBody", {}).get("content", {})
        ] == []


async def test_docs_renders_every_operation_with_loopback_only(
    cluster: RunningCluster, tmp_path: Path, sqlite_url: str, spawn_service: Any
) -> None:
    chromium()
    service = await _started(cluster, tmp_path, sqlite_url, spawn_service)
    async with httpx.AsyncClient(base_url=service.url, trust_env=False, timeout=60) as http:
        schema = (await http.get("/openapi.json")).json()
    operations = sorted(
        (method.upper(), path) for path, methods in schema["paths"].items() for method in methods
    )
    assert ("POST", "/v1/checkpoints") in operations
    with Browser(tmp_path / "profile", loopback_only=True) as browser:
        await anyio.to_thread.run_sync(lambda: browser.open(f"{service.url}/docs", record=True))
        await anyio.to_thread.run_sync(
            browser.wait_for,
            f"document.querySelectorAll('.opblock').length >= {len(operations)}",
        )
        shown = browser.evaluate(
            "Array.from(document.querySelectorAll('.opblock')).map(op => ["
            " op.querySelector('.opblock-summary-method').textContent,"
            " op.querySelector('.opblock-summary-path').getAttribute('data-path')])"
        )
        title = browser.evaluate("document.querySelector('.info .title').textContent")
        dom = browser.evaluate("document.documentElement.outerHTML")
        browser.screenshot(tmp_path / "docs.png")
        requested, problems = browser.requested, browser.problems
    assert sorted(tuple(op) for op in shown) == operations
    assert title.startswith("quiesce")
    assert "/v1/attempts/{checkpoint_id}/publish" in dom
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(service.url))
    assert requested, "the browser recorded no request"
    outside = [u for u in requested if not u.startswith(origin + "/") and not u.startswith("data:")]
    assert outside == []
    assert urljoin(origin, "/docs/assets/swagger-ui-bundle.js") in requested
    assert problems == []
    assert (tmp_path / "docs.png").stat().st_size > 10_000
