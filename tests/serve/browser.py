"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`).

No WebDriver and no websocket library: Chromium reads protocol messages (JSON, each ending in a
NUL byte) from its fd 3 and writes replies and events to its fd 4. `Browser.open(url)` makes a
page and attaches to it; `evaluate(js)` returns the expression's value; `wait_for(js)` polls an
expression until it is truthy (a hang guard bounds it, not a timing assertion). The flags are
those `tests/audit/test_report.py` runs this machine's Chromium with.

`Browser(profile, loopback_only=True)` reaches loopback addresses only: every request to another
host goes to a proxy that does not exist (Chromium never sends loopback through a proxy, and
leaves a proxied name for the proxy to resolve) — an air-gapped machine. `open(url, record=True)`
records, from before the first request, every request the page sends (`requested`) and every
console or log message and uncaught exception (`problems`: CSP violations among them).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest

from tests.audit.test_report import CHROMIUM_FLAGS

#: where a loopback-only browser sends every request to another host: a port nothing listens on
DEAD_PROXY = "127.0.0.1:9"
#: The longest one DevTools call may go unanswered (a hang guard: a stuck Chromium fails the test
#: instead of blocking its thread, and with it the event loop's teardown, for good)
CALL_TIMEOUT_S = 90.0


def chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        if os.environ.get("QUIESCE_REQUIRE_CHROMIUM", "") not in ("", "0"):
            pytest.fail("QUIESCE_REQUIRE_CHROMIUM=1 but chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return found


def _moved_above_4(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Browser:
    def __init__(self, profile: Path, *, loopback_only: bool = False) -> None:
        to_child, self._to_chromium = os.pipe()
        self._from_chromium, from_child = os.pipe()
        # above 4, so bash's `3<&N 4>&M` never overwrites one end with the other (dash takes no N > 9)
        to_child, from_child = (_moved_above_4(fd) for fd in (to_child, from_child))
        binary = chromium()
        offline = [f"--proxy-server={DEAD_PROXY}"]
        args = [
            *CHROMIUM_FLAGS,
            *(offline if loopback_only else []),
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self._process = subprocess.Popen(
            ["/bin/bash", "-c", f'exec "$0" "$@" 3<&{to_child} 4>&{from_child}', binary, *args],
            pass_fds=(to_child, from_child),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None
        self.events: list[dict[str, Any]] = []  # what the page reported, once `open(record=True)`

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for fd in (self._to_chromium, self._from_chromium):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _message(self, give_up: float, method: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = give_up - time.monotonic()
            if left <= 0 or not select.select([self._from_chromium], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} within {CALL_TIMEOUT_S:g}s")
            chunk = os.read(self._from_chromium, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        return message

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True) -> Any:
        self._next_id += 1
        request: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self._session is not None:
            request["sessionId"] = self._session
        os.write(self._to_chromium, json.dumps(request).encode() + b"\0")
        give_up = time.monotonic() + CALL_TIMEOUT_S
        while True:
            message = self._message(give_up, method)
            if "method" in message and "id" not in message:
                self.events.append(message)
                continue
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result")

    def open(self, url: str, *, record: bool = False) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank" if record else url}, session=False)
        attached = self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, session=False
        )
        self._session = attached["sessionId"]
        if record:
            for domain in ("Network", "Log", "Runtime", "Page"):
                self.call(f"{domain}.enable")
            self.events.clear()
            self.call("Page.navigate", {"url": url})

    @property
    def requested(self) -> list[str]:
        """Every URL the page requested since `open(..., record=True)`, in order."""
        return [
            e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"
        ]

    @property
    def problems(self) -> list[str]:
        """Console errors and warnings, log entries (a CSP violation is one) and uncaught exceptions."""
        out: list[str] = []
        for event in self.events:
            params = event.get("params", {})
            if event["method"] == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                out.append(f"log {params['entry'].get('source')}: {params['entry']['text']}")
            elif event["method"] == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning"):
                out.append(
                    "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                )
            elif event["method"] == "Runtime.exceptionThrown":
                out.append(f"exception: {params['exceptionDetails'].get('text')}")
        return out

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, *, timeout_s: float = 60.0) -> Any:
        """Poll `expression` until it is truthy; one that throws (the page still loading: no
        `document.body` yet) counts as false. Fails with the body's `data-*` state after `timeout_s`."""
        give_up = time.monotonic() + timeout_s
        failed: RuntimeError | None
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as error:
                value, failed = None, error
            else:
                failed = None
            if value:
                return value
            if time.monotonic() > give_up:
                state = self.evaluate("JSON.stringify(document.body ? document.body.dataset : null)")
                raise AssertionError(
                    f"still false after {timeout_s:g}s: {expression} (body: {state}; last error: {failed})"
                )
            time.sleep(0.05)

    def resize(self, width: int, height: int) -> None:
        """The page's viewport, in CSS pixels (what a screenshot shows)."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def screenshot(self, path: Path) -> None:
        shot = self.call("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))
