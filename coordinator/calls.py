"""The one place a control request is sent. Nothing else in quiesce talks to a Gym server's control plane.

For every request, in this order:
0. A call whose deadline has passed (less than `SEND_MARGIN_S` left) is not sent and not recorded;
   the caller gets a `timeout` result with `sent=False`.
1. `call.sent` is appended to the ledger — phase, method, path, url, timeout, request body (or
   query) — and committed before the request leaves. If the append fails (e.g. `FencedError`)
   nothing is sent. It is write-behind (`durable=False`): committed, so it survives a crash of
   this process, and on disk with the next durable append. What makes that safe after a power
   loss too is a rule of the callers (attempt.py): a POST is only ever sent under a checkpoint
   id whose `attempt.started` — durable, listing every participant — is already on disk, so the
   set of servers an attempt may have touched is known from durable events alone, and recovery
   asks each listed server without a surviving `call.sent` whether it saw this checkpoint id.
2. The request goes out on the caller's one `aiohttp.ClientSession` (keep-alive pools per host;
   never redirected, never retried), `Authorization: Bearer <token>`, timeout
   `max(0.001, deadline_ts - now)` as aiohttp's total (connect, send, headers and every read of
   the body: a server that trickles its reply is cut off at the deadline too). No cancel scope
   of its own: one cost about a fifth of a call's CPU at a 512-server fan-out, and every phase
   already runs inside the attempt's deadline scope.
3. The outcome is staged (`Ledger.stage`) before the caller sees it: validated, chained and given
   its seq at once, and committed in front of the next append — the next call's `call.sent`, or
   the operation's next record (`attempt.publishing`, `phase.failed`, its final event) — so it
   is committed before any action taken on it leaves the process, and durable with the next
   durable append. A crash before then loses it, which leaves the ledger exactly as a crash
   just before the reply arrived would. `call.replied` (200 and a reply that validates against
   the route's model) or `call.failed` with an error class:
   - `timeout`  — no complete reply within the time left to the deadline (or the caller's
     deadline scope cancelled the call: that is still recorded, then the cancellation propagates);
   - `connect`  — the connection could not be made, or broke before a complete reply;
   - `http`     — a status other than 200; `status`, `error.code` and its detail are kept;
   - `protocol` — a 200 whose body is not JSON, does not match the schema, or exceeds 1 MiB
     (the body is streamed and reading stops past the cap).
   An append is never interrupted by a cancellation (`Ledger.append`), so a started call always
   has an outcome row once the process carries on.

The token is handed to the ledger as a secret (redacted from every payload) and is never put in
an error message or a log line. Each call has a unique `call_id`: `<checkpoint_id>/<n>` (with
`@e<epoch>` appended to the checkpoint id when a later coordinator acts on an older attempt;
`e<epoch>-discovery/<n>` for discovery).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import aiohttp
import anyio
from pydantic import BaseModel, ValidationError

from coordinator.protocol import (
    CAPABILITIES_PATH,
    Capabilities,
    ControlError,
    Route,
)
from ledger import Ledger

__all__ = ["MAX_REPLY_BYTES", "SEND_MARGIN_S", "CallResult", "Caller", "ErrorClass", "Target"]

MAX_REPLY_BYTES: Final = 1 << 20
#: A call with less than this left to its deadline is not sent (a request must leave before the deadline).
SEND_MARGIN_S: Final = 0.01
ErrorClass = Literal["timeout", "connect", "http", "protocol"]


@dataclass(frozen=True)
class Target:
    """A server to call: its name (ledger `server` column), component and base URL."""

    name: str
    component: str
    url: str


@dataclass(frozen=True)
class CallResult:
    """What one control call produced, after its outcome is committed to the ledger.

    `ok` is True only for a 200 whose body validated; then `reply` is the validated model.
    Otherwise `error` says which class of failure, with `status`, `code` and `detail` when known.
    """

    call_id: str
    server: str
    path: str
    ok: bool
    status: int | None = None
    body: Any = None
    reply: BaseModel | None = None
    error: ErrorClass | None = None
    code: str | None = None
    detail: str | None = None
    elapsed_s: float = 0.0
    sent_seq: int = 0
    outcome_seq: int = 0
    #: False when the call was not sent at all (its deadline had passed): then nothing was recorded.
    sent: bool = True

    def describe(self) -> str:
        """A one-line description of a failure (no token, no body dump)."""
        if self.ok:
            return "ok"
        parts: list[str] = [self.error or "error"]
        if self.status is not None:
            parts.append(str(self.status))
        if self.code:
            parts.append(self.code)
        text = " ".join(parts)
        return f"{text}: {self.detail}" if self.detail else text


@dataclass
class _Exchange:
    status: int | None = None
    body: Any = None
    error: ErrorClass | None = None
    code: str | None = None
    detail: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Caller:
    """Sends control calls for one coordinator (one epoch) and records each one in the ledger."""

    def __init__(
        self,
        ledger: Ledger,
        token: str,
        *,
        epoch: int,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self._ledger = ledger
        self._token = token
        self._epoch = epoch
        self._given = session  # a session given by the caller is used for every call, never closed here
        self._session: aiohttp.ClientSession | None = None
        self._counter = 0

    def _http(self) -> aiohttp.ClientSession:
        """The HTTP session (created on first use, in the running event loop).

        aiohttp rather than httpx: measured in the same run, an httpx request cost about 1.4 ms
        of CPU against 0.4 ms for aiohttp, which is most of a control call's own cost. The
        connector has no connection limit (a parallel fan-out opens one connection per server at
        once) and keeps a pool per host, so N servers cost O(N), not O(N²).
        """
        if self._given is not None:
            return self._given
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0)  # TLS: aiohttp's default verified context
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _call_id(self, checkpoint_id: str | None) -> str:
        self._counter += 1
        if checkpoint_id is None:
            return f"e{self._epoch}-discovery/{self._counter}"
        if checkpoint_id.startswith(f"e{self._epoch}-"):
            return f"{checkpoint_id}/{self._counter}"
        return f"{checkpoint_id}@e{self._epoch}/{self._counter}"

    async def capabilities(
        self,
        name: str,
        url: str,
        *,
        deadline_ts: float,
        phase: str = "discovery",
        checkpoint_id: str | None = None,
    ) -> CallResult:
        """`GET /capabilities` (with the token anyway), validated as `Capabilities`."""
        return await self._send(
            server=name,
            base_url=url,
            method="GET",
            path=CAPABILITIES_PATH,
            phase=phase,
            checkpoint_id=checkpoint_id,
            body=None,
            params=None,
            deadline_ts=deadline_ts,
            reply_model=Capabilities,
        )

    async def call(
        self,
        target: Target,
        route: Route,
        *,
        phase: str,
        checkpoint_id: str,
        deadline_ts: float,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
    ) -> CallResult:
        """One control call on `route`: POST with `body`, or GET with `params` (a status query)."""
        if route.method == "POST" and body is None:
            raise ValueError(f"{route.full_path} needs a request body")
        return await self._send(
            server=target.name,
            base_url=target.url,
            method=route.method,
            path=route.full_path,
            phase=phase,
            checkpoint_id=checkpoint_id,
            body=body.model_dump(mode="json") if body is not None else None,
            params=params,
            deadline_ts=deadline_ts,
            reply_model=route.reply,
        )

    async def _send(
        self,
        *,
        server: str,
        base_url: str,
        method: str,
        path: str,
        phase: str,
        checkpoint_id: str | None,
        body: dict[str, Any] | None,
        params: dict[str, Any] | None,
        deadline_ts: float,
        reply_model: type[BaseModel],
    ) -> CallResult:
        left = deadline_ts - time.time()
        if left < SEND_MARGIN_S:
            # nothing is sent once the deadline has passed, so nothing is recorded either
            return CallResult(
                call_id="",
                server=server,
                path=path,
                ok=False,
                error="timeout",
                detail="not sent: the deadline had passed",
                sent=False,
            )
        call_id = self._call_id(checkpoint_id)
        timeout_s = max(0.001, left)
        url = base_url + path
        recorded_body: Any = body if method == "POST" else ({"query": params} if params else None)
        # no shield needed here or around the outcome: an append, once called, is never
        # interrupted (Ledger.append); a cancellation reaches this task at its next checkpoint
        sent = await self._ledger.append(
            "call.sent",
            checkpoint_id=checkpoint_id,
            server=server,
            call_id=call_id,
            data={
                "phase": phase,
                "method": method,
                "path": path,
                "url": url,
                "timeout_s": timeout_s,
                "body": recorded_body,
            },
            durable=False,
        )
        started = time.monotonic()
        try:
            exchange = await self._exchange(method, url, body, params, timeout_s)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._record(
                    checkpoint_id,
                    server,
                    call_id,
                    _Exchange(error="timeout", detail="cancelled at the attempt's deadline before a reply"),
                    time.monotonic() - started,
                )
            raise
        elapsed = time.monotonic() - started
        reply: BaseModel | None = None
        if exchange.error is None:
            if not isinstance(exchange.body, dict):
                exchange = _Exchange(
                    status=exchange.status,
                    error="protocol",
                    detail=f"reply is JSON {type(exchange.body).__name__}, not an object",
                )
            else:
                try:
                    reply = reply_model.model_validate(exchange.body)
                except ValidationError as error:
                    exchange = _Exchange(
                        status=exchange.status,
                        error="protocol",
                        detail=f"reply does not match {reply_model.__name__}: {_summarize(error)}",
                    )
        outcome = await self._record(checkpoint_id, server, call_id, exchange, elapsed)
        return CallResult(
            call_id=call_id,
            server=server,
            path=path,
            ok=exchange.error is None,
            status=exchange.status,
            body=exchange.body,
            reply=reply if exchange.error is None else None,
            error=exchange.error,
            code=exchange.code,
            detail=exchange.detail,
            elapsed_s=elapsed,
            sent_seq=sent.seq,
            outcome_seq=outcome,
        )

    async def _record(
        self, checkpoint_id: str | None, server: str, call_id: str, exchange: _Exchange, elapsed: float
    ) -> int:
        if exchange.error is None:
            event = await self._ledger.stage(
                "call.replied",
                checkpoint_id=checkpoint_id,
                server=server,
                call_id=call_id,
                data={"status": exchange.status, "body": exchange.body, "elapsed_s": elapsed},
            )
        else:
            event = await self._ledger.stage(
                "call.failed",
                checkpoint_id=checkpoint_id,
                server=server,
                call_id=call_id,
                data={
                    "error": exchange.error,
                    "status": exchange.status,
                    "code": exchange.code,
                    "detail": exchange.detail or exchange.error,
                    "elapsed_s": elapsed,
                },
            )
        return event.seq

    async def _exchange(
        self,
        method: str,
        url: str,
        body: dict[str, Any] | None,
        params: dict[str, Any] | None,
        timeout_s: float,
    ) -> _Exchange:
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        data: bytes | None = None
        if method == "POST":
            headers["Content-Type"] = "application/json"
            data = json.dumps(body, separators=(",", ":")).encode("utf-8")
        query = {k: _param(v) for k, v in params.items() if v is not None} if params else None
        try:
            async with self._http().request(
                method,
                url,
                data=data,
                params=query,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
            ) as response:
                status = response.status
                too_big = False
                raw: bytes | bytearray
                length = response.content_length
                if length is not None and length <= MAX_REPLY_BYTES:
                    raw = await response.read()  # framed by its Content-Length: never more
                else:  # no length, or a larger one: streamed, and cut off past the cap
                    raw = bytearray()
                    async for chunk in response.content.iter_any():
                        raw.extend(chunk)
                        if len(raw) > MAX_REPLY_BYTES:
                            too_big = True
                            response.close()  # stop reading: the connection is dropped, not reused
                            break
        except aiohttp.ConnectionTimeoutError:
            return _Exchange(error="connect", detail="could not connect before the deadline")
        except TimeoutError:
            return _Exchange(error="timeout", detail=f"no reply within {timeout_s:.3f}s (the deadline)")
        except aiohttp.ClientConnectorError as error:
            return _Exchange(error="connect", detail=f"could not connect: {_plain(error)}")
        except (aiohttp.ClientError, OSError) as error:
            return _Exchange(
                error="connect", detail=f"connection lost before a complete reply: {_plain(error)}"
            )
        if too_big:
            return _Exchange(status=status, error="protocol", detail="reply larger than 1 MiB")
        try:
            parsed: Any = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            parsed = None
            if status == 200:
                return _Exchange(status=status, error="protocol", detail="reply is not valid JSON")
        if status != 200:
            code, detail = _error_fields(parsed)
            return _Exchange(
                status=status,
                body=parsed,
                error="http",
                code=code,
                detail=detail or f"HTTP {status}",
            )
        return _Exchange(status=status, body=parsed)


def _param(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _plain(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text.splitlines()[0][:200]


def _summarize(error: ValidationError) -> str:
    items = error.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in items[:3]]
    more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
    return "; ".join(parts) + more


def _error_fields(parsed: Any) -> tuple[str | None, str | None]:
    """`error.code` and its detail (or the resources' `message`; or FastAPI's `detail`)."""
    if isinstance(parsed, dict):
        try:
            err = ControlError.model_validate(parsed).error
            return err.code, err.detail or err.message
        except ValidationError:
            pass
        detail = parsed.get("detail")
        if isinstance(detail, str):
            return None, detail[:500]
        if detail is not None:
            return None, json.dumps(detail)[:500]
    return None, None
