"""The checks every request passes before any route runs: its host, its origin, its content type
and the size of its body (an ASGI middleware around the whole app).

Rules kept here, in this order, each refusal in the service's error shape and nothing else done:
- `Host` must be one the service answers to (`hosts.ServedHosts`), else 421 `MisdirectedHost`:
  a page whose DNS name was pointed at this address (rebinding) gets nothing, not even `/`.
- `Origin`, when sent, must be the service's own (`hosts.same_origin`), else 403 `CrossOrigin`
  — on every route: another site's page can neither drive the servers nor read the ledger.
- A request that may change state (any method but GET, HEAD and OPTIONS) must say
  `Content-Type: application/json`, even with an empty body, else 415 `UnsupportedMediaType`. No
  HTML form can send that type, and a script on another origin cannot without the CORS approval
  this service never gives; a form or a bodiless `fetch`/beacon sends another type or none.
- A body is read whole before the route (at most `MAX_BODY_BYTES`, 1 MiB; the largest request
  the API takes is a few KiB): a larger `Content-Length` is refused with 413 `BodyTooLarge`
  before any byte of it is read, and a body sent without one when it passes the limit. The body
  is never parsed, logged or kept then; the server reads and drops the rest of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quiesce.coordinator.errors import QuiesceError
from quiesce.tools.serve.errors import BodyTooLarge, CrossOrigin, MisdirectedHost, UnsupportedMediaType
from quiesce.tools.serve.hosts import ALLOW_HOSTS_ENV, ServedHosts, same_origin

__all__ = ["MAX_BODY_BYTES", "RequestGuard"]

#: The largest request body the service reads.
MAX_BODY_BYTES: Final = 1 << 20
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_SHOWN: Final = 120  # at most this much of a refused header is repeated in the message


def _shown(value: str) -> str:
    return repr(value if len(value) <= _SHOWN else value[:_SHOWN] + "...")


class RequestGuard:
    """The ASGI middleware of the module docstring; `refuse` renders an error as the service's reply."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        hosts: ServedHosts,
        refuse: Callable[[QuiesceError], Response],
        max_body: int = MAX_BODY_BYTES,
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.refuse = refuse
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            refusal, receive = await self._read_body(scope, receive)
        if refusal is not None:
            await self.refuse(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> QuiesceError | None:
        """What the request's headers alone refuse it for (None: nothing)."""
        headers: dict[bytes, list[str]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, []).append(value.decode("latin-1"))
        hosts = headers.get(b"host", [])
        host = hosts[0] if len(hosts) == 1 else None
        if host is None or not self.hosts.allows(host):
            given = "no Host header" if not hosts else f"Host {_shown(', '.join(hosts))}"
            return MisdirectedHost(
                f"this service does not answer to {given}: it answers to {self.hosts.describe()}."
                f" Reach it by one of those, or allow the name with {ALLOW_HOSTS_ENV}=NAME[:PORT] where"
                " it is started (a name that is not allowed may be another site's, rebound to this address)"
            )
        origins = headers.get(b"origin")
        if origins is not None and (len(origins) != 1 or not same_origin(origins[0], host)):
            return CrossOrigin(
                f"a request from origin {_shown(', '.join(origins))} is refused: only pages this service"
                f" serves (origin http://{host}) may call it"
            )
        method = scope["method"]
        if method not in _SAFE_METHODS:
            types = headers.get(b"content-type", [])
            media = types[0].partition(";")[0].strip().lower() if len(types) == 1 else None
            if media != "application/json":
                got = f"Content-Type {_shown(', '.join(types))}" if types else "no Content-Type"
                return UnsupportedMediaType(
                    f"{method} {scope['path']} takes JSON: send Content-Type: application/json (with an"
                    f" empty body or {{}} when there is nothing to say); got {got}"
                )
        lengths = headers.get(b"content-length", [])
        if any(not v.strip().isdigit() or int(v) > self.max_body for v in lengths):
            return self._too_large()
        return None

    def _too_large(self) -> BodyTooLarge:
        return BodyTooLarge(
            f"the request body is larger than {self.max_body} bytes, the most this service reads"
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[QuiesceError | None, Receive]:
        """Read the whole body (refused past `max_body`); a `receive` that hands it to the app."""
        if scope["method"] in _SAFE_METHODS and not any(
            name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"]
        ):
            return None, receive  # nothing to read: a stream's route waits on `receive` for the end
        chunks: list[bytes] = []
        size = 0
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client left: the route finds out as it would have
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                return self._too_large(), receive
            chunks.append(body)
            if not message.get("more_body", False):
                break
        pending = [first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        return None, replay
