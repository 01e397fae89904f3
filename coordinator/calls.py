"""The one place a control request is sent. Nothing else in quiesce talks to a Gym server's control plane.

For every request, in this order:
0. A call whose deadline has passed (less than `SEND_MARGIN_S` left) is not sent and not recorded;
   the caller gets a `timeout` result with `sent=False`.
1. `call.sent` is appended to the ledger — phase, method, path, url, timeout, request body (or
   query) — and, for a POST, committed before the request leaves. If the append fails (e.g.
   `FencedError`) nothing is sent. A read (GET: capabilities, a status long-poll) changes nothing
   on the server, so its `call.sent` is staged (`Ledger.stage`) and committed with the next
   append — a crash that loses it looks exactly like a crash just before the read; were the read
   still unanswered after `STAGED_READ_COMMIT_S`, the staged events are committed meanwhile.
   A POST's `call.sent` is write-behind (`durable=False`): committed, so it survives a crash of
   this process, and on disk with the next durable append. What makes that safe after a power
   loss too is a rule of the callers (attempt.py and the steps beside it): a POST is only ever
   sent under a checkpoint id whose `attempt.started` — durable, listing every participant — is
   already on disk, so the set of servers an attempt may have touched is known from durable
   events alone, and recovery asks each listed server without a surviving `call.sent` whether
   it saw this checkpoint id.
2. The request goes out on the caller's one `HttpClient` (`coordinator/http.py`: keep-alive
   connections per server origin; never redirected, never retried, no proxy, no cookies),
   `Authorization: Bearer <token>` (none from a caller without a token, which may only read
   capabilities), `User-Agent: quiesce/<version>`, with
   `max(0.001, deadline_ts - now)` for the whole exchange (connect, send, headers and every byte
   of the body: a server that trickles its reply is cut off at the deadline too). No cancel scope
   of its own: one cost about a fifth of a call's CPU at a 512-server fan-out, and every phase
   already runs inside the attempt's deadline scope.
3. The outcome is staged (`Ledger.stage`) before the caller sees it: validated, chained and given
   its seq at once, and committed in front of the next append — the next call's `call.sent`, or
   the operation's next record (`phase.failed`, its final event) — so it
   is committed before any action taken on it leaves the process, and durable with the next
   durable append. A crash before then loses it, which leaves the ledger exactly as a crash
   just before the reply arrived would. `call.replied` (200 and a reply that validates against
   the route's model) or `call.failed` with an error class:
   - `timeout`  — no complete reply within the time left to the deadline (or the caller's
     deadline scope cancelled the call: that is still recorded, then the cancellation propagates);
   - `connect`  — the connection could not be made, or broke before a complete reply;
   - `http`     — a status other than 200; `status`, `error.code` and its detail are kept;
   - `protocol` — a 200 whose body is not JSON, does not match the schema, or exceeds 1 MiB
     (reading stops past the cap); or bytes that are not an HTTP/1.x reply at all (no status);
     or, when the caller says which checkpoint the reply must be about (`expect_checkpoint`), a
     reply that names another one (`checkpoint_id` or `source_checkpoint_id`; none named is fine).
   An append is never interrupted by a cancellation (`Ledger.append`), so a started call always
   has an outcome row once the process carries on.

The token is handed to the ledger as a secret (redacted from every payload) and is never put in
an error message or a log line. Each call has a unique `call_id`: `<checkpoint_id>/<n>` (with
`@e<epoch>` appended to the checkpoint id when a later coordinator acts on an older attempt;
`e<epoch>-<phase>/<n>` for a call outside any attempt: `discovery`, `acknowledge`).
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlencode

import anyio
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from quiesce.coordinator.errors import ConfigError
from quiesce.coordinator.http import (
    BadReply,
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    HttpClient,
    ReplyTimeout,
)
from quiesce.coordinator.ids import epoch_of
from quiesce.coordinator.protocol import (
    CAPABILITIES_PATH,
    Capabilities,
    ControlError,
    Route,
)
from quiesce.coordinator.protocol_v2 import STATUS_PATH as V2_STATUS_PATH
from quiesce.coordinator.protocol_v2 import StatusReply, V2Route
from quiesce.coordinator.version import VERSION
from quiesce.ledger import Ledger, LedgerError

__all__ = [
    "MAX_REPLY_BYTES",
    "SEND_MARGIN_S",
    "CallResult",
    "Caller",
    "ErrorClass",
    "Target",
    "token_problem",
]

MAX_REPLY_BYTES: Final = 1 << 20
#: Every control request names its sender, so a server's log can tell the coordinator's calls apart.
USER_AGENT: Final = f"quiesce/{VERSION}"
#: A request body as compact JSON (one encoder, built once: ``json.dumps`` with options builds one per call).
_encode_json: Final = json.JSONEncoder(separators=(",", ":")).encode
#: A call with less than this left to its deadline is not sent (a request must leave before the deadline).
SEND_MARGIN_S: Final = 0.01
ErrorClass = Literal["timeout", "connect", "http", "protocol"]
#: A read (GET) still unanswered after this long has the staged events committed (see `_send`).
STAGED_READ_COMMIT_S: Final = 0.1


@dataclass(frozen=True)
class Target:
    """A server to call: its name (ledger `server` column), component and base URL."""

    name: str
    component: str
    url: str


@dataclass(frozen=True, slots=True)
class Body:
    """A request body encoded once (`encode_body`): its JSON form — what `call.sent` records — and
    the bytes sent. The same `Body` may go to many servers (a fan-out whose servers all get the
    same request): the model is dumped and encoded once, not once per server."""

    model: BaseModel
    data: dict[str, Any]
    raw: bytes


def encode_body(model: BaseModel) -> Body:
    """`model` as a request body: `model_dump(mode="json")`, and that as compact JSON in UTF-8."""
    data = model.model_dump(mode="json")
    return Body(model, data, _encode_json(data).encode("utf-8"))


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


def token_problem(token: str) -> str | None:
    """Why `token` cannot be a bearer token in a header (None when it can): it must be visible
    ASCII (RFC 6750), so it can never break the request's header lines. Never quotes the token."""
    if not token:
        return "the control token is empty"
    if not all("!" <= ch <= "~" for ch in token):
        return "the control token holds a space, a line break or a non-ASCII character"
    return None


class Caller:
    """Sends control calls for one coordinator (one epoch) and records each one in the ledger.

    A token that is not visible ASCII is refused here (`ConfigError`), before any call. Without
    a token (`token=None`: read-only, e.g. discovery) no Authorization header is sent and only
    `GET /capabilities` — which Gym serves without a token — may be called; any other call raises
    `ConfigError(no_token)` before anything is recorded or sent (`require_token`)."""

    def __init__(
        self,
        ledger: Ledger,
        token: str | None,
        *,
        epoch: int,
        client: HttpClient | None = None,
        no_token: str = "no control token: this call needs the Gym servers' control-plane bearer token",
    ) -> None:
        problem = token_problem(token) if token is not None else None
        if problem is not None:
            raise ConfigError(problem)
        self._ledger = ledger
        self._token = token
        self._no_token = no_token
        self._epoch = epoch
        self._given = client  # a client given by the caller is used for every call, never closed here
        self._client: HttpClient | None = None
        self._counter = 0
        self._own_id: tuple[str | None, bool] = (None, False)  # (checkpoint id, made in this epoch)

    def _http(self) -> HttpClient:
        """The HTTP client (`coordinator/http.py`): keep-alive connections per server origin,
        no limit on their number (a parallel fan-out opens one per server at once), so N servers
        cost O(N), not O(N²)."""
        if self._given is not None:
            return self._given
        if self._client is None:
            self._client = HttpClient()
        return self._client

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def require_token(self) -> None:
        """Raise `ConfigError` (saying which variable to set) when this caller has no token."""
        if self._token is None:
            raise ConfigError(self._no_token)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _call_id(self, checkpoint_id: str | None, phase: str = "discovery") -> str:
        self._counter += 1
        if checkpoint_id is None:
            return f"e{self._epoch}-{phase}/{self._counter}"
        if checkpoint_id != self._own_id[0]:  # one regex match per attempt, not per call
            self._own_id = (checkpoint_id, epoch_of(checkpoint_id) == self._epoch)
        if self._own_id[1]:
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
        """`GET /capabilities` (with the token when there is one), validated as `Capabilities`."""
        return await self._get(name, url, CAPABILITIES_PATH, Capabilities, deadline_ts, phase, checkpoint_id)

    async def v2_status(
        self,
        name: str,
        url: str,
        *,
        deadline_ts: float,
        phase: str = "discovery",
        checkpoint_id: str | None = None,
    ) -> CallResult:
        """`GET /ng-control/v1/checkpoint/status` of Gym's unified plane (with the token),
        validated as `protocol_v2.StatusReply`."""
        return await self._get(name, url, V2_STATUS_PATH, StatusReply, deadline_ts, phase, checkpoint_id)

    async def _get(
        self,
        name: str,
        url: str,
        path: str,
        reply_model: type[BaseModel],
        deadline_ts: float,
        phase: str,
        checkpoint_id: str | None,
    ) -> CallResult:
        """A recorded GET outside the route table, without query parameters."""
        return await self._send(
            server=name,
            base_url=url,
            method="GET",
            path=path,
            phase=phase,
            checkpoint_id=checkpoint_id,
            body=None,
            params=None,
            deadline_ts=deadline_ts,
            reply_model=reply_model,
        )

    async def call(
        self,
        target: Target,
        route: Route | V2Route,
        *,
        phase: str,
        checkpoint_id: str | None,
        deadline_ts: float,
        body: BaseModel | Body | None = None,
        params: dict[str, Any] | None = None,
        expect_checkpoint: str | None = None,
        check: Callable[[BaseModel], str | None] | None = None,
    ) -> CallResult:
        """One control call on `route`: POST with `body`, or GET with `params` (a status query).

        `body` is a request model, or one already encoded (`encode_body`: for a request sent to
        many servers). `checkpoint_id` None: a call outside any attempt (e.g. acknowledging
        completed results), whose call id is `e<epoch>-<phase>/<n>`. `check` judges a validated
        reply: the problem it returns makes the call a `protocol` failure (recorded as such)."""
        if route.method == "POST" and body is None:
            raise ValueError(f"{route.full_path} needs a request body")
        encoded = body if isinstance(body, Body) or body is None else encode_body(body)
        return await self._send(
            server=target.name,
            base_url=target.url,
            method=route.method,
            path=route.full_path,
            phase=phase,
            checkpoint_id=checkpoint_id,
            body=encoded,
            params=params,
            deadline_ts=deadline_ts,
            reply_model=route.reply,
            expect_checkpoint=expect_checkpoint,
            check=check,
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
        body: Body | None,
        params: dict[str, Any] | None,
        deadline_ts: float,
        reply_model: type[BaseModel],
        expect_checkpoint: str | None = None,
        check: Callable[[BaseModel], str | None] | None = None,
    ) -> CallResult:
        if path != CAPABILITIES_PATH:
            self.require_token()  # before anything is recorded: a call that cannot succeed
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
        call_id = self._call_id(checkpoint_id, phase)
        timeout_s = max(0.001, left)
        url = base_url + path
        raw = body.raw if body is not None else None
        recorded_body: Any = None
        if method == "POST":
            recorded_body = body.data if body is not None else None
        elif params:
            recorded_body = {"query": params}
        sent_data = {
            "phase": phase,
            "method": method,
            "path": path,
            "url": url,
            "timeout_s": timeout_s,
            "body": recorded_body,
        }
        # no shield needed here or around the outcome: an append, once called, is never
        # interrupted (Ledger.append); a cancellation reaches this task at its next checkpoint
        read = method != "POST"
        if read:  # a read changes nothing on the server: its record may ride with the next append
            sent = await self._ledger.stage(
                "call.sent", checkpoint_id=checkpoint_id, server=server, call_id=call_id, data=sent_data
            )
        else:
            sent = await self._ledger.append(
                "call.sent", checkpoint_id=checkpoint_id, server=server, call_id=call_id, data=sent_data,
                durable=False,
            )  # fmt: skip
        started = time.monotonic()
        try:
            if read:
                exchange = await self._read_committing_late(url, params, timeout_s)
            else:
                exchange = await self._exchange(method, url, raw, params, timeout_s)
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
                else:
                    foreign = _foreign_checkpoint(reply, expect_checkpoint)
                    problem = (
                        f"the reply names checkpoint {foreign!r}, not {expect_checkpoint!r}"
                        if foreign is not None
                        else check(reply)
                        if check is not None
                        else None
                    )
                    if problem is not None:
                        exchange = _Exchange(
                            status=exchange.status, body=exchange.body, error="protocol", detail=problem
                        )
        outcome = await self._record(checkpoint_id, server, call_id, exchange, elapsed)
        return _result(
            call_id, server, path, exchange, reply, elapsed, sent_seq=sent.seq, outcome_seq=outcome
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

    async def _read_committing_late(
        self, url: str, params: dict[str, Any] | None, timeout_s: float
    ) -> _Exchange:
        """A GET whose reply takes longer than `STAGED_READ_COMMIT_S` has the staged events (its
        own `call.sent` among them) committed meanwhile, so a long poll — a drain can take
        minutes — never leaves the ledger that far behind what was done.

        Raises what the exchange or that commit raised, as they raised it (never an exception
        group): a commit that fails (e.g. `FencedError`) stops the read and is raised."""
        failed: list[LedgerError] = []
        raised: list[Exception] = []
        exchange: _Exchange | None = None

        async def commit_later() -> None:
            await anyio.sleep(STAGED_READ_COMMIT_S)
            try:
                await self._ledger.flush()
            except LedgerError as error:
                failed.append(error)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(commit_later)
            try:
                exchange = await self._exchange("GET", url, None, params, timeout_s)
            except Exception as error:  # not a cancellation: that one goes through the group
                raised.append(error)
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        if raised:
            raise raised[0]
        assert exchange is not None
        return exchange

    async def _exchange(
        self,
        method: str,
        url: str,
        body: bytes | None,
        params: dict[str, Any] | None,
        timeout_s: float,
    ) -> _Exchange:
        return await _request(self._http(), self._token, method, url, body, params, timeout_s)

    async def peek_capabilities(self, name: str, url: str, *, deadline_ts: float) -> CallResult:
        """`GET /capabilities`, recorded nowhere (see `peek_capabilities`)."""
        return await peek_capabilities(self._http(), name, url, token=self._token, deadline_ts=deadline_ts)

    async def peek_v2_status(self, name: str, url: str, *, deadline_ts: float) -> CallResult:
        """The unified plane's status, recorded nowhere (see `peek_v2_status`)."""
        return await peek_v2_status(self._http(), name, url, token=self._token, deadline_ts=deadline_ts)


async def _peek(
    client: HttpClient,
    name: str,
    url: str,
    path: str,
    model: type[BaseModel],
    *,
    token: str | None,
    deadline_ts: float,
) -> CallResult:
    """A GET recorded nowhere, its reply validated as `model`. `call_id` is empty."""
    timeout_s = max(0.001, deadline_ts - time.time())
    started = time.monotonic()
    exchange = await _request(client, token, "GET", url + path, None, None, timeout_s)
    reply: BaseModel | None = None
    if exchange.error is None:
        try:
            reply = model.model_validate(exchange.body)
        except ValidationError as error:
            exchange = _Exchange(
                status=exchange.status,
                error="protocol",
                detail=f"reply does not match {model.__name__}: {_summarize(error)}",
            )
    return _result("", name, path, exchange, reply, time.monotonic() - started)


async def peek_capabilities(
    client: HttpClient, name: str, url: str, *, token: str | None, deadline_ts: float
) -> CallResult:
    """`GET /capabilities` that is recorded nowhere: for an observer (`quiesce status`), which
    changes nothing on a server and takes no epoch, so it never fences a coordinator at work.
    The token is sent when there is one (capabilities need none). `call_id` is empty."""
    path = CAPABILITIES_PATH
    return await _peek(client, name, url, path, Capabilities, token=token, deadline_ts=deadline_ts)


async def peek_v2_status(
    client: HttpClient, name: str, url: str, *, token: str | None, deadline_ts: float
) -> CallResult:
    """The unified plane's `GET /checkpoint/status`, recorded nowhere — for an observer, like
    `peek_capabilities` (a status read changes nothing). Without a token it is not sent: that
    status is bearer-protected."""
    if token is None:
        return CallResult(
            call_id="", server=name, path=V2_STATUS_PATH, ok=False, error="http", status=401,
            detail="a server of Gym's unified plane shows its checkpoint status only with the control"
            " token, which is not set: set it to read this server",
        )  # fmt: skip
    return await _peek(client, name, url, V2_STATUS_PATH, StatusReply, token=token, deadline_ts=deadline_ts)


async def peek_read(
    client: HttpClient,
    name: str,
    url: str,
    path: str,
    *,
    token: str | None,
    params: dict[str, Any] | None,
    deadline_ts: float,
) -> CallResult:
    """A control GET (a status read) that is recorded nowhere and whose reply is not validated:
    for `quiesce config check`, which asks only whether the server let the token through (any
    reply but 401), and takes no epoch. A status GET changes nothing on a server. `call_id` is
    empty."""
    timeout_s = max(0.001, deadline_ts - time.time())
    started = time.monotonic()
    exchange = await _request(client, token, "GET", url + path, None, params, timeout_s)
    return _result("", name, path, exchange, None, time.monotonic() - started)


def _result(
    call_id: str,
    server: str,
    path: str,
    exchange: _Exchange,
    reply: BaseModel | None,
    elapsed_s: float,
    *,
    sent_seq: int = 0,
    outcome_seq: int = 0,
) -> CallResult:
    """A sent call's result: ok exactly when the exchange has no error (only then the reply)."""
    ok = exchange.error is None
    return CallResult(
        call_id=call_id,
        server=server,
        path=path,
        ok=ok,
        status=exchange.status,
        body=exchange.body,
        reply=reply if ok else None,
        error=exchange.error,
        code=exchange.code,
        detail=exchange.detail,
        elapsed_s=elapsed_s,
        sent_seq=sent_seq,
        outcome_seq=outcome_seq,
    )


@functools.lru_cache(maxsize=16)
def _headers(token: str | None, post: bool) -> dict[str, str]:
    """A request's headers (never changed by the client: one dict per token and method kind)."""
    headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if post:
        headers["Content-Type"] = "application/json"
    return headers


async def _request(
    client: HttpClient,
    token: str | None,
    method: str,
    url: str,
    body: bytes | None,
    params: dict[str, Any] | None,
    timeout_s: float,
) -> _Exchange:
    """One HTTP exchange; its outcome classified (see the module docstring). Never raises.
    `body`: a POST's JSON bytes (`encode_body`)."""
    post = method == "POST"
    headers = _headers(token, post)
    data: bytes | None = (body if body is not None else b"null") if post else None
    if params:
        query = urlencode({k: _param(v) for k, v in params.items() if v is not None})
        if query:
            url = f"{url}?{query}"
    try:
        reply = await client.request(
            method, url, headers=headers, body=data, timeout_s=timeout_s, max_body=MAX_REPLY_BYTES
        )
    except ConnectTimeout:
        return _Exchange(error="connect", detail="could not connect before the deadline")
    except ReplyTimeout:
        return _Exchange(error="timeout", detail=f"no reply within {timeout_s:.3f}s (the deadline)")
    except ConnectFailed as error:
        return _Exchange(error="connect", detail=f"could not connect: {_plain(error)}")
    except BadReply as error:
        return _Exchange(error="protocol", detail=_plain(error))
    except (ConnectionLost, OSError) as error:
        return _Exchange(error="connect", detail=f"connection lost before a complete reply: {_plain(error)}")
    status = reply.status
    if reply.too_big:
        return _Exchange(status=status, error="protocol", detail="reply larger than 1 MiB")
    raw = reply.body
    try:
        parsed: Any = _parse_reply(raw) if raw else None
    except ValueError as error:
        parsed = None
        if status == 200:
            return _Exchange(
                status=status, error="protocol", detail=f"reply is not valid JSON ({_plain(error)})"
            )
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


def _parse_reply(raw: bytes) -> Any:
    """A reply body as plain JSON values, or `ValueError` naming what is wrong.

    Strict where the ledger must be: no NaN or infinities (the canonical encoding refuses them),
    no lone UTF-16 surrogate escape (it has no UTF-8 encoding), invalid UTF-8 refused, and at most
    `pydantic_core`'s 200 levels of nesting, so a hostile reply can never reach a RecursionError
    in validation, the ledger or a later replay. (The same parser pydantic uses; about 3x faster
    than `json.loads` on control replies.)"""
    parsed = from_json(raw, allow_inf_nan=False)
    if _may_overflow(raw) and not _all_finite(parsed):
        raise ValueError("a number too large for a float (it would read as infinity)")
    return parsed


#: What may be an exponent of a float that overflows to infinity: 3 significant digits or more.
#: (Strings match too: the walk that follows decides. Without a digit required before the ``e``,
#: the search skips along to each ``e`` and costs microseconds on a 30 KB reply, not a millisecond.)
_MAY_OVERFLOW_EXPONENT: Final = re.compile(rb"[eE]\+?0*[1-9][0-9]{2}")
#: Every digit as ``1``, so that a run of 309 digits (a float that overflows without an exponent)
#: is one substring search, not a regex tried at every digit.
_DIGITS_AS_ONES: Final = bytes.maketrans(b"0123456789", b"1" * 10)
_DIGIT_RUN: Final = b"1" * 309


def _may_overflow(raw: bytes) -> bool:
    """Whether ``raw`` holds what may be a number too large for a float: an exponent of 3
    significant digits or more, or 309 digits in a row. Every such number does; so do some strings."""
    if _MAY_OVERFLOW_EXPONENT.search(raw) is not None:
        return True
    return len(raw) >= len(_DIGIT_RUN) and _DIGIT_RUN in raw.translate(_DIGITS_AS_ONES)


def _all_finite(value: Any) -> bool:
    """No float in `value` is infinite (walked without recursion: its depth is the parser's)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def _foreign_checkpoint(reply: BaseModel, expected: str | None) -> str | None:
    """The checkpoint id a reply names when it is not `expected` (None: as expected, or none named)."""
    if expected is None:
        return None
    for key in ("checkpoint_id", "source_checkpoint_id"):
        named = getattr(reply, key, None)
        if isinstance(named, str) and named != expected:
            return named
    return None


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
