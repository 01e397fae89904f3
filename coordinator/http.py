"""The HTTP/1.1 client under every control call (`coordinator/calls.py`), also `quiesce status`'s peeks
and the service client's requests (`tools/serve/client.py`).

Why not a general client: a control call is one small JSON request and one small JSON reply, and
at a 512-server fan-out the client's own CPU per call was most of the coordinator's. Measured on
the bench machine, 512 parallel GETs cost 320 µs of CPU per call with aiohttp and 187 µs with
this client (task and JSON parsing included in both), and the coordinator's CPU per 512-server
save fell by about a third (bench #4: 1.28 s to 0.9–1.0 s). The C parser of the reply is
`httptools` (llhttp, the parser of Node.js and of uvicorn); this module only frames requests,
keeps connections and enforces the limits below.

Rules it keeps:

- One request, one reply, on a keep-alive connection per origin (scheme, host, port): an idle
  pooled one if there is one, else a new one. Never redirected, never retried, no proxy, no
  cookies. `https` uses the default verified TLS context (system CAs, `SSL_CERT_FILE` honoured).
- Everything — connect, TLS handshake, sending, the status line, headers and every byte of the
  body — ends by the call's deadline (`timeout_s` from the call): a server that trickles its
  reply is cut off then (`ReplyTimeout`; `ConnectTimeout` while still connecting).
- A reply is framed by its `Content-Length`, by chunked encoding (decoded by the parser), or
  else runs to end of file. Headers larger than `MAX_HEAD_BYTES` fail the call (`BadReply`); a
  body larger than `max_body` stops the read: the reply comes back `too_big`, body truncated.
- A connection goes back to the pool only after a complete reply that lets it stay open
  (`should_keep_alive`), with nothing unasked-for after it. Any failure, cap, timeout or
  cancellation closes the connection it was using, so a pooled connection never holds part of
  an old reply. A pooled connection the server has closed, or that has been idle for more than
  `IDLE_REUSE_S` (so the server may be closing it right now), is closed when next taken.
- The caller is cancelled like any awaitable (anyio cancel scopes): the connection is closed
  and the cancellation propagates.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import quote, urlsplit

import anyio
import httptools

__all__ = [
    "IDLE_REUSE_S",
    "MAX_HEAD_BYTES",
    "BadReply",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionLost",
    "HttpClient",
    "HttpFailure",
    "Reply",
    "ReplyTimeout",
]

#: The status line and headers of a reply may not exceed this many bytes.
MAX_HEAD_BYTES: Final = 64 * 1024
#: A pooled connection idle for longer is closed instead of reused: servers end idle keep-alive
#: connections on their own timer (uvicorn after 5 s, gunicorn after 2 s), and a request sent
#: just as the server closes would be lost with the connection.
IDLE_REUSE_S: Final = 1.5


class HttpFailure(Exception):
    """No complete reply. The message is safe to record: it never holds request headers."""


class ConnectFailed(HttpFailure):
    """The connection (or its TLS handshake) could not be made."""


class ConnectTimeout(HttpFailure):
    """The deadline passed while connecting."""


class ReplyTimeout(HttpFailure):
    """The deadline passed after the request was sent, before the reply was complete."""


class ConnectionLost(HttpFailure):
    """The connection closed or broke before the reply was complete."""


class BadReply(HttpFailure):
    """The bytes that came back are not an HTTP/1.x reply this client accepts."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply read to its end (or to `max_body` bytes of body when `too_big`)."""

    status: int
    body: bytes
    too_big: bool = False


@dataclass(frozen=True, slots=True)
class _Origin:
    key: tuple[str, str, int]
    host: str
    port: int
    tls: bool
    host_header: str


_TARGET_SAFE: Final = "/?#[]@!$&'()*+,;=:%-._~"


#: `_origin_and_target` per URL: a coordinator sends the same few URLs over and over (one per
#: server and route), and parsing one costs more than the rest of building its request.
_PARSED: dict[str, tuple[_Origin, str]] = {}
_PARSED_MAX: Final = 8192


def _origin_and_target(url: str) -> tuple[_Origin, str]:
    """The origin to connect to and the request target of `url`; `ConnectFailed` if it is not a
    usable http(s) URL (never cached)."""
    known = _PARSED.get(url)
    if known is None:
        known = _parse_url(url)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[url] = known
    return known


def _parse_url(url: str) -> tuple[_Origin, str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ConnectFailed(f"not an http(s) URL: {url!r}")
    tls = scheme == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError:
        raise ConnectFailed(f"bad port in URL {url!r}") from None
    host = parts.hostname
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise ConnectFailed(f"bad host name in URL {url!r}") from None
    shown = f"[{host}]" if ":" in host else host
    default = 443 if tls else 80
    host_header = shown if port == default else f"{shown}:{port}"
    # non-ASCII and spaces percent-encoded; what is already encoded, and every delimiter, kept
    target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_TARGET_SAFE)
    return _Origin((scheme, host, port), host, port, tls, host_header), target


class _Connection(asyncio.Protocol):
    """One connection: its transport and the reply being read on it (if any)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future[Reply] | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._body = bytearray()
        self._max_body = 0
        self._head_bytes = 0
        self._headers_done = False
        self._framed = False  # Content-Length or chunked: else the body runs to end of file
        self.reusable = False
        self.idle_since = 0.0  # loop time it went back to the pool

    # -- driving one exchange ------------------------------------------------------------------

    def begin(self, max_body: int) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._body = bytearray()
        self._max_body = max_body
        self._head_bytes = 0
        self._headers_done = False
        self._framed = False
        self.reusable = False
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _finish(self, reply: Reply | None = None, error: BaseException | None = None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            return
        if error is not None:
            waiter.set_exception(error)
        else:
            assert reply is not None
            waiter.set_result(reply)

    def expire(self) -> None:
        """The deadline passed: fail the exchange and drop the connection."""
        self._finish(error=ReplyTimeout("no complete reply before the deadline"))
        self.close()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport, though not always an `asyncio.Transport` subclass: uvloop's are not
        # (they implement the same methods), and the coordinator must run inside a uvloop host
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self._waiter is None or parser is None:
            self.close()  # bytes nobody asked for: the connection cannot be trusted again
            return
        reading_head = not self._headers_done
        if reading_head:
            self._head_bytes += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._finish(error=BadReply("the server switched protocols"))
            self.close()
            return
        except httptools.HttpParserError as error:
            self._finish(error=BadReply(f"not an HTTP/1.x reply: {error}"))
            self.close()
            return
        # the head's size: what came before the headers ended, less the body that followed them
        if reading_head and self._head_bytes - len(self._body) > MAX_HEAD_BYTES:
            self._finish(error=BadReply(f"reply headers larger than {MAX_HEAD_BYTES} bytes"))
            self.close()

    def eof_received(self) -> bool:
        self._ended("the server closed the connection")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(f"{exc}" if exc is not None else "the server closed the connection")

    def _ended(self, why: str) -> None:
        self.closed = True
        if self._waiter is None or self._parser is None:
            return
        if self._headers_done and not self._framed:  # a body framed by end of file: complete
            self._finish(Reply(self._parser.get_status_code(), bytes(self._body)))
        else:
            self._finish(error=ConnectionLost(why))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._waiter is None:  # a second reply after the one asked for: never reuse this one
            self.reusable = False
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        if self._waiter is None or self._parser is None:
            return
        if len(self._body) + len(body) > self._max_body:
            room = self._max_body - len(self._body)
            self._body += body[:room]
            self._finish(Reply(self._parser.get_status_code(), bytes(self._body), too_big=True))
            self.close()
            return
        self._body += body

    def on_message_complete(self) -> None:
        parser = self._parser
        if self._waiter is None or parser is None:
            return
        self.reusable = parser.should_keep_alive() and not self.closed
        # the next bytes, if any, are a reply nobody asked for (data_received closes on them)
        self._parser = None
        self._finish(Reply(parser.get_status_code(), bytes(self._body)))


class HttpClient:
    """Keep-alive connections per origin; `request` sends one request and reads its reply.

    Use from one event loop. `aclose` closes every connection (idle or in use).
    """

    #: How long an idle pooled connection may be reused; None: `IDLE_REUSE_S` (a subclass may set it).
    idle_reuse_s: float | None = None

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def _connect(self, origin: _Origin, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            with anyio.fail_after(timeout_s):
                _, conn = await loop.create_connection(
                    _Connection,
                    origin.host,
                    origin.port,
                    ssl=self._tls_context() if origin.tls else None,
                    server_hostname=origin.host if origin.tls else None,
                )
        except TimeoutError:
            raise ConnectTimeout("could not connect before the deadline") from None
        except ssl.SSLError as error:
            raise ConnectFailed(f"TLS handshake failed: {error.reason or error}") from None
        except OSError as error:
            raise ConnectFailed(error.strerror or str(error) or type(error).__name__) from None
        return conn

    def _take_idle(self, key: tuple[str, str, int], now: float) -> _Connection | None:
        idle = self._idle.get(key)
        limit = IDLE_REUSE_S if self.idle_reuse_s is None else self.idle_reuse_s
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since <= limit:
                return conn
            conn.close()
            self._all.discard(conn)
        return None

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str],
        body: bytes | None,
        timeout_s: float,
        max_body: int,
    ) -> Reply:
        """Send `method url` and read the reply; raise an `HttpFailure` subclass when there is none.

        `headers` must not hold `Host` or `Content-Length` (set here); a name or value with a
        line break raises ``ValueError`` (it would end the header early), naming neither.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        origin, target = _origin_and_target(url)
        head = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise ValueError("an HTTP header name or value holds a line break")
            head.append(f"{name}: {value}\r\n")
        if body is not None or method == "POST":
            head.append(f"Content-Length: {len(body or b'')}\r\n")
        head.append("\r\n")
        try:
            data = "".join(head).encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError("an HTTP header holds a character outside Latin-1") from None
        if body:
            data += body
        conn = self._take_idle(origin.key, loop.time())
        if conn is None:
            conn = await self._connect(origin, timeout_s)
            self._all.add(conn)
        waiter = conn.begin(max_body)
        timer = loop.call_at(deadline, conn.expire)
        try:
            transport = conn.transport
            if conn.closed or transport is None or transport.is_closing():
                raise ConnectionLost("the server closed the connection")
            transport.write(data)
            reply = await waiter
        except BaseException:
            conn.close()
            self._all.discard(conn)
            raise
        finally:
            timer.cancel()
        if conn.reusable and not conn.closed:
            conn.idle_since = loop.time()
            self._idle.setdefault(origin.key, []).append(conn)
        else:
            conn.close()
            self._all.discard(conn)
        return reply

    async def aclose(self) -> None:
        """Close every connection; the client may still be used afterwards (it reconnects)."""
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks
