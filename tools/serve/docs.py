"""The API's documentation page, `/docs` (Swagger UI), served whole by this process: it works on a
cluster without internet access.

FastAPI's own `/docs` loads Swagger UI's script, stylesheet and icon from a CDN, so it is blank on
an air-gapped cluster. Here the same page (`get_swagger_ui_html`) points at the copies of
swagger-ui's dist files the `fastapi-offline` package ships (the `serve` extra), mounted at
`ASSETS_URL`.

Rules kept here:
- The page references no other host: its script, stylesheet and icon are under `ASSETS_URL`, the
  document is `/openapi.json`, and Swagger UI's validator badge (which calls a public validator)
  is off. Its Content-Security-Policy lets it load from, and connect to, this origin only.
- Like `/openapi.json`, the page and its assets need no token: they hold no ledger data.
- ReDoc is not served (the app's `redoc_url` is None).
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Final

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from quiesce.ledger.errors import require_extra

__all__ = ["ASSETS_URL", "DOCS_URL", "mount_docs"]

DOCS_URL: Final = "/docs"
ASSETS_URL: Final = "/docs/assets"
#: the package that ships swagger-ui's dist files, and its folder that holds them
ASSETS_PACKAGE: Final = ("fastapi_offline", "static")

_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def _csp(html: str) -> str:
    """This origin only; the page's own inline script by its hash (Swagger UI sets inline styles)."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
        for s in _INLINE_SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline';"
        " img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none';"
        " frame-ancestors 'none'"
    )


def mount_docs(app: FastAPI) -> None:
    """Serve `/docs` and its assets on `app` (made with `docs_url=None`)."""
    require_extra(ASSETS_PACKAGE[0], extra="serve", needed_by="quiesce serve (its /docs page)")
    if app.openapi_url is None:
        raise ValueError("the docs page needs the app's OpenAPI document")
    app.mount(ASSETS_URL, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs-assets")
    page = get_swagger_ui_html(
        openapi_url=app.openapi_url,
        title=f"{app.title} API v{app.version}",
        swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
        swagger_ui_parameters={"validatorUrl": None},
    )
    html = bytes(page.body).decode("utf-8")
    csp = _csp(html)

    @app.get(DOCS_URL, include_in_schema=False, response_class=HTMLResponse)
    async def docs() -> HTMLResponse:
        return HTMLResponse(html, headers={"Content-Security-Policy": csp})
